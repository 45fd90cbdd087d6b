"""Guided-decoding overhead per token: the engine with and without a JSON-schema constraint.

One randomly initialised model (the tiny preset's shape; its byte vocabulary, or `--bpe N` for a
byte-level BPE of N tokens trained on the embedded corpus, the model's vocabulary sized to it),
the same prompts and output lengths, run side by side and interleaved `--repeats` times:

* plain: unconstrained, decode bursts on (the engine's default);
* plain, no bursts: unconstrained, one token per engine step (what a guided batch runs);
* guided: every request constrained by a JSON schema whose shortest output is longer than
  `--new-tokens`, so each runs to the end like the others (bursts off: the mask follows each
  token). All three sample at temperature 1 with the same seeds.

guided / plain is the whole overhead; guided / no-bursts is the mask itself (host matcher work,
the [B, W] bit transfer and the masked sampling). Grammar compile time is printed separately
(once per schema, then cached). Each line carries the load average: on a shared machine compare
only runs printed with a low one.

    python bench/guided.py [--batch 8] [--new-tokens 128] [--repeats 3] [--bpe 4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time

import jax
import numpy as np
from flax import nnx

import atlas_jax
from atlas_jax.config import load_config
from atlas_jax.data.corpus import iter_documents
from atlas_jax.data.tokenizer import ByteTokenizer, train_bpe
from atlas_jax.decoding.guided import GrammarCompiler, spec_from_request
from atlas_jax.decoding.sampling import SamplingParams
from atlas_jax.model.transformer import Transformer
from atlas_jax.serving.engine import Engine, EngineConfig

SCHEMA = {
  "type": "object",
  "properties": {
    "items": {
      "type": "array",
      "items": {
        "type": "object",
        "properties": {
          "id": {"type": "integer", "minimum": 0},
          "name": {"type": "string", "maxLength": 12},
          "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
          "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "tags"],
      },
      "minItems": 16,  # at least ~450 bytes: every row runs to --new-tokens, as in the others
    }
  },
  "required": ["items"],
}


def run(engine: Engine, prompts, params) -> tuple[float, int]:
  """(seconds, output tokens) serving `prompts` to completion."""
  t0 = time.perf_counter()
  outs = engine.generate(prompts, params)
  return time.perf_counter() - t0, sum(len(o) for o in outs)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="configs/tiny.yaml")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt-len", type=int, default=16)
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--bpe", type=int, default=0, help="train a byte-level BPE of this many tokens")
  args = ap.parse_args()

  if args.bpe:
    texts = [text for _, (_, text) in zip(range(400), iter_documents())]
    tok = train_bpe(texts, args.bpe)
  else:
    tok = ByteTokenizer()
  cfg = load_config(args.config).model
  cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size)
  model = Transformer(cfg, rngs=nnx.Rngs(0))

  t0 = time.perf_counter()
  compiler = GrammarCompiler(tok, vocab_size=cfg.vocab_size)
  grammar = compiler.compile(spec_from_request(guided_json=SCHEMA))
  compile_s = time.perf_counter() - t0

  rng = np.random.default_rng(0)
  n_text = 255 if not args.bpe else tok.vocab_size
  prompts = [rng.integers(3, n_text, args.prompt_len).tolist() for _ in range(args.batch)]
  seeds = range(args.batch)
  n = args.new_tokens
  arms = {
    "plain": (
      {},
      [SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, seed=s) for s in seeds],
    ),
    "plain, no bursts": (
      {"decode_burst": 1},
      [SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, seed=s) for s in seeds],
    ),
    "guided (JSON schema)": (
      {},
      [SamplingParams(max_new_tokens=n, temperature=1.0, seed=s, guided=grammar) for s in seeds],
    ),
  }
  base = dict(n_blocks=512, block_size=16, max_num_seqs=args.batch, max_num_batched_tokens=256)
  engines = {
    k: Engine(model, EngineConfig(**(base | kw)), eos_id=tok.eos_id) for k, (kw, _) in arms.items()
  }
  for name, (_, params) in arms.items():  # compile every shape once
    run(engines[name], prompts, params)

  print(
    f"jax {jax.__version__} ({jax.default_backend()}), atlas_jax {atlas_jax.__version__}, "
    f"{platform.machine()}, {os.cpu_count()} cpus; model d={cfg.d_model} L={cfg.n_layers} "
    f"V={cfg.vocab_size}; batch {args.batch}, prompt {args.prompt_len}, {n} new tokens"
  )
  print(f"grammar compile: {compile_s * 1e3:.0f} ms (regex -> token automaton, once per schema)")
  times: dict[str, list[float]] = {k: [] for k in arms}
  for rep in range(args.repeats):
    for name, (_, params) in arms.items():
      seconds, n_tokens = run(engines[name], prompts, params)
      assert n_tokens == n * args.batch, (name, n_tokens)  # the same work in every arm
      times[name].append(seconds / n_tokens)
    print(f"  repeat {rep}: load average {os.getloadavg()[0]:.2f}")
  plain = np.median(times["plain"])
  nob = np.median(times["plain, no bursts"])
  print("\n| engine | ms per output token | vs plain | vs no bursts |")
  print("|---|---|---|---|")
  for name, ts in times.items():
    t = np.median(ts)
    print(f"| {name} | {t * 1e3:.3f} | {t / plain:.2f} | {t / nob:.2f} |")
  print(f"\nload average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
  main()
