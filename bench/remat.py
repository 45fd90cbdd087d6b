"""Remat policies side by side: activation bytes kept for the backward pass and train-step FLOPs.

    python bench/remat.py [--config configs/small.yaml] [--batch 1]

Bytes are the residuals the forward saves for the backward (from `jax.vjp`, shapes only, minus the
parameters themselves); FLOPs come from XLA's cost analysis of the compiled gradient with the layer
loop unrolled (XLA counts a loop body once). Both are reported relative to `none`.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax.config import load_config
from atlas_jax.model.scan import POLICIES, default_every
from atlas_jax.model.transformer import Transformer
from atlas_jax.training.precision import training_model_config
from atlas_jax.training.step import loss_fn


def measure(cfg, policy: str, batch: int, *, flops: bool = True):
  model_cfg = training_model_config(cfg.model, cfg.train.precision)  # e.g. bf16 compute
  model = nnx.eval_shape(
    lambda: Transformer(model_cfg, rngs=nnx.Rngs(0), remat=policy, unroll_layers=True)
  )
  graphdef, params = nnx.split(model)
  tokens = jax.ShapeDtypeStruct((batch, cfg.train.seq_len + 1), jnp.int32)
  f = lambda p, t: loss_fn(graphdef, p, {"tokens": t})[0]
  residuals = jax.eval_shape(
    lambda p, t: jax.tree.leaves(jax.vjp(lambda p: f(p, t), p)[1]), params, tokens
  )
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  act = sum(x.size * x.dtype.itemsize for x in residuals) - param_bytes
  if not flops:
    return act, None
  cost = jax.jit(jax.grad(f)).lower(params, tokens).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return act, cost["flops"]


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--config", default="configs/small.yaml")
  p.add_argument("--batch", type=int, default=1)
  args = p.parse_args()
  cfg = load_config(args.config)
  L = cfg.model.n_layers
  print(
    f"config={args.config} L={L} D={cfg.model.d_model} T={cfg.train.seq_len} "
    f"batch={args.batch} dtype={cfg.model.dtype} every_k k={default_every(L)} "
    f"jax={jax.__version__} backend={jax.default_backend()}"
  )
  rows = {}
  for policy in POLICIES:
    t = time.time()
    rows[policy] = measure(cfg, policy, args.batch)
    print(f"  measured {policy} in {time.time() - t:.0f}s", flush=True)
  base_b, base_f = rows["none"]
  print("\n| policy | activation MiB | vs none | train-step GFLOP | vs none |")
  print("|---|---|---|---|---|")
  for policy, (b, f) in rows.items():
    print(f"| {policy} | {b / 2**20:.1f} | {b / base_b:.2f}x | {f / 1e9:.1f} | {f / base_f:.3f}x |")
  # Growth with depth: every_k (k = divisor near sqrt(L)) against none, bytes only.
  print("\n| layers | none MiB | every_k MiB | full MiB |")
  print("|---|---|---|---|")
  for n in (4, 16, 64):
    c = load_config(args.config, [f"model.n_layers={n}"])
    none = measure(c, "none", args.batch, flops=False)[0]
    every = measure(c, "every_k", args.batch, flops=False)[0]
    full = measure(c, "full", args.batch, flops=False)[0]
    print(f"| {n} | {none / 2**20:.0f} | {every / 2**20:.0f} | {full / 2**20:.0f} |")


if __name__ == "__main__":
  main()
