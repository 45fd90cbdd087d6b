"""FlashAttention's memory from the compiled programs: O(T^2) for the reference, O(T) for Pallas.

The temporary bytes XLA allocates for one forward + backward of causal attention
(`compiled.memory_analysis().temp_size_in_bytes`: every buffer that is neither an argument nor an
output), for the pure-jnp reference ("xla", which materialises the [B, N, T, S] probabilities and
keeps them for the backward pass; the "xla" path runs causal self-attention in query blocks,
`kernels.blocked`, whose scores are about (n + 1) / 2n of these for n blocks) and for the Pallas
FlashAttention ("pallas": blocks of keys with an online softmax, the backward recomputing
probabilities from the saved log-sum-exp). Nothing
runs: each program is only lowered and compiled, so the long sequences cost no memory here. On a
CPU the Pallas kernel lowers in interpret mode, a loop over the same grid and block buffers.

  python bench/attention_memory.py                   # T = 512 .. 8192
  python bench/attention_memory.py --seq-lens 256 512
"""

from __future__ import annotations

import argparse
import datetime
import os

import jax
import jax.numpy as jnp

from atlas_jax import kernels

IMPLS = ("xla", "pallas")


def temp_bytes(
  implementation: str, seq_len: int, *, batch: int = 1, heads: int = 4, head_dim: int = 64
) -> int:
  """Temporary bytes of jit(grad) of causal self-attention [batch, seq_len, heads, head_dim] f32."""

  def loss(q_BTNH, k_BSKH, v_BSKH):
    if implementation == "xla":  # the reference itself, not the "xla" path's query blocks
      out_BTNH = kernels.attention_reference(q_BTNH, k_BSKH, v_BSKH, causal=True)
    else:
      out_BTNH = kernels.attention(
        q_BTNH, k_BSKH, v_BSKH, causal=True, implementation=implementation
      )
    return out_BTNH.astype(jnp.float32).sum()

  spec = jax.ShapeDtypeStruct((batch, seq_len, heads, head_dim), jnp.float32)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  return step.lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes


def table(seq_lens: list[int], **shape) -> list[dict]:
  rows = []
  for T in seq_lens:
    row = {"seq_len": T, **{impl: temp_bytes(impl, T, **shape) for impl in IMPLS}}
    # The probabilities alone, float32: what the reference holds at the least.
    row["probabilities"] = shape.get("batch", 1) * shape.get("heads", 4) * T * T * 4
    rows.append(row)
  return rows


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=64)
  args = p.parse_args(argv)
  print(
    f"# {datetime.date.today()}, jax {jax.__version__}, {jax.devices()[0].device_kind}, "
    f"load average {os.getloadavg()[0]:.2f}; causal, batch 1, {args.heads} heads of "
    f"{args.head_dim}, float32, forward + backward"
  )
  print("| T | xla temp MiB | pallas temp MiB | xla / pallas | [N, T, S] f32 MiB |")
  print("|---|---|---|---|---|")
  mib = lambda b: f"{b / 2**20:,.1f}"
  for r in table(args.seq_lens, heads=args.heads, head_dim=args.head_dim):
    print(
      f"| {r['seq_len']} | {mib(r['xla'])} | {mib(r['pallas'])} | "
      f"{r['xla'] / r['pallas']:.1f}x | {mib(r['probabilities'])} |"
    )


if __name__ == "__main__":
  main()
