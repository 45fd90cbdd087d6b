"""Train a model: config -> tokenised corpus -> jitted train step -> checkpoints, metrics, a sample.

python train.py --config configs/tiny.yaml [--set train.steps=300 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from atlas_jax.config import Config, ConfigError, load_config
from atlas_jax.data.dataset import sample_windows, tokenize_corpus
from atlas_jax.data.tokenizer import load_tokenizer
from atlas_jax.decoding.generate import SamplingParams, generate
from atlas_jax.training import checkpoint
from atlas_jax.training.step import init_state, make_eval_step, make_train_step


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--config", default="configs/tiny.yaml", help="YAML preset")
  p.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="override a config field, e.g. --set train.steps=100 (repeatable)",
  )
  p.add_argument(
    "--sample-prompt",
    default="def ",
    help="prompt to complete with the trained model at the end ('' to skip)",
  )
  p.add_argument("--sample-tokens", type=int, default=96)
  return p.parse_args(argv)


def evaluate(eval_step, params, corpus, cfg: Config) -> float | None:
  if len(corpus) <= cfg.train.seq_len + 1 or cfg.train.eval_batches == 0:
    return None
  rng = np.random.default_rng(1234)  # the same eval windows every time
  losses = [
    float(
      eval_step(
        params,
        {
          "tokens": sample_windows(
            corpus, batch=cfg.train.batch_size, seq_len=cfg.train.seq_len, rng=rng
          )
        },
      )
    )
    for _ in range(cfg.train.eval_batches)
  ]
  return float(np.mean(losses))


def unigram_entropy(corpus, vocab_size: int) -> float:
  """Cross-entropy (nats) of the best context-free model: the baseline learning must beat."""
  counts = np.bincount(corpus.tokens, minlength=vocab_size).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    cfg = load_config(args.config, args.set)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
  except (ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if tokenizer.vocab_size > cfg.model.vocab_size:
    print(
      f"error: model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
      f"vocabulary ({tokenizer.vocab_size})",
      file=sys.stderr,
    )
    return 2

  run_dir = Path(cfg.train.checkpoint_dir)
  checkpoint.write_run_files(run_dir, cfg)
  print(f"devices: {jax.devices()}")
  t0 = time.time()
  train_corpus, eval_corpus = tokenize_corpus(
    cfg.data.source, tokenizer, eval_fraction=cfg.data.eval_fraction
  )
  baseline = unigram_entropy(train_corpus, tokenizer.vocab_size)
  print(
    f"corpus: {len(train_corpus):,} train / {len(eval_corpus):,} eval tokens "
    f"({time.time() - t0:.1f}s); unigram baseline {baseline:.3f} nats/token"
  )

  graphdef, state = init_state(
    cfg, jax.random.key(cfg.train.seed), implementation=cfg.attention.implementation
  )
  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  print(f"model: {n_params:,} parameters")
  train_step = make_train_step(cfg, graphdef)
  eval_step = make_eval_step(graphdef)
  mngr = checkpoint.manager(run_dir)
  rng = np.random.default_rng(cfg.train.seed)
  tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
  log = (run_dir / "metrics.jsonl").open("a")

  t_last, steps_since = time.time(), 0
  for step in range(1, cfg.train.steps + 1):
    batch = {
      "tokens": sample_windows(
        train_corpus, batch=cfg.train.batch_size, seq_len=cfg.train.seq_len, rng=rng
      )
    }
    state, metrics = train_step(state, batch)
    steps_since += 1
    last = step == cfg.train.steps
    if step % cfg.train.log_every == 0 or last:
      metrics = {k: float(v) for k, v in metrics.items()}
      if not np.isfinite(metrics["loss"]):
        print(f"error: loss is {metrics['loss']} at step {step}; stopping", file=sys.stderr)
        return 1
      elapsed = time.time() - t_last
      record = {
        "step": step,
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "learning_rate": metrics["learning_rate"],
        "tokens_per_s": steps_since * tokens_per_step / elapsed,
      }
      if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or last):
        record["eval_loss"] = evaluate(eval_step, state.params, eval_corpus, cfg)
      print(
        "  ".join(
          f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()
        ),
        flush=True,
      )
      log.write(json.dumps(record) + "\n")
      log.flush()
      t_last, steps_since = time.time(), 0
    if (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) or last:
      checkpoint.save(mngr, step, state.params, state.opt_state, {"step": step})
  mngr.wait_until_finished()
  print(f"checkpoint: {run_dir} (step {cfg.train.steps})")

  if args.sample_prompt:
    model, _, _ = checkpoint.load_model(run_dir, implementation=cfg.attention.implementation)
    prompt = tokenizer.encode(args.sample_prompt)
    max_new = min(args.sample_tokens, cfg.model.max_seq_len - len(prompt))
    out = generate(
      model, [prompt], SamplingParams(max_new_tokens=max_new), eos_id=tokenizer.eos_id
    )[0]
    print(f"sample (greedy): {args.sample_prompt + tokenizer.decode(out)!r}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
