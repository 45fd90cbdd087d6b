"""Remat policies side by side: activation bytes kept for the backward pass and train-step FLOPs.

    python bench/remat.py [--config configs/small.yaml] [--batch 1]

Bytes are the residuals the forward pass saves for the backward pass (from `jax.vjp`, shapes only,
minus the parameters themselves: `atlas_jax.measure.saved_activation_bytes`), printed
beside the planner's figure for the same policy (`atlas_jax.plan.memory.activation_bytes`).
FLOPs come from XLA's cost analysis of the compiled gradient with the layer loop unrolled (XLA
counts a loop body once). Both are reported relative to `none`.
"""

from __future__ import annotations

import argparse
import time

import jax

from atlas_jax import measure
from atlas_jax.config import load_config
from atlas_jax.model.scan import POLICIES, default_every
from atlas_jax.plan import memory


def planned(cfg, policy: str, batch: int) -> int:
  attention = "xla" if cfg.attention.implementation in (None, "xla") else "flash"
  return memory.activation_bytes(
    cfg.model,
    policy=policy,
    batch=batch,
    seq_len=cfg.train.seq_len,
    compute_bytes=memory.PRECISIONS[cfg.train.precision],
    attention=attention if jax.default_backend() == "cpu" else "flash",
    remat_every=cfg.train.remat_every,
  ).saved


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--config", default="configs/small.yaml")
  p.add_argument("--batch", type=int, default=1)
  args = p.parse_args()
  base = load_config(args.config)
  L = base.model.n_layers
  print(
    f"config={args.config} L={L} D={base.model.d_model} T={base.train.seq_len} "
    f"batch={args.batch} precision={base.train.precision} every_k k={default_every(L)} "
    f"jax={jax.__version__} backend={jax.default_backend()}"
  )
  rows = {}
  for policy in POLICIES:
    t = time.time()
    cfg = measure.with_train(base, remat=policy)
    act = measure.saved_activation_bytes(cfg, batch=args.batch)
    flops = measure.train_step_flops(cfg, batch=args.batch)
    rows[policy] = (act, planned(cfg, policy, args.batch), flops)
    print(f"  measured {policy} in {time.time() - t:.0f}s", flush=True)
  base_b, _, base_f = rows["none"]
  print("\n| policy | activation MiB | planner MiB | vs none | train-step GFLOP | vs none |")
  print("|---|---|---|---|---|---|")
  for policy, (b, plan, f) in rows.items():
    print(
      f"| {policy} | {b / 2**20:.1f} | {plan / 2**20:.1f} | {b / base_b:.2f}x | {f / 1e9:.1f} | "
      f"{f / base_f:.3f}x |"
    )
  # Growth with depth: every_k (k = divisor near sqrt(L)) against none, bytes only.
  print("\n| layers | none MiB | every_k MiB | full MiB |")
  print("|---|---|---|---|")
  for n in (4, 16, 64):
    c = load_config(args.config, [f"model.n_layers={n}"])
    none, every, full = (
      measure.saved_activation_bytes(measure.with_train(c, remat=policy), batch=args.batch)
      for policy in ("none", "every_k", "full")
    )
    print(f"| {n} | {none / 2**20:.0f} | {every / 2**20:.0f} | {full / 2**20:.0f} |")


if __name__ == "__main__":
  main()
