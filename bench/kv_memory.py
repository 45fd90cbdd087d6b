"""KV cache memory: naive max-length pre-allocation vs the paged cache, on one fixed budget.

Replays a synthetic serving workload with ShareGPT-like lengths (log-normal prompts of mean ~160
tokens, outputs of mean ~340, truncated to the model's context) through a continuous-batching
loop (`bench/kv_sim.py`), twice per workload:

* prealloc: every running sequence reserves `max_len` slots up front, so the budget holds
  budget // max_len sequences whatever their real lengths;
* paged: sequences grow a block at a time through `BlockAllocator` (prefix caching on, and for
  the shared-prompt workload also off, to show what sharing adds);
  admission needs the prompt's blocks plus a small watermark, and when a decode step runs out of
  blocks the newest sequence is preempted and later recomputed.

The second workload prepends one shared system prompt to every request, which the paged cache
stores once and serves from the prefix cache.

A last table compares attention kinds at one width (d_model 2048, 16 query heads, 24 layers,
bf16): MHA, GQA and DeepSeek's MLA. Bytes per token are read off the pools the models allocate
(`model.init_pool`), and the paged replay of the ShareGPT workload on one fixed budget shows how
many sequences each kind keeps running.

Metrics are averaged over decode steps while requests are waiting (the budget is the bottleneck):
utilisation (slots holding real tokens / slots reserved), concurrent sequences, and the prefix
cache hit rate. Pure host-side bookkeeping: no device needed.

    python bench/kv_memory.py [--requests 1000] [--max-len 2048] [--block-size 16] [--pool-gib 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from kv_sim import VOCAB, make_workload, run_paged, run_prealloc  # bench/kv_sim.py

from atlas_jax.plan.kv import kv_bytes_per_token


def attention_kinds(args) -> None:
  """KV bytes per token from allocated pools, and concurrency on one budget: MHA, GQA, MLA."""
  from flax import nnx

  from atlas_jax.cache.paged import pool_bytes_per_token
  from atlas_jax.config import MLAConfig, ModelConfig
  from atlas_jax.model import build

  width = dict(
    vocab_size=VOCAB, d_model=2048, n_layers=24, n_heads=16, ffn_dim=5632, dtype="bfloat16"
  )
  mla = MLAConfig(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
  kinds = {
    "MHA (K=16, H=128)": ModelConfig(**width, n_kv_heads=16),
    "GQA (K=4, H=128)": ModelConfig(**width, n_kv_heads=4),
    "MLA (C=512, R=64)": ModelConfig(**width, n_kv_heads=16, mla=mla),
  }
  budget = int(args.pool_gib * 2**30)
  requests = make_workload(n=args.requests, max_len=args.max_len, system_prompt_len=0, seed=0)
  print(f"\nattention kinds at d_model 2048, 24 layers, bf16; pool budget {args.pool_gib:g} GiB")
  header = (
    f"| {'attention':<18} | {'pool B/token':>12} | {'vs MHA':>7} | {'token slots':>11} | "
    f"{'concurrent sequences':>20} | {'vs GQA':>7} |"
  )
  print(header)
  print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
  results = {}
  for name, cfg in kinds.items():
    model = nnx.eval_shape(lambda cfg=cfg: build(cfg, rngs=nnx.Rngs(0)))  # no weights allocated
    pool = model.init_pool(n_blocks=4, block_size=args.block_size)  # real (small) pool arrays
    per_token = pool_bytes_per_token(pool)
    slots = budget // per_token
    paged = run_paged(requests, budget_tokens=slots, block_size=args.block_size)
    results[name] = (per_token, slots, paged.concurrency)
  mha, gqa = results["MHA (K=16, H=128)"][0], results["GQA (K=4, H=128)"][2]
  for name, (per_token, slots, conc) in results.items():
    print(
      f"| {name:<18} | {per_token:>12,} | {mha / per_token:>6.2f}x | {slots:>11,} | "
      f"{conc:>20.1f} | {conc / gqa:>6.2f}x |"
    )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--requests", type=int, default=1000)
  parser.add_argument("--max-len", type=int, default=2048)
  parser.add_argument("--block-size", type=int, default=16)
  parser.add_argument("--budget-mib", type=float, default=64.0)
  parser.add_argument("--system-prompt-len", type=int, default=256)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--pool-gib", type=float, default=1.0, help="budget of the MHA/GQA/MLA table")
  args = parser.parse_args()

  # A tiny model: 4 layers, 2 kv heads of 64, bf16.
  per_token = kv_bytes_per_token(4, 2, 64, 2)
  budget_tokens = int(args.budget_mib * 2**20) // per_token
  print(
    f"KV cache: {per_token} B/token (L=4, K=2, H=64, bf16); budget {args.budget_mib:g} MiB = "
    f"{budget_tokens} token slots; max_len {args.max_len}; block size {args.block_size}; "
    f"{args.requests} requests per workload"
  )
  rows = []
  t0 = time.perf_counter()
  for name, system_len in (("sharegpt", 0), ("system-prompt", args.system_prompt_len)):
    requests = make_workload(
      n=args.requests, max_len=args.max_len, system_prompt_len=system_len, seed=args.seed
    )
    lens = [len(r.prompt) + len(r.output) for r in requests]
    print(
      f"{name}: prompt mean {np.mean([len(r.prompt) for r in requests]):.0f}, output mean "
      f"{np.mean([len(r.output) for r in requests]):.0f}, total max {max(lens)}"
    )
    pre = run_prealloc(requests, budget_tokens=budget_tokens, max_len=args.max_len)
    paged = run_paged(requests, budget_tokens=budget_tokens, block_size=args.block_size)
    rows += [
      (name, "utilisation (%)", 100 * pre.utilisation, 100 * paged.utilisation),
      (name, "concurrent sequences", pre.concurrency, paged.concurrency),
      (name, "decode steps to finish", pre.steps, paged.steps),
      (name, "prefix hit rate (%)", None, 100 * paged.hit_rate),
      (name, "preemptions", pre.preemptions, paged.preemptions),
    ]
    if system_len:
      # The same run without sharing: what the shared system prompt's blocks are worth.
      unshared = run_paged(
        requests, budget_tokens=budget_tokens, block_size=args.block_size, prefix_caching=False
      )
      rows.append((name, "concurrent, no sharing", pre.concurrency, unshared.concurrency))
  elapsed = time.perf_counter() - t0

  header = f"| {'workload':<14} | {'metric':<24} | {'prealloc':>9} | {'paged':>9} | {'ratio':>7} |"
  print()
  print(header)
  print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
  for workload, metric, a, b in rows:
    fmt = lambda x: "-" if x is None else (f"{x:.1f}" if isinstance(x, float) else str(x))
    ratio = f"{b / a:.2f}x" if a else "-"
    if metric == "decode steps to finish":
      ratio = f"{a / b:.2f}x"  # fewer steps is better: report the speed-up
    print(f"| {workload:<14} | {metric:<24} | {fmt(a):>9} | {fmt(b):>9} | {ratio:>7} |")
  print(f"\n(simulated in {elapsed:.1f} s)")

  worst_util = min(b for _, m, _, b in rows if m == "utilisation (%)")
  worst_ratio = min(b / a for _, m, a, b in rows if m == "concurrent sequences")
  print(
    f"targets: paged utilisation >= 96%: {'PASS' if worst_util >= 96 else 'FAIL'} "
    f"({worst_util:.1f}%); concurrent sequences >= 2x: {'PASS' if worst_ratio >= 2 else 'FAIL'} "
    f"({worst_ratio:.2f}x)"
  )
  attention_kinds(args)


if __name__ == "__main__":
  main()
