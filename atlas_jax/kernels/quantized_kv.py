"""8-bit KV pages: values in int8 or FP8 (e4m3) with one float32 scale per token and kv head.

A paged pool's key or value page [Z, K, H] is stored as 8-bit codes [Z, K, H] beside scales
[Z, K]: each token's head vector x is kept as round(x / s) with s = max|x| / Q (Q the code's
largest magnitude: 127 for int8, 448 for e4m3), and read back as codes * s. A scale per token
and head follows each vector's own range, so one outlier token costs only its own precision,
which vLLM's single per-tensor scale cannot offer without calibration; its price is 4 bytes a
token and head beside the H codes (H = 128: 132 bytes against bf16's 256, 1.94x the tokens in
the same memory).

The kernels dequantize a page as they read it, so HBM carries the 8-bit codes; the model's new
tokens are quantized as they are written (`quantize`). MLA's latent pool is one kv head: its
scales are [L, P, Z, 1], one per token over the whole latent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

# `--kv-cache-dtype` (vLLM's names): "auto" keeps the model's dtype.
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
_CODES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}
SCALE_DTYPE = jnp.dtype(jnp.float32)


def code_dtype(kv_cache_dtype: str):
  """The 8-bit dtype of a `--kv-cache-dtype` name, or None for "auto"."""
  if kv_cache_dtype not in KV_CACHE_DTYPES:
    raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
  return _CODES.get(kv_cache_dtype)


def is_quantized(dtype) -> bool:
  """Whether pages of this dtype hold codes that need their scales."""
  return jnp.dtype(dtype) in _CODES.values()


def _largest(dtype) -> float:
  dtype = jnp.dtype(dtype)
  if dtype == jnp.int8:
    return 127.0
  return float(jnp.finfo(dtype).max)


def quantize(x_H: Array, dtype) -> tuple[Array, Array]:
  """(codes [..., H] of `dtype`, scales f32[...]) of vectors x [..., H], one scale per vector."""
  x = x_H.astype(jnp.float32)
  top = _largest(dtype)
  scale = jnp.max(jnp.abs(x), axis=-1) / top
  scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero vector: codes 0 at any scale
  y = x / scale[..., None]
  if jnp.dtype(dtype) == jnp.int8:
    y = jnp.round(y)
  return jnp.clip(y, -top, top).astype(dtype), scale


def dequantize(codes_H: Array, scale: Array | None, dtype=jnp.float32) -> Array:
  """codes [..., H] * scales [...] in `dtype`; the codes themselves when `scale` is None."""
  if scale is None:
    return codes_H.astype(dtype)
  return (codes_H.astype(jnp.float32) * scale[..., None].astype(jnp.float32)).astype(dtype)
