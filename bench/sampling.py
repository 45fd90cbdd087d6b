"""The cost of one draw per row: `sampling.sample` without a filtering row, with top-k 40 on every
row (the k-th logit from `lax.top_k`), and with one row using top-p (which makes the batch sort
its vocabulary, as every draw did before). Interleaved, median over repeats; prints the load
average.

    python bench/sampling.py [--batch 8] [--vocab 32000] [--repeats 5] [--calls 50]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import atlas_jax
from atlas_jax.decoding.sampling import sample


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--vocab", type=int, default=32000)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--calls", type=int, default=50)
  args = ap.parse_args()
  B, V = args.batch, args.vocab
  logits_BV = jax.random.normal(jax.random.key(0), (B, V))
  keys_B = jax.random.split(jax.random.key(1), B)
  draw = jax.jit(
    lambda logits_BV, keys_B, top_k_B, top_p_B: sample(
      logits_BV, keys_B, temperature_B=jnp.ones(B), top_k_B=top_k_B, top_p_B=top_p_B
    )
  )
  no_k = jnp.zeros(B, jnp.int32)
  arms = {
    "no filtering row": (no_k, jnp.ones(B)),
    "top-k 40 on every row": (jnp.full(B, 40, jnp.int32), jnp.ones(B)),
    "one row with top-p 0.9 (the batch sorts)": (no_k, jnp.ones(B).at[0].set(0.9)),
  }
  for filters in arms.values():
    draw(logits_BV, keys_B, *filters).block_until_ready()
  times = {name: [] for name in arms}
  load0 = os.getloadavg()[0]
  for _ in range(args.repeats):
    for name, filters in arms.items():
      t0 = time.perf_counter()
      for _ in range(args.calls):
        draw(logits_BV, keys_B, *filters).block_until_ready()
      times[name].append((time.perf_counter() - t0) / args.calls)
  print(
    f"jax {jax.__version__} ({jax.default_backend()}), atlas_jax {atlas_jax.__version__}, "
    f"{platform.machine()}, {os.cpu_count()} cpus; B={B}, V={V}; load average {load0:.2f} "
    f"before, {os.getloadavg()[0]:.2f} after"
  )
  base = np.median(times["no filtering row"])
  print("| draw | ms per call | vs no filtering row |")
  print("|---|---|---|")
  for name, ts in times.items():
    print(f"| {name} | {np.median(ts) * 1e3:.2f} | {np.median(ts) / base:.1f} |")


if __name__ == "__main__":
  main()
