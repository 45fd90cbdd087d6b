"""The MLA latent cache: per token and layer only c_kv [C] and the shared rope key [R].

Multi-head Latent Attention decompresses every head's key and value from one latent vector, so
the cache stores that vector (plus the single RoPE key all heads share) instead of N keys and N
values: L * (C + R) numbers per token instead of 2 * L * K * H. Layers are stacked on the leading
axis so the model's layer scan slices one layer per step, as in `atlas_jax.cache.contiguous`.
The paged counterpart is `atlas_jax.cache.paged.LatentPool`, [L, P, Z, C + R].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array


@struct.dataclass
class LatentCache:
  c: Array  # [L, B, S, C + R]: normalised latent c_kv, then the RoPE-rotated shared key
  lengths: Array  # i32[B] tokens already written per sequence
  rope_dim: int = struct.field(pytree_node=False, default=0)  # R

  @classmethod
  def init(
    cls,
    *,
    n_layers: int,
    batch: int,
    max_len: int,
    kv_lora_rank: int,
    rope_dim: int,
    dtype=jnp.float32,
  ) -> LatentCache:
    for name, value in dict(
      n_layers=n_layers, batch=batch, max_len=max_len, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim
    ).items():
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"LatentCache.init: {name} must be a positive int, got {value!r}")
    shape = (n_layers, batch, max_len, kv_lora_rank + rope_dim)
    return cls(c=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32), rope_dim=rope_dim)

  @property
  def capacity(self) -> int:  # S
    return self.c.shape[2]

  @property
  def kv_lora_rank(self) -> int:  # C
    return self.c.shape[3] - self.rope_dim


def write_latent(cache_BSE: Array, new_BTE: Array, start_B: Array) -> Array:
  """Writes T new tokens' latents [B, T, C + R] for one layer at each sequence's `start_B[b]`."""

  def one(cache_SE, new_TE, start):
    return jax.lax.dynamic_update_slice(cache_SE, new_TE.astype(cache_SE.dtype), (start, 0))

  return jax.vmap(one)(cache_BSE, new_BTE, start_B)
