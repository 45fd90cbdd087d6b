"""A contiguous KV cache: every sequence owns max_len slots per layer, allocated up front.

The simplest cache and the baseline the paged cache is measured against. Layers are stacked on the
leading axis so the model's layer scan slices one layer per step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array


@struct.dataclass
class KVCache:
  k: Array  # [L, B, S, K, H] keys; S is the capacity (max_len)
  v: Array  # [L, B, S, K, H] values
  lengths: Array  # i32[B] tokens already written per sequence

  @classmethod
  def init(
    cls,
    *,
    n_layers: int,
    batch: int,
    max_len: int,
    n_kv_heads: int,
    head_dim: int,
    dtype=jnp.float32,
  ) -> KVCache:
    shape = (n_layers, batch, max_len, n_kv_heads, head_dim)
    return cls(
      k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32)
    )

  @property
  def capacity(self) -> int:
    return self.k.shape[2]


def write_layer(
  cache_k_BSKH: Array, cache_v_BSKH: Array, k_BTKH: Array, v_BTKH: Array, start_B: Array
) -> tuple[Array, Array]:
  """Writes T new tokens' K/V for one layer at each sequence's own offset `start_B[b]`."""

  def one(ck_SKH, cv_SKH, k_TKH, v_TKH, start):
    ck_SKH = jax.lax.dynamic_update_slice(ck_SKH, k_TKH.astype(ck_SKH.dtype), (start, 0, 0))
    cv_SKH = jax.lax.dynamic_update_slice(cv_SKH, v_TKH.astype(cv_SKH.dtype), (start, 0, 0))
    return ck_SKH, cv_SKH

  return jax.vmap(one)(cache_k_BSKH, cache_v_BSKH, k_BTKH, v_BTKH, start_B)
