"""Contiguous caches: every sequence owns max_len slots per layer, allocated up front.

The simplest caches and the baseline the paged cache is measured against. `KVCache` holds keys
and values (MHA, GQA, MQA: 2 * K * H numbers per token and layer); `LatentCache` holds MLA's
latent (C + R numbers per token and layer: the normalised c_kv, then the shared rope key).
Layers are stacked on the leading axis so the model's layer scan slices one layer per step. Both
follow `atlas_jax.cache.protocol`; every row of a call adds its T tokens at offset `lengths[b]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from atlas_jax import kernels
from atlas_jax.kernels.mla_decode import mla_decode

Array = jax.Array


def _check_positive(where: str, **dims) -> None:
  for name, value in dims.items():
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")


def write_at(cache_BS_: Array, new_BT_: Array, start_B: Array) -> Array:
  """Writes T new tokens' entries [B, T, ...] at each sequence's own offset `start_B[b]`."""

  def one(cache_S_, new_T_, start):
    index = (start,) + (0,) * (cache_S_.ndim - 1)
    return jax.lax.dynamic_update_slice(cache_S_, new_T_.astype(cache_S_.dtype), index)

  return jax.vmap(one)(cache_BS_, new_BT_, start_B)


# -- per-layer views -----------------------------------------------------------------------------


@struct.dataclass
class KVLayer:
  """One layer of a KVCache."""

  k: Array  # [B, S, K, H]
  v: Array  # [B, S, K, H]
  start: Array  # i32[B] where this call's tokens go
  kv_lengths: Array  # i32[B] start + T

  @property
  def storage(self) -> tuple[Array, Array]:
    return self.k, self.v

  def write(self, positions_BT: Array, k_BTKH: Array, v_BTKH: Array) -> KVLayer:
    del positions_BT  # contiguous: the T tokens follow each row's start
    return self.replace(
      k=write_at(self.k, k_BTKH, self.start), v=write_at(self.v, v_BTKH, self.start)
    )

  def attend(self, q_BTNH, positions_BT, *, scale=None, sliding_window=None, implementation=None):
    # Queries see the cache up to their own position; slots past kv_lengths hold stale data.
    return kernels.attention(
      q_BTNH,
      self.k.astype(q_BTNH.dtype),
      self.v.astype(q_BTNH.dtype),
      causal=True,
      scale=scale,
      sliding_window=sliding_window,
      q_positions=positions_BT,
      kv_lengths=self.kv_lengths,
      implementation=implementation,
    )

  def read(self) -> tuple[Array, Array]:
    return self.k, self.v


@struct.dataclass
class LatentLayer:
  """One layer of a LatentCache."""

  c: Array  # [B, S, C + R]
  start: Array  # i32[B]
  kv_lengths: Array  # i32[B]
  rope_dim: int = struct.field(pytree_node=False)  # R

  @property
  def storage(self) -> tuple[Array]:
    return (self.c,)

  def write(self, positions_BT: Array, latent_BTE: Array) -> LatentLayer:
    del positions_BT
    return self.replace(c=write_at(self.c, latent_BTE, self.start))

  def attend(self, q_BTNE, positions_BT, *, scale=None, sliding_window=None, implementation=None):
    """Absorbed MLA attention over the latents: [B, T, N, C]."""
    del positions_BT  # the T queries are each row's last T tokens (mla_decode's contract)
    if sliding_window is not None:
      raise ValueError("LatentLayer.attend: MLA has no sliding window")
    C = self.c.shape[-1] - self.rope_dim
    impl = implementation if implementation in ("pallas", "xla") else None
    return mla_decode(
      q_BTNE[..., :C],
      q_BTNE[..., C:],
      self.c.astype(q_BTNE.dtype),
      self.kv_lengths,
      scale=scale,
      implementation=impl,
    )

  def read(self) -> tuple[Array]:
    return (self.c,)


# -- caches --------------------------------------------------------------------------------------


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
    dims = dict(
      n_layers=n_layers, batch=batch, max_len=max_len, n_kv_heads=n_kv_heads, head_dim=head_dim
    )
    _check_positive("KVCache.init", **dims)
    shape = (n_layers, batch, max_len, n_kv_heads, head_dim)
    return cls(
      k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32)
    )

  @property
  def capacity(self) -> int:  # S
    return self.k.shape[2]

  @property
  def layers(self) -> tuple[Array, Array]:
    return self.k, self.v

  def layer(self, storage, positions_BT) -> KVLayer:
    k_BSKH, v_BSKH = storage
    return KVLayer(k_BSKH, v_BSKH, self.lengths, self.lengths + positions_BT.shape[1])

  def advance(self, layers, positions_BT) -> KVCache:
    k, v = layers
    return self.replace(k=k, v=v, lengths=self.lengths + positions_BT.shape[1])


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
    dims = dict(
      n_layers=n_layers, batch=batch, max_len=max_len, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim
    )
    _check_positive("LatentCache.init", **dims)
    shape = (n_layers, batch, max_len, kv_lora_rank + rope_dim)
    return cls(c=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32), rope_dim=rope_dim)

  @property
  def capacity(self) -> int:  # S
    return self.c.shape[2]

  @property
  def kv_lora_rank(self) -> int:  # C
    return self.c.shape[3] - self.rope_dim

  @property
  def layers(self) -> tuple[Array]:
    return (self.c,)

  def layer(self, storage, positions_BT) -> LatentLayer:
    (c_BSE,) = storage
    return LatentLayer(c_BSE, self.lengths, self.lengths + positions_BT.shape[1], self.rope_dim)

  def advance(self, layers, positions_BT) -> LatentCache:
    (c,) = layers
    return self.replace(c=c, lengths=self.lengths + positions_BT.shape[1])
