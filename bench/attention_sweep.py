"""FlashAttention timed beside its peers, one configuration at a time: the sweep that
`bench/attention.py` prints as a text table and `bench/gpu.py`'s attention and mgpu sections as
markdown.

Implementations: "pallas" (ours, `atlas_jax.kernels.flash_attention`), "xla" and "cudnn"
(`jax.nn.dot_product_attention`), "mgpu" (the experimental Hopper kernel in Mosaic GPU,
`atlas_jax/kernels/experimental/flash_mgpu.py`; sm_90 and on). FLOPs count the two matmuls,
4 * B * N * T * S * H for the forward, halved when causal; the backward counts 2.5x the forward
(five matmuls to two). Batch and head count follow from a fixed number of tokens per batch and a
fixed hidden size, as in the FlashAttention-3 paper's sweep (Shah et al. 2024, section 4.1:
16k tokens, hidden 2048).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
from timing import seconds_per_call

from atlas_jax.kernels import flash_attention
from atlas_jax.kernels.experimental.flash_mgpu import flash_attention_mgpu

IMPLS = ("pallas", "xla", "cudnn", "mgpu")
FA3_TOKENS, FA3_HIDDEN = 16 * 1024, 2048  # the FlashAttention-3 paper's tokens per batch, hidden


class Case(NamedTuple):
  mode: str  # "fwd", or "fwd_bwd": the gradients of <out, do> with respect to q, k and v
  causal: bool
  seq: int  # T = S
  head_dim: int


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


def tflops(impl: str, case: Case, *, tokens, hidden, dtype, iters, interpret) -> float | None:
  """TFLOP/s of one configuration (median of `iters` calls), or None when the implementation
  cannot run it here."""
  if impl == "cudnn" and jax.default_backend() != "gpu":
    return None
  if impl == "mgpu" and not hopper():
    return None
  mode, causal, seq, head_dim = case
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
    fn = jax.jit(jax.grad(lambda q, k, v, do: jnp.vdot(attn(q, k, v), do).real, argnums=(0, 1, 2)))
    args = (q_BTNH, k_BSNH, v_BSNH, do_BTNH)
  try:
    seconds = seconds_per_call(fn, *args, iters=1, repeat=iters)
  except Exception as err:  # a failed peer (out of memory, unsupported) is a table entry
    print(f"  [{impl} {mode} seq={seq} H={head_dim} causal={causal}] {type(err).__name__}")
    return None
  flops = 4 * B * N * seq * seq * head_dim * (0.5 if causal else 1.0)
  flops *= 3.5 if mode == "fwd_bwd" else 1.0
  return flops / seconds / 1e12


def sweep(
  cases: Iterable[Case], impls: Iterable[str], **kw
) -> Iterator[tuple[Case, dict[str, float | None]]]:
  """(case, {impl: TFLOP/s or None}) for each case in turn, the implementations in `impls`
  order; `kw` as `tflops` takes them."""
  for case in cases:
    yield case, {impl: tflops(impl, case, **kw) for impl in impls}


def ratio(a: float | None, b: float | None) -> float | None:
  return None if a is None or b is None else a / b


def cell(x: float | None, digits: int = 2, width: int = 0) -> str:
  """A table entry: x to `digits` places, "-" for None, right-aligned to `width`."""
  return f"{'-':>{width}}" if x is None else f"{x:>{width}.{digits}f}"
