"""Train-step throughput: our jitted JAX step against a plain PyTorch version of the same model.

    python bench/train.py [--config configs/tiny.yaml] [--steps 20]

Both sides train the same architecture (RMSNorm, RoPE, GQA attention, SwiGLU, untied head) with
AdamW at the same batch and sequence length, in float32, on the same machine in the same run, on
the same random token batches. Prints tokens/s for each and the ratio (ours / PyTorch).
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from atlas_jax.config import load_config
from atlas_jax.training.checkpoint import single_device_mesh
from atlas_jax.training.step import make_train_step, make_trainer


class TorchBlock(nn.Module):
  def __init__(self, c):
    super().__init__()
    D, N, K, H, Fd = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim
    self.N, self.K, self.H = N, K, H
    self.attn_norm, self.mlp_norm = nn.RMSNorm(D, eps=c.norm_eps), nn.RMSNorm(D, eps=c.norm_eps)
    self.wq, self.wk = nn.Linear(D, N * H, bias=False), nn.Linear(D, K * H, bias=False)
    self.wv, self.wo = nn.Linear(D, K * H, bias=False), nn.Linear(N * H, D, bias=False)
    self.gate, self.up = nn.Linear(D, Fd, bias=False), nn.Linear(D, Fd, bias=False)
    self.down = nn.Linear(Fd, D, bias=False)

  def forward(self, x, cos, sin):
    B, T, _ = x.shape
    h = self.attn_norm(x)
    q = self.wq(h).view(B, T, self.N, self.H).transpose(1, 2)
    k = self.wk(h).view(B, T, self.K, self.H).transpose(1, 2)
    v = self.wv(h).view(B, T, self.K, self.H).transpose(1, 2)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    x = x + self.wo(o.transpose(1, 2).reshape(B, T, -1))
    h = self.mlp_norm(x)
    return x + self.down(F.silu(self.gate(h)) * self.up(h))


def rope(x, cos, sin):
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class TorchModel(nn.Module):
  def __init__(self, c):
    super().__init__()
    self.embed = nn.Embedding(c.vocab_size, c.d_model)
    self.blocks = nn.ModuleList([TorchBlock(c) for _ in range(c.n_layers)])
    self.norm = nn.RMSNorm(c.d_model, eps=c.norm_eps)
    self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
    self.register_buffer("inv_freq", inv)

  def forward(self, tokens):
    T = tokens.shape[1]
    ang = torch.arange(T).float()[:, None] * self.inv_freq[None]
    cos, sin = ang.cos(), ang.sin()
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, cos, sin)
    return self.head(self.norm(x))


def time_torch(cfg, batches, warmup: int) -> float:
  torch.manual_seed(0)
  model = TorchModel(cfg.model)
  opt = torch.optim.AdamW(
    model.parameters(),
    lr=cfg.train.learning_rate,
    betas=(0.9, 0.95),
    weight_decay=cfg.train.weight_decay,
  )

  def step(b):
    tokens = torch.from_numpy(b["tokens"]).long()
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
    opt.step()
    return loss.item()

  for b in batches[:warmup]:
    step(b)
  t = time.perf_counter()
  for b in batches[warmup:]:
    step(b)
  return time.perf_counter() - t


def time_jax(cfg, batches, warmup: int) -> float:
  trainer = make_trainer(cfg, mesh=single_device_mesh())
  step = make_train_step(trainer)
  state = trainer.init(jax.random.key(0))
  for b in batches[:warmup]:
    state, m = step(state, b)
  jax.block_until_ready(m)
  t = time.perf_counter()
  for b in batches[warmup:]:
    state, m = step(state, b)
  jax.block_until_ready(m)
  return time.perf_counter() - t


def _ms(f, *args, n: int = 20) -> float:
  jax.block_until_ready(f(*args))
  t = time.perf_counter()
  for _ in range(n):
    out = f(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t) / n * 1e3


def breakdown(cfg) -> None:
  """Where the step's time goes on this backend: the measurements behind BENCHMARKS.md."""
  from flax import nnx

  from atlas_jax.kernels import attention_reference
  from atlas_jax.model.transformer import Transformer
  from atlas_jax.training.step import loss_fn

  c = cfg.model
  B, T, D, F = cfg.train.batch_size, cfg.train.seq_len, c.d_model, c.ffn_dim
  keys = jax.random.split(jax.random.key(0), 6)
  x_MD = jax.random.normal(keys[0], (B * T, D))
  w_DF = jax.random.normal(keys[1], (D, F))
  flops = 2 * B * T * D * F
  xla_mm = _ms(jax.jit(lambda a, b: a @ b), x_MD, w_DF)
  ta, tb = torch.from_numpy(np.array(x_MD)), torch.from_numpy(np.array(w_DF))
  t = time.perf_counter()
  for _ in range(20):
    ta @ tb
  torch_mm = (time.perf_counter() - t) / 20 * 1e3
  print(
    f"matmul [{B * T}x{D}] x [{D}x{F}]: XLA {flops / xla_mm / 1e6:.0f} GFLOP/s, "
    f"PyTorch {flops / torch_mm / 1e6:.0f} GFLOP/s"
  )

  ws = tuple(jax.random.normal(k, s) for k, s in zip(keys[2:5], [(D, F), (D, F), (F, D)]))
  x_BTD = x_MD.reshape(B, T, D)

  def mlp_3d(ws, x):
    g = jnp.einsum("BTD,DF->BTF", x, ws[0])
    u = jnp.einsum("BTD,DF->BTF", x, ws[1])
    return jnp.einsum("BTF,FD->BTD", jax.nn.silu(g) * u, ws[2]).sum()

  def mlp_2d(ws, x):
    x = x.reshape(-1, D)
    return ((jax.nn.silu(x @ ws[0]) * (x @ ws[1])) @ ws[2]).sum()

  for name, f in (("3-D einsums", mlp_3d), ("2-D matmuls", mlp_2d)):
    print(
      f"SwiGLU MLP as {name}: forward {_ms(jax.jit(f), ws, x_BTD):.1f} ms, "
      f"gradient {_ms(jax.jit(jax.grad(f)), ws, x_BTD):.1f} ms"
    )

  q = jax.random.normal(keys[5], (B, T, c.n_heads, c.head_dim))
  kv = jax.random.normal(keys[4], (B, T, c.n_kv_heads, c.head_dim))
  ours = lambda q, k, v: attention_reference(q, k, v, causal=True).sum()
  theirs = lambda q, k, v: jax.nn.dot_product_attention(
    q, k, v, is_causal=True, implementation="xla"
  ).sum()
  for name, f in (("atlas_jax reference", ours), ("jax.nn.dot_product_attention", theirs)):
    g = jax.jit(jax.grad(f, argnums=(0, 1, 2)))
    print(
      f"attention ({name}): forward {_ms(jax.jit(f), q, kv, kv):.1f} ms, "
      f"gradient {_ms(g, q, kv, kv):.1f} ms"
    )

  tokens = jnp.zeros((B, T + 1), jnp.int32)
  for unroll in (False, True):
    graphdef, params = nnx.split(Transformer(c, rngs=nnx.Rngs(0), unroll_layers=unroll))
    loss = functools.partial(lambda gd, p, t: loss_fn(gd, p, {"tokens": t})[0], graphdef)
    f, g = jax.jit(loss), jax.jit(jax.grad(loss))
    print(
      f"model, layers {'unrolled' if unroll else 'scanned'}: forward "
      f"{_ms(f, params, tokens, n=10):.1f} ms, gradient {_ms(g, params, tokens, n=10):.1f} ms"
    )


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--config", default="configs/tiny.yaml")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--breakdown", action="store_true", help="also time the step's pieces")
  args = p.parse_args()
  cfg = load_config(args.config, ["mesh.fsdp=1", *args.set])
  B, T = cfg.train.batch_size, cfg.train.seq_len
  rng = np.random.default_rng(0)
  batches = [
    {"tokens": rng.integers(0, cfg.model.vocab_size, (B, T + 1)).astype(np.int32)}
    for _ in range(args.warmup + args.steps)
  ]
  tokens = args.steps * B * T
  print(
    f"config={args.config} B={B} T={T} D={cfg.model.d_model} L={cfg.model.n_layers} "
    f"steps={args.steps} jax={jax.__version__} torch={torch.__version__} "
    f"threads={torch.get_num_threads()} backend={jax.default_backend()}"
  )
  ours = tokens / time_jax(cfg, batches, args.warmup)
  theirs = tokens / time_torch(cfg, batches, args.warmup)
  print("| implementation | tokens/s |")
  print("|---|---|")
  print(f"| atlas_jax (jit, donated state) | {ours:,.0f} |")
  print(f"| PyTorch eager (same model) | {theirs:,.0f} |")
  print(f"ratio atlas_jax / PyTorch = {ours / theirs:.2f}")
  if args.breakdown:
    breakdown(cfg)


if __name__ == "__main__":
  main()
