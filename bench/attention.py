"""FlashAttention (Pallas) against jax.nn.dot_product_attention ("xla" and "cudnn"), in TFLOP/s.

The sweep follows the FlashAttention-3 paper (Shah et al. 2024, section 4.1): batch * seq = 16k
tokens, hidden 2048 (so 32 heads of 64 or 16 heads of 128), seq 512 .. 16k, causal and not,
forward and forward + backward. FLOPs count the two matmuls, 4 * B * N * T * S * H for the
forward, halved when causal; the backward counts 2.5x the forward (five matmuls to two).

  python bench/attention.py                 # accelerator: the full sweep in bfloat16
  python bench/attention.py --tiny          # any machine (CPU runs Pallas in interpret mode)

Implementations that are unavailable on the platform (cuDNN off NVIDIA GPUs) or fail (out of
memory at long sequences for "xla", which materialises the [T, S] scores) print "-".
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from atlas_jax.kernels import flash_attention
from atlas_jax.kernels.experimental.flash_mgpu import flash_attention_mgpu

# "mgpu": the Hopper FlashAttention in Mosaic GPU (`kernels/experimental/flash_mgpu.py`; sm_90
# and on).
IMPLS = ("pallas", "xla", "cudnn", "mgpu")


def hopper() -> bool:
  capability = getattr(jax.devices()[0], "compute_capability", None)
  return jax.default_backend() == "gpu" and bool(capability) and float(capability) >= 9.0


def attention_fn(impl: str, *, causal: bool, interpret: bool):
  if impl == "pallas":
    return lambda q, k, v: flash_attention(q, k, v, causal=causal, interpret=interpret)
  if impl == "mgpu":
    return lambda q, k, v: flash_attention_mgpu(q, k, v, causal=causal)
  return lambda q, k, v: jax.nn.dot_product_attention(
    q, k, v, is_causal=causal, implementation=impl
  )


def timed(fn, *args, iters: int) -> float:
  """Median seconds per call after one compile-and-warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def bench_one(impl, mode, *, tokens, seq, hidden, head_dim, causal, dtype, iters, interpret):
  """TFLOP/s of one configuration, or None when the implementation cannot run it here."""
  if impl == "cudnn" and jax.default_backend() != "gpu":
    return None
  if impl == "mgpu" and not hopper():
    return None
  B, N = tokens // seq, hidden // head_dim
  keys = jax.random.split(jax.random.key(0), 4)
  q_BTNH, k_BSNH, v_BSNH, do_BTNH = (
    jax.random.normal(key, (B, seq, N, head_dim), jnp.float32).astype(dtype) for key in keys
  )
  attn = attention_fn(impl, causal=causal, interpret=interpret)
  if mode == "fwd":
    fn = jax.jit(attn)
    args = (q_BTNH, k_BSNH, v_BSNH)
  else:
    # Forward + backward: gradients of <out, do> with respect to q, k and v.
    fn = jax.jit(jax.grad(lambda q, k, v, do: jnp.vdot(attn(q, k, v), do).real, argnums=(0, 1, 2)))
    args = (q_BTNH, k_BSNH, v_BSNH, do_BTNH)
  try:
    seconds = timed(fn, *args, iters=iters)
  except Exception as err:  # a failed peer (out of memory, unsupported) is a table entry
    print(f"  [{impl} {mode} seq={seq} H={head_dim} causal={causal}] {type(err).__name__}")
    return None
  flops = 4 * B * N * seq * seq * head_dim * (0.5 if causal else 1.0)
  flops *= 3.5 if mode == "fwd_bwd" else 1.0
  return flops / seconds / 1e12


def fmt(x: float | None, width: int, digits: int = 2) -> str:
  return f"{'-':>{width}}" if x is None else f"{x:>{width}.{digits}f}"


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
    tokens, hidden = 16 * 1024, 2048
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
  for mode in ("fwd", "fwd_bwd"):
    for head_dim in head_dims:
      for causal in (False, True):
        for seq in seqs:
          tflops = {
            impl: bench_one(
              impl,
              mode,
              tokens=tokens,
              seq=seq,
              hidden=hidden,
              head_dim=head_dim,
              causal=causal,
              dtype=dtype,
              iters=iters,
              interpret=on_cpu,
            )
            for impl in args.impls
          }
          ratios = [
            None
            if tflops.get("pallas") is None or tflops[impl] is None
            else tflops["pallas"] / tflops[impl]
            for impl in args.impls
            if impl != "pallas"
          ]
          digits = 4 if tiny else 1
          print(
            f"{mode:<8}{seq:>7}{head_dim:>5}{causal!s:>8} | "
            + "".join(fmt(tflops[impl], 9, digits) for impl in args.impls)
            + " | "
            + "".join(fmt(r, 14) for r in ratios),
            flush=True,
          )


if __name__ == "__main__":
  main()
