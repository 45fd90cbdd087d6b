"""FlashAttention (Pallas) against jax.nn.dot_product_attention ("xla" and "cudnn"), in TFLOP/s.

The sweep follows the FlashAttention-3 paper (Shah et al. 2024, section 4.1): batch * seq = 16k
tokens, hidden 2048 (so 32 heads of 64 or 16 heads of 128), seq 512 .. 16k, causal and not,
forward and forward + backward. FLOPs count the two matmuls, 4 * B * N * T * S * H for the
forward, halved when causal; the backward counts 2.5x the forward (five matmuls to two). The
timing and the FLOP count are `bench/attention_sweep.py`, which `bench/gpu.py` shares.

  python bench/attention.py                 # accelerator: the full sweep in bfloat16
  python bench/attention.py --tiny          # any machine (CPU runs Pallas in interpret mode)

Implementations that are unavailable on the platform (cuDNN off NVIDIA GPUs) or fail (out of
memory at long sequences for "xla", which materialises the [T, S] scores) print "-".
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from attention_sweep import FA3_HIDDEN, FA3_TOKENS, IMPLS, Case, cell, ratio, sweep


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tiny", action="store_true", help="a size any CPU runs in seconds")
  parser.add_argument("--dtype", default=None, help="bfloat16 (default), float16 or float32")
  parser.add_argument("--iters", type=int, default=None)
  parser.add_argument("--seqs", type=int, nargs="*", default=None)
  parser.add_argument("--head-dims", type=int, nargs="*", default=None)
  parser.add_argument("--impls", nargs="*", default=list(IMPLS), choices=IMPLS)
  args = parser.parse_args()

  on_cpu = jax.default_backend() == "cpu"
  tiny = args.tiny or on_cpu
  if tiny:
    tokens, hidden = 512, 128
    seqs, head_dims, iters, dtype = [128, 256], [64], 2, "float32"
  else:
    tokens, hidden = FA3_TOKENS, FA3_HIDDEN
    seqs, head_dims, iters, dtype = [512, 1024, 2048, 4096, 8192, 16384], [64, 128], 10, "bfloat16"
  seqs = args.seqs or seqs
  head_dims = args.head_dims or head_dims
  iters = args.iters or iters
  dtype = jnp.dtype(args.dtype or dtype)

  print(
    f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} dtype={dtype.name} "
    f"tokens={tokens} hidden={hidden} interpret={on_cpu} jax={jax.__version__}"
  )
  header = (
    f"{'mode':<8}{'seq':>7}{'H':>5}{'causal':>8} | "
    + "".join(f"{impl:>9}" for impl in args.impls)
    + " | "
    + "".join(f"{'pallas/' + impl:>14}" for impl in args.impls if impl != "pallas")
  )
  print("TFLOP/s")
  print(header)
  print("-" * len(header))
  cases = [
    Case(mode, causal, seq, head_dim)
    for mode in ("fwd", "fwd_bwd")
    for head_dim in head_dims
    for causal in (False, True)
    for seq in seqs
  ]
  kw = dict(tokens=tokens, hidden=hidden, dtype=dtype, iters=iters, interpret=on_cpu)
  digits = 4 if tiny else 1
  for (mode, causal, seq, head_dim), tflops in sweep(cases, args.impls, **kw):
    ratios = [ratio(tflops.get("pallas"), tflops[impl]) for impl in args.impls if impl != "pallas"]
    print(
      f"{mode:<8}{seq:>7}{head_dim:>5}{causal!s:>8} | "
      + "".join(cell(tflops[impl], digits, 9) for impl in args.impls)
      + " | "
      + "".join(cell(r, 2, 14) for r in ratios),
      flush=True,
    )


if __name__ == "__main__":
  main()
