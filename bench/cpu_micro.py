"""The CPU micro-benchmarks behind the serving and optimizer figures in BENCHMARKS.md.

    python bench/cpu_micro.py [--only gemm|paged|adamw|weight_grads|rope] [--rows 32]

* gemm: a decode step's 42 projections of the vLLM-comparison model (6 layers of q, k, v, o,
  gate, up, down at d_model 512, FFN 1408) on `--rows` rows: x @ W as stored in training
  ([in, out]), against W held out-major ([out, in], `serving.cpu.weights.OutMajor`'s layout),
  against x @ W with XLA's own dots, not YNNPACK's (`serving.cpu.compile.CPU_XLA_DOTS_OPTIONS`),
  against PyTorch's `F.linear` (which holds weights that way too).
* paged: `kernels.paged_attention_xla` decoding batch 32 over 6 layers of a pool of 1,296 pages
  (cold in cache, as in an engine step), contexts of 120-140 tokens, with and without the
  serving programs' CPU compile options (`serving.cpu.compile.CPU_COMPILER_OPTIONS`).
* adamw: one optimizer update (`training.optimizer.adamw`: clipping and AdamW) of the
  small preset's 76M float32 parameters, against PyTorch's fused AdamW with the same clipping.
* weight_grads: the weight gradients of one layer of the small preset's training step at batch
  4 x 256 (1,024 rows; q, k, v, o, gate, up, down): `model.layers.dense`'s, which multiplies an
  explicitly transposed activation, against XLA's dot with the transpose left to the GEMM (x^T
  dy), against PyTorch's (`nn.Linear`'s backward, dy^T x).
* rope: one small-preset layer's rotations of q and k ([4, 256, 12, 64] and [4, 256, 4, 64]),
  forward and backward: `model.rope.apply_rope(by_product=True)`, whose cos and sin tables are
  written once, against the same rotation with cos and sin left for XLA to fuse into it
  (evaluated once per head), against PyTorch's (`bench/torch_llama.py`'s, on q and k laid out
  [B, N, T, H]).

Best of 7 interleaved repeats; the load average is printed. Timings swing with machine load.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np


def best_ms(fns: dict, calls: int = 10, repeat: int = 7) -> dict:
  for f in fns.values():
    f()
  best = {k: float("inf") for k in fns}
  for _ in range(repeat):
    for name, f in fns.items():
      t0 = time.perf_counter()
      for _ in range(calls):
        f()
      best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e3)
  return best


def gemm(rows: int) -> dict:
  import torch

  from atlas_jax.serving.cpu.compile import CPU_XLA_DOTS_OPTIONS

  r = np.random.default_rng(0)
  shapes = [(512, 512), (512, 256), (512, 256), (512, 512), (512, 1408), (512, 1408), (1408, 512)]
  W = [np.asarray(r.standard_normal(s), np.float32) for _ in range(6) for s in shapes]
  x = {k: np.asarray(r.standard_normal((rows, k)), np.float32) for k in (512, 1408)}
  kn, nk = [jnp.asarray(w) for w in W], [jnp.asarray(np.ascontiguousarray(w.T)) for w in W]
  xj = {k: jnp.asarray(v) for k, v in x.items()}
  f_kn = jax.jit(lambda x, ws: [x[w.shape[0]] @ w for w in ws])
  f_nk = jax.jit(lambda x, ws: [jnp.einsum("mk,nk->mn", x[w.shape[1]], w) for w in ws])
  f_xla = jax.jit(
    lambda x, ws: [x[w.shape[0]] @ w for w in ws], compiler_options=CPU_XLA_DOTS_OPTIONS
  )
  xt = {k: torch.from_numpy(v) for k, v in x.items()}
  wt = [torch.from_numpy(np.ascontiguousarray(w.T)) for w in W]
  return best_ms(
    {
      "x @ W [in, out]": lambda: jax.block_until_ready(f_kn(xj, kn)),
      "out-major [out, in]": lambda: jax.block_until_ready(f_nk(xj, nk)),
      "x @ W, XLA's own dots": lambda: jax.block_until_ready(f_xla(xj, kn)),
      "PyTorch F.linear": lambda: [torch.nn.functional.linear(xt[w.shape[1]], w) for w in wt],
    }
  )


def paged() -> dict:
  from atlas_jax.kernels import paged_attention_xla
  from atlas_jax.serving.cpu.compile import CPU_COMPILER_OPTIONS

  B, N, K, H, Z, L, P = 32, 8, 4, 64, 16, 6, 1296
  r = np.random.default_rng(0)
  pool_k, pool_v = (jnp.asarray(r.standard_normal((L, P, Z, K, H)), jnp.float32) for _ in "kv")
  table = jnp.asarray(np.arange(B * 40).reshape(B, 40)[:, :10], jnp.int32)  # rows' pages in order
  lengths = jnp.asarray(r.integers(120, 140, B), jnp.int32)
  q = jnp.asarray(r.standard_normal((L, B, N, H)), jnp.float32)

  def layers(q, pk, pv, t, n):
    return [paged_attention_xla(q[i], pk, pv, t, n, layer=jnp.int32(i)) for i in range(L)]

  args = (q, pool_k, pool_v, table, lengths)
  default, options = jax.jit(layers), jax.jit(layers, compiler_options=CPU_COMPILER_OPTIONS)
  return best_ms(
    {
      "XLA's default fusions": lambda: jax.block_until_ready(default(*args)),
      "serving compile options": lambda: jax.block_until_ready(options(*args)),
    }
  )


def adamw() -> dict:
  import optax
  import torch

  from atlas_jax.config import load_config
  from atlas_jax.training.optimizer import make_optimizer

  cfg = load_config("configs/small.yaml", ["train.precision=fp32"])
  shapes = [(259, 768), (768, 259), *[(768,)] * 25]
  shapes += [(768, 768)] * 24 + [(768, 256)] * 24 + [(768, 2048)] * 24 + [(2048, 768)] * 12
  r = np.random.default_rng(0)
  params = [jnp.asarray(r.standard_normal(s), jnp.float32) for s in shapes]
  grads = [jnp.asarray(r.standard_normal(s) * 1e-3, jnp.float32) for s in shapes]
  opt = make_optimizer(cfg.train)

  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  ours = jax.jit(step, donate_argnums=(0, 1))
  held = {"params": params, "state": opt.init(params)}

  def run_ours():
    held["params"], held["state"] = ours(held["params"], held["state"], grads)
    jax.block_until_ready(held["params"])

  tp = [torch.randn(s) for s in shapes]
  for t in tp:
    t.grad = torch.randn_like(t) * 1e-3
  fused = torch.optim.AdamW(tp, lr=1e-3, fused=True)

  def run_torch():
    torch.nn.utils.clip_grad_norm_(tp, cfg.train.grad_clip)
    fused.step()

  return best_ms({"ours (adamw, jit)": run_ours, "PyTorch fused AdamW": run_torch}, calls=1)


def weight_grads() -> dict:
  import torch

  from atlas_jax.model.layers import dense

  D, F, KH, M = 768, 2048, 256, 1024
  shapes = [(D, D), (D, KH), (D, KH), (D, D), (D, F), (D, F), (F, D)]
  r = np.random.default_rng(0)
  xs = [np.asarray(r.standard_normal((M, k)), np.float32) for k, _ in shapes]
  dys = [np.asarray(r.standard_normal((M, n)), np.float32) for _, n in shapes]
  ws = [jnp.zeros(s, jnp.float32) for s in shapes]
  xj, dyj = [jnp.asarray(x) for x in xs], [jnp.asarray(dy) for dy in dys]
  # One program a projection: in one program XLA runs independent dots side by side on its
  # threads, which hides what each costs.
  weight_grad = jax.jit(lambda x, w, dy: jax.vjp(functools.partial(dense, x), w)[1](dy)[0])
  in_dot = jax.jit(lambda x, dy: x.T @ dy)
  xt, dyt = [torch.from_numpy(x) for x in xs], [torch.from_numpy(dy) for dy in dys]
  ours = lambda: [jax.block_until_ready(weight_grad(*a)) for a in zip(xj, ws, dyj)]
  xla = lambda: [jax.block_until_ready(in_dot(*a)) for a in zip(xj, dyj)]
  return best_ms(
    {
      "ours (dense)": ours,
      "XLA, x^T dy in the dot": xla,
      "PyTorch, dy^T x": lambda: [dy.T @ x for x, dy in zip(xt, dyt)],
    },
    calls=3,
  )


def rope() -> dict:
  import torch
  import torch_llama

  from atlas_jax.model import rope as ours

  B, T, N, K, H = 4, 256, 12, 4, 64
  inv = ours.inverse_frequencies(H, 500000.0, None)
  r = np.random.default_rng(0)
  qk = [np.asarray(r.standard_normal((B, T, n, H)), np.float32) for n in (N, K)]
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))

  def fused(x, p):  # the rotation with cos and sin left inside it (the plain form)
    return ours.apply_rope(x, p, inv, by_product=False)

  def fwd_bwd(rotate):  # the rotations' forward and their gradient into q and k
    loss = lambda xs, p: sum(jnp.sum(rotate(x, p) * x) for x in xs)
    return jax.jit(jax.grad(loss))

  tables = fwd_bwd(lambda x, p: ours.apply_rope(x, p, inv, by_product=True))
  in_fusion = fwd_bwd(fused)
  xj = [jnp.asarray(x) for x in qk]
  ang = torch.arange(T, dtype=torch.float32)[:, None] * torch.from_numpy(inv)
  cos, sin = ang.cos(), ang.sin()
  xt = [torch.from_numpy(x).transpose(1, 2).detach().requires_grad_() for x in qk]

  def torch_step():
    loss = sum((torch_llama.rope(x, cos, sin) * x).sum() for x in xt)
    loss.backward()

  return best_ms(
    {
      "ours (tables once)": lambda: jax.block_until_ready(tables(xj, positions)),
      "XLA, cos/sin in the fusion": lambda: jax.block_until_ready(in_fusion(xj, positions)),
      "PyTorch": torch_step,
    }
  )


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument(
    "--only", action="append", choices=["gemm", "paged", "adamw", "weight_grads", "rope"]
  )
  p.add_argument("--rows", type=int, default=32, help="gemm: rows of x")
  args = p.parse_args(argv)
  import torch

  torch.set_num_threads(os.cpu_count() or 1)
  print(f"# jax {jax.__version__}, torch {torch.__version__}, load {os.getloadavg()[0]:.2f}")
  runs = {
    "gemm": lambda: gemm(args.rows),
    "paged": paged,
    "adamw": adamw,
    "weight_grads": weight_grads,
    "rope": rope,
  }
  for name in args.only or list(runs):
    for label, ms in runs[name]().items():
      print(f"{name:12s} {label:26s} {ms:9.2f} ms")


if __name__ == "__main__":
  main()
