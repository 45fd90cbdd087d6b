"""Train a model: config -> mesh -> sharded init -> grain data -> jitted steps -> checkpoints.

    python train.py --config configs/tiny.yaml [--set train.steps=300 --set train.remat=full ...]

Rerunning the same command resumes from the run directory's latest checkpoint (model, optimizer,
step and data position), so an interrupted run continues exactly where it stopped. On several
hosts, run the same command on each with mesh.coordinator_address / num_processes / process_id
set (or the environment jax.distributed reads on TPU pods and SLURM).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import numpy as np

from atlas_jax.config import Config, ConfigError, load_config
from atlas_jax.data import pipeline
from atlas_jax.data.tokenizer import load_tokenizer
from atlas_jax.decoding.generate import SamplingParams, generate
from atlas_jax.training import checkpoint
from atlas_jax.training import sharding as shd
from atlas_jax.training.metrics import (
  Logger,
  flops_per_token,
  matmul_params,
  mfu,
  peak_memory_bytes,
)
from atlas_jax.training.step import make_eval_step, make_train_step, make_trainer
from atlas_jax.training.xla_flags import apply as apply_xla_flags


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
    "--data-cache",
    default=None,
    help="where tokenised corpora are stored (default: <checkpoint_dir>/../.data)",
  )
  p.add_argument(
    "--sample-prompt",
    default="def ",
    help="prompt to complete with the trained model at the end ('' to skip)",
  )
  p.add_argument("--sample-tokens", type=int, default=96)
  return p.parse_args(argv)


def init_distributed(cfg: Config) -> None:
  """Joins a multi-process run when the config (or the environment on pods/SLURM) asks for it."""
  m = cfg.mesh
  if m.coordinator_address is None and m.num_processes is None:
    return
  kwargs = {"coordinator_address": m.coordinator_address, "process_id": m.process_id}
  if m.num_processes not in (None, -1):
    kwargs["num_processes"] = m.num_processes
  # CPU processes exchange collectives over gloo (GPU/TPU use their own interconnect).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**kwargs)


# Fields that may change when a run is resumed (how it runs, not what it computes).
RESUME_MAY_CHANGE = {
  "steps",
  "log_every",
  "eval_every",
  "eval_batches",
  "checkpoint_every",
  "keep_checkpoints",
  "checkpoint_dir",
  "remat",
  "remat_every",
  "sharding",
  "peak_tflops",
  "on_corrupt_checkpoint",
  "loss_chunk",
  "xla_flags",
}


def check_resumable(run_dir: Path, cfg: Config) -> None:
  """A run directory holding checkpoints resumes only with the same model, data and training."""
  old_path = run_dir / "config.yaml"
  if not old_path.is_file() or not any(p.name.isdigit() for p in run_dir.iterdir()):
    return
  old = load_config(old_path)
  for section in ("model", "data", "train"):
    a, b = dataclasses.asdict(getattr(old, section)), dataclasses.asdict(getattr(cfg, section))
    diff = [k for k in b if a.get(k) != b[k] and k not in RESUME_MAY_CHANGE]
    if diff:
      raise ConfigError(
        f"{run_dir} holds a run with different {section} settings ({', '.join(diff)}); "
        "use another train.checkpoint_dir or the same settings"
      )


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    cfg = load_config(args.config, args.set)
    # Before anything starts a jax backend: XLA reads its flags once, at start-up.
    added_flags = apply_xla_flags(cfg.train.xla_flags)
    run_dir = Path(cfg.train.checkpoint_dir)
    cache_dir = Path(args.data_cache) if args.data_cache else run_dir.parent / ".data"
    check_resumable(run_dir, cfg)
    resuming = run_dir.is_dir() and any(p.name.isdigit() for p in run_dir.iterdir())
    if resuming and cfg.data.tokenizer != "byte" and (run_dir / "tokenizer.json").is_file():
      tokenizer = load_tokenizer(str(run_dir / "tokenizer.json"))  # the one the run began with
    else:
      t0 = time.time()
      tokenizer = pipeline.tokenizer_for(cfg.data, cache_dir)
      if time.time() - t0 > 1:
        print(f"tokenizer: {cfg.data.tokenizer} trained in {time.time() - t0:.1f}s")
    if tokenizer.vocab_size > cfg.model.vocab_size:
      raise ConfigError(
        f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
        f"vocabulary ({tokenizer.vocab_size})"
      )
    init_distributed(cfg)
    trainer = make_trainer(cfg)
  except (ConfigError, ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  main_process = jax.process_index() == 0
  say = print if main_process else (lambda *a, **k: None)
  if main_process:
    checkpoint.write_run_files(run_dir, cfg, tokenizer)
  say(
    f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}, "
    f"processes: {jax.process_count()}, mesh: {dict(trainer.mesh.shape)}"
  )
  if added_flags:
    say(f"XLA flags added for {jax.default_backend()}: {added_flags}")

  t0 = time.time()
  try:
    files = pipeline.token_files(cfg.data, tokenizer, cache_dir, log=say)
    train_ds = pipeline.train_dataset(
      *files["train"],
      seq_len=cfg.train.seq_len,
      batch_size=cfg.train.batch_size,
      seed=cfg.train.seed,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
    )
  except (ValueError, OSError) as e:
    print(f"error: data.source={cfg.data.source!r}: {e}", file=sys.stderr)
    return 2
  eval_data = pipeline.eval_batches(
    *files["eval"],
    seq_len=cfg.train.seq_len,
    batch_size=cfg.train.batch_size,
    n_batches=cfg.train.eval_batches,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
  )
  shortfall = pipeline.eval_shortfall(
    *files["eval"],
    seq_len=cfg.train.seq_len,
    batch_size=cfg.train.batch_size,
    eval_fraction=cfg.data.eval_fraction,
  )
  if shortfall and cfg.train.eval_every and cfg.train.eval_batches:
    say(f"note: {shortfall}")
  counts = np.bincount(np.asarray(files["train"][0]), minlength=tokenizer.vocab_size)
  p = counts[counts > 0] / counts.sum()
  unigram = float(-(p * np.log(p)).sum())  # the loss of a model that ignores the context
  say(
    f"corpus: {len(files['train'][0]):,} train / {len(files['eval'][0]):,} eval tokens "
    f"({time.time() - t0:.1f}s); unigram baseline {unigram:.3f} nats/token"
  )

  mngr = checkpoint.manager(run_dir, max_to_keep=cfg.train.keep_checkpoints)
  start = 0
  if mngr.latest_step() is not None:
    try:
      step, (state, meta), damaged = checkpoint.newest_intact(
        list(mngr.all_steps()),
        lambda s: checkpoint.restore(mngr, trainer.abstract_state(), trainer.state_shardings, s),
        fallback=cfg.train.on_corrupt_checkpoint == "fallback",
        warn=lambda message: say(message, file=sys.stderr),
        hint=" (train.on_corrupt_checkpoint=stop; 'fallback' resumes from the newest intact step)",
      )
    except checkpoint.CheckpointError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    if damaged:
      # Out of orbax's sight, or the resumed run could not save those steps again.
      if main_process:
        moved = checkpoint.set_aside(run_dir, damaged)
        say(f"set aside the damaged steps as {', '.join(p.name for p in moved)}")
      if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("checkpoint.set_aside")
      mngr = checkpoint.manager(run_dir, max_to_keep=cfg.train.keep_checkpoints)
    start = int(meta["data_index"])
    say(f"resumed from {run_dir} at step {start}")
  else:
    state = trainer.init(jax.random.key(cfg.train.seed))
  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  flops_tok = flops_per_token(cfg.model, matmul_params(state.params), cfg.train.seq_len)
  say(
    f"model: {n_params:,} parameters; precision {cfg.train.precision}, remat "
    f"{cfg.train.remat}, sharding {cfg.train.sharding}"
  )

  train_step = make_train_step(trainer)
  eval_step = make_eval_step(trainer)
  batch_sharding = shd.batch_sharding(trainer.mesh)
  to_global = lambda local: jax.tree.map(
    lambda x: jax.make_array_from_process_local_data(batch_sharding, x), local
  )
  logger = Logger(run_dir, enabled=main_process)
  tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
  progress = sys.stdout.isatty() and main_process

  t_last, steps_since = time.time(), 0
  record: dict = {}  # the last metrics logged
  for step in range(start + 1, cfg.train.steps + 1):
    state, metrics = train_step(state, to_global(train_ds[step - 1]))
    steps_since += 1
    last = step == cfg.train.steps
    if progress:
      done = int(30 * step / cfg.train.steps)
      print(f"\r[{'#' * done}{'.' * (30 - done)}] {step}/{cfg.train.steps}", end="", flush=True)
    if step % cfg.train.log_every == 0 or last:
      metrics = {k: float(v) for k, v in metrics.items()}
      bad = int(state.first_nonfinite)
      if bad and cfg.train.on_nan == "stop":
        # That step skipped its update, so the state (and every checkpoint) is still clean.
        print(
          f"\nerror: the loss or gradients were not finite at step {bad}; stopping "
          "(train.on_nan=stop; 'skip' skips such steps)",
          file=sys.stderr,
        )
        return 1
      elapsed = time.time() - t_last
      tps = steps_since * tokens_per_step / elapsed
      record = {
        "step": step,
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "learning_rate": metrics["learning_rate"],
        "tokens_per_s": tps,
      }
      # Only where the device's peak is known or given (train.peak_tflops): not on a CPU.
      util = mfu(tps, flops_tok, n_devices=jax.device_count(), peak_tflops=cfg.train.peak_tflops)
      if util is not None:
        record["mfu"] = util
      record.update({k: v for k, v in metrics.items() if k.startswith("loss_mtp")})
      if "loss_scale" in metrics:
        record["loss_scale"] = metrics["loss_scale"]
      if metrics.get("skipped"):
        record["skipped"] = int(metrics["skipped"])
      if eval_data and cfg.train.eval_every and (step % cfg.train.eval_every == 0 or last):
        record["eval_loss"] = float(
          np.mean([float(eval_step(state.params, to_global(b))) for b in eval_data])
        )
      if (peak := peak_memory_bytes()) is not None:
        record["peak_memory_gb"] = peak / 2**30
      say(
        ("\r" if progress else "")
        + "  ".join(
          f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()
        ),
        flush=True,
      )
      logger.write(record)
      t_last, steps_since = time.time(), 0
    if (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) or last:
      checkpoint.save(mngr, step, state, {"step": step, "data_index": step})
  mngr.wait_until_finished()
  logger.close()
  say(f"checkpoint: {run_dir} (step {cfg.train.steps})")
  if "eval_loss" in record:
    say(
      f"eval loss {record['eval_loss']:.3f} nats/token against the unigram baseline "
      f"{unigram:.3f}: the context is worth {unigram - record['eval_loss']:.3f} nats/token"
    )

  if args.sample_prompt and jax.process_count() == 1:
    model, _, _ = checkpoint.load_model(run_dir, implementation=cfg.attention.implementation)
    prompt = tokenizer.encode(args.sample_prompt)
    max_new = min(args.sample_tokens, cfg.model.max_seq_len - len(prompt))
    s = cfg.serve  # how serve.py samples from this run, unless its flags say otherwise
    params = SamplingParams(
      max_new_tokens=max_new, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed
    )
    out = generate(model, [prompt], params, eos_id=tokenizer.eos_id)[0]
    how = "greedy" if s.temperature == 0 else f"temperature {s.temperature:g}, top-k {s.top_k}"
    print(f"sample ({how}):\n{args.sample_prompt + tokenizer.decode(out)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
