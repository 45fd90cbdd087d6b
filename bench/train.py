"""Train-step throughput: our jitted JAX step against a plain PyTorch version of the same model.

    python bench/train.py [--config configs/tiny.yaml] [--steps 20]
    python bench/train.py --config configs/small.yaml --set train.batch_size=4 \
      --set train.seq_len=256 --steps 5 --warmup 2

The second is the `small` preset's model (76M parameters, 12 layers) at a batch a CPU steps
through in seconds. Both run in float32 without remat and with the layers unrolled, like the
peer, whatever the preset says (`train_step.PEER_DEFAULTS`; its bf16 is emulated on a CPU);
`--set train.precision=bf16` computes ours in bfloat16 and autocasts the peer's, `--set
train.scan_layers=true` runs the preset's scanned stack.

Both sides train the same architecture (RMSNorm, RoPE, GQA attention, SwiGLU, the config's head)
with AdamW at the same batch and sequence length, on the same machine in the same run,
on the same random token batches: ours as `bench/train_step.py` builds it, theirs
`bench/torch_llama.py` in eager mode (the peer `bench/gpu_training.py` compiles on a GPU). The two
stacks alternate `--repeat` rounds of `--steps` steps, so both see the machine as it is then;
prints each round's tokens/s (and each stack's minor page faults and kernel time a step, which
showed malloc mapping XLA's temporaries afresh every step) with the load average before it, each
stack's best round and the ratio of the bests (ours / PyTorch).

`--without PIECE[,PIECE...]` (repeatable) adds both steps again with those pieces
(`train_step.PIECES`: attention, norm, rope, activation, embedding) replaced by cheap stand-ins
that keep the shapes and a gradient into what they read (`train_step.without`; the peer's
`torch_llama.Block` computes the same functions, which the tests check loss for loss), all the
steps alternating, and prints what each set of pieces costs each step: the profile's busy times
(`bench/cpu_profile.py`) overstate ops that run beside others on XLA's threads, so taking a
piece out is the measure. `--without-attention` is `--without attention`.

Malloc is set as `train.py` sets it on a CPU (`atlas_jax.host_memory`: freed memory kept, not
mapped afresh each step; `ATLAS_JAX_MALLOC=system` leaves glibc's default), for both stacks,
since they share the process; the header line says which.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch_llama
import train_step
from timing import seconds_for, seconds_per_call

from atlas_jax import host_memory
from atlas_jax.config import load_config
from atlas_jax.training.xla_flags import expected_platform


def timed_with_faults(step, batches) -> tuple[float, float, float]:
  """(seconds for `batches`, minor page faults a step, kernel ms a step): the process's own
  counts (`getrusage`) around the steps, the stacks taking turns in one process."""
  before = resource.getrusage(resource.RUSAGE_SELF)
  seconds = seconds_for(step, batches)[0]
  after = resource.getrusage(resource.RUSAGE_SELF)
  n = len(batches)
  return (
    seconds,
    (after.ru_minflt - before.ru_minflt) / n,
    (after.ru_stime - before.ru_stime) * 1e3 / n,
  )


def _ms(f, *args, n: int = 20) -> float:
  return seconds_per_call(f, *args, iters=n) * 1e3


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
  torch_mm = _ms(torch.matmul, torch.from_numpy(np.array(x_MD)), torch.from_numpy(np.array(w_DF)))
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
  p.add_argument("--steps", type=int, default=20, help="steps a round")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--repeat", type=int, default=3, help="rounds, the stacks alternating")
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--breakdown", action="store_true", help="also time the step's pieces")
  p.add_argument(
    "--without",
    action="append",
    default=[],
    metavar="PIECE[,PIECE...]",
    help=f"also run both steps with these pieces as stand-ins ({', '.join(train_step.PIECES)}): "
    "their cost in each step",
  )
  p.add_argument("--without-attention", action="append_const", dest="without", const="attention")
  args = p.parse_args()
  ablations = [tuple(pieces.split(",")) for pieces in args.without]
  for pieces in ablations:
    for piece in pieces:
      if piece not in train_step.PIECES:
        p.error(f"--without {piece!r}: expected pieces from {', '.join(train_step.PIECES)}")
  cpu = expected_platform() == "cpu"  # asked before the backend starts
  malloc = host_memory.keep_freed_memory() if cpu else "unchanged"
  cfg = load_config(args.config, [*train_step.PEER_DEFAULTS, *args.set])
  bf16 = cfg.train.precision == "bf16"
  B, T = cfg.train.batch_size, cfg.train.seq_len
  batches = train_step.random_batches(cfg, args.warmup + args.steps)
  tokens = args.steps * B * T
  print(
    f"config={args.config} B={B} T={T} D={cfg.model.d_model} L={cfg.model.n_layers} "
    f"precision={cfg.train.precision} steps={args.steps} x {args.repeat} rounds "
    f"jax={jax.__version__} torch={torch.__version__} "
    f"threads={torch.get_num_threads()} backend={jax.default_backend()}\nhost memory: {malloc}"
  )

  def peer(without: tuple[str, ...] = ()):
    torch.manual_seed(0)
    model = torch_llama.Llama(cfg.model, frozenset(without))
    return torch_llama.train_step(model, cfg.train, device="cpu", bf16=bf16, compile_backend=None)

  stacks = {"atlas_jax": train_step.stepper(*train_step.build(cfg)), "PyTorch": peer()}
  for pieces in ablations:
    without = f", without {'+'.join(pieces)}"
    stacks[f"atlas_jax{without}"] = train_step.stepper(
      *train_step.build(cfg, without_pieces=pieces)
    )
    stacks[f"PyTorch{without}"] = peer(pieces)
  for step in stacks.values():
    seconds_for(step, batches[: args.warmup])  # compiles
  # Rounds alternate, so every stack sees the same machine; each keeps its best round.
  best = dict.fromkeys(stacks, float("inf"))
  for r in range(args.repeat):
    load = os.getloadavg()[0]
    got = {k: timed_with_faults(step, batches[args.warmup :]) for k, step in stacks.items()}
    print(
      f"round {r + 1}: load {load:.2f}, "
      + ", ".join(
        f"{k} {tokens / v:,.0f} tok/s ({faults:,.0f} page faults, {kernel_ms:.1f} kernel ms a step)"
        for k, (v, faults, kernel_ms) in got.items()
      )
    )
    best = {k: min(best[k], got[k][0]) for k in best}
  print("| implementation | tokens/s (best round) |")
  print("|---|---|")
  names = {"atlas_jax": "atlas_jax (jit, donated state)", "PyTorch": "PyTorch eager (same model)"}
  for k, seconds in best.items():
    print(f"| {names.get(k, k)} | {tokens / seconds:,.0f} |")
  print(f"ratio atlas_jax / PyTorch = {best['PyTorch'] / best['atlas_jax']:.2f}")
  ms = {k: seconds * 1e3 / args.steps for k, seconds in best.items()}
  for pieces in ablations:
    without = f", without {'+'.join(pieces)}"
    cost = {k: ms[k] - ms[k + without] for k in ("atlas_jax", "PyTorch")}
    print(
      f"{'+'.join(pieces)} costs, ms a step (best rounds, with less without): "
      f"atlas_jax {cost['atlas_jax']:.1f}, PyTorch {cost['PyTorch']:.1f}; "
      f"the rest of the step: atlas_jax {ms['atlas_jax' + without]:.1f}, "
      f"PyTorch {ms['PyTorch' + without]:.1f}"
    )
  if args.breakdown:
    breakdown(cfg)


if __name__ == "__main__":
  main()
