"""KV cache memory: naive max-length pre-allocation vs the paged cache, on one fixed budget.

Replays a synthetic serving workload with ShareGPT-like lengths (log-normal prompts of mean ~160
tokens, outputs of mean ~340, truncated to the model's context) through a continuous-batching
loop, twice per workload:

* prealloc: every running sequence reserves `max_len` slots up front, so the budget holds
  budget // max_len sequences whatever their real lengths;
* paged: sequences grow a block at a time through `BlockAllocator` (prefix caching on, and for
  the shared-prompt workload also off, to show what sharing adds);
  admission needs the prompt's blocks plus a small watermark, and when a decode step runs out of
  blocks the newest sequence is preempted and later recomputed.

The second workload prepends one shared system prompt to every request, which the paged cache
stores once and serves from the prefix cache.

Metrics are averaged over decode steps while requests are waiting (the budget is the bottleneck):
utilisation (slots holding real tokens / slots reserved), concurrent sequences, and the prefix
cache hit rate. Pure host-side bookkeeping: no device needed.

    python bench/kv_memory.py [--requests 1000] [--max-len 2048] [--block-size 16]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from atlas_jax.analysis.kv import kv_bytes_per_token
from atlas_jax.analysis.kv_sim import make_workload, run_paged, run_prealloc


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--requests", type=int, default=1000)
  parser.add_argument("--max-len", type=int, default=2048)
  parser.add_argument("--block-size", type=int, default=16)
  parser.add_argument("--budget-mib", type=float, default=64.0)
  parser.add_argument("--system-prompt-len", type=int, default=256)
  parser.add_argument("--seed", type=int, default=0)
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


if __name__ == "__main__":
  main()
