"""Contiguous caches: every sequence owns max_len slots per layer, allocated up front.

The simplest caches and the baseline the paged cache is measured against. `KVCache` holds keys
and values (MHA, GQA, MQA: 2 * K * H numbers per token and layer); `LatentCache` holds MLA's
latent (C + R numbers per token and layer: the normalised c_kv, then the shared rope key).
Layers are stacked on the leading axis; the model's layer scan carries the whole stack and each
layer writes its slice in place. Both follow `atlas_jax.cache.protocol`; every row of a call adds
its T tokens at offset `lengths[b]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from atlas_jax import kernels
from atlas_jax.cache.protocol import refuse_latent_options
from atlas_jax.kernels.mla_decode import mla_decode

Array = jax.Array


def _check_positive(where: str, **dims) -> None:
  for name, value in dims.items():
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")


def write_rows(cache_LBS_: Array, layer: Array, new_BT_: Array, start_B: Array) -> Array:
  """Writes T new tokens' entries [B, T, ...] into layer `layer` of a stacked cache
  [L, B, S, ...], row b at offset `start_B[b]`; a scatter XLA performs in place."""
  B, T = new_BT_.shape[:2]
  rows_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  pos_BT = start_B[:, None] + jnp.arange(T)[None, :]
  return cache_LBS_.at[layer, rows_BT, pos_BT].set(new_BT_.astype(cache_LBS_.dtype), mode="drop")


def row_slots(positions_BT: Array, capacity: int) -> Array:
  """i32[B, T] each position's slot in a [B * S] flattening of a row-major cache; -1 where
  negative (padding)."""
  B = positions_BT.shape[0]
  rows_B1 = jnp.arange(B, dtype=jnp.int32)[:, None]
  return jnp.where(positions_BT >= 0, rows_B1 * capacity + positions_BT, -1)


def as_pages(cache_LBS_: Array) -> tuple[Array, Array]:
  """A stacked contiguous cache [L, B, S, ...] as a paged pool [L, B * S / Z, Z, ...] (a free
  reshape, Z the largest power of two up to 64 dividing S) and its block table i32[B, S / Z]."""
  L, B, S = cache_LBS_.shape[:3]
  Z = next(z for z in (64, 32, 16, 8, 4, 2, 1) if S % z == 0)
  table_BM = jnp.arange(B * (S // Z), dtype=jnp.int32).reshape(B, S // Z)
  return cache_LBS_.reshape(L, B * (S // Z), Z, *cache_LBS_.shape[3:]), table_BM


# -- per-layer views: every layer's storage, carried through the model's layer scan ----------


@struct.dataclass
class KVLayer:
  """Layer `layer` of a KVCache; writes and reads touch that layer of the stacked arrays."""

  k: Array  # [L, B, S, K, H]
  v: Array  # [L, B, S, K, H]
  layer: Array  # i32[]
  start: Array  # i32[B] where this call's tokens go
  kv_lengths: Array  # i32[B] start + T

  @property
  def storage(self) -> tuple[Array, Array]:
    return self.k, self.v

  def write(self, positions_BT: Array, k_BTKH: Array, v_BTKH: Array) -> KVLayer:
    del positions_BT  # contiguous: the T tokens follow each row's start
    return self.replace(
      k=write_rows(self.k, self.layer, k_BTKH, self.start),
      v=write_rows(self.v, self.layer, v_BTKH, self.start),
    )

  def attend(
    self,
    q_BTNH,
    positions_BT,
    *,
    scale=None,
    sliding_window=None,
    soft_cap=None,
    sinks=None,
    implementation=None,
    attention_chunk=None,
  ):
    dtype = q_BTNH.dtype
    options = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    if attention_chunk is not None:  # a chunked layer (Llama 4): only its own chunk's keys
      options["attention_chunk"] = attention_chunk
    if q_BTNH.shape[1] == 1:
      # Decoding: the cache seen as pages, read in place by the paged-attention kernel (the query
      # takes the cache's dtype, so the stacked cache is never converted); a window skips the
      # pages before it.
      (k_LPZKH, table_BM), (v_LPZKH, _) = as_pages(self.k), as_pages(self.v)
      out_BNH = kernels.paged_attention(
        q_BTNH[:, 0].astype(self.k.dtype),
        k_LPZKH,
        v_LPZKH,
        table_BM,
        self.kv_lengths,
        layer=self.layer,
        implementation=implementation if implementation in ("pallas", "xla") else None,
        **options,
      )
      return out_BNH[:, None].astype(dtype)
    # Queries see the cache up to their own position; slots past kv_lengths hold stale data.
    k_BSKH, v_BSKH = self.read()
    return kernels.attention(
      q_BTNH,
      k_BSKH.astype(dtype),
      v_BSKH.astype(dtype),
      causal=True,
      q_positions=positions_BT,
      kv_lengths=self.kv_lengths,
      implementation=implementation,
      **options,
    )

  def read(self) -> tuple[Array, Array]:
    return self.k[self.layer], self.v[self.layer]


@struct.dataclass
class LatentLayer:
  """Layer `layer` of a LatentCache."""

  c: Array  # [L, B, S, C + R]
  layer: Array  # i32[]
  start: Array  # i32[B]
  kv_lengths: Array  # i32[B]
  rope_dim: int = struct.field(pytree_node=False)  # R

  @property
  def storage(self) -> tuple[Array]:
    return (self.c,)

  def write(self, positions_BT: Array, latent_BTY: Array) -> LatentLayer:
    del positions_BT
    return self.replace(c=write_rows(self.c, self.layer, latent_BTY, self.start))

  def attend(
    self,
    q_BTNY,
    positions_BT,
    *,
    scale=None,
    sliding_window=None,
    soft_cap=None,
    sinks=None,
    implementation=None,
  ):
    """Absorbed MLA attention over the latents: [B, T, N, C]."""
    del positions_BT  # the T queries are each row's last T tokens (mla_decode's contract)
    refuse_latent_options("LatentLayer.attend", sliding_window, soft_cap, sinks)
    C = self.c.shape[-1] - self.rope_dim
    impl = implementation if implementation in ("pallas", "xla") else None
    q_BTNE_c = q_BTNY.astype(self.c.dtype)  # the query takes the cache's dtype, not vice versa
    out_BTNC = mla_decode(
      q_BTNE_c[..., :C],
      q_BTNE_c[..., C:],
      self.c,
      self.kv_lengths,
      layer=self.layer,
      scale=scale,
      implementation=impl,
    )
    return out_BTNC.astype(q_BTNY.dtype)

  def read(self) -> tuple[Array]:
    return (self.c[self.layer],)


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

  def layer(self, storage, layer, positions_BT) -> KVLayer:
    k, v = storage
    return KVLayer(k, v, layer, self.lengths, self.lengths + positions_BT.shape[1])

  def advance(self, layers, positions_BT) -> KVCache:
    k, v = layers
    return self.replace(k=k, v=v, lengths=self.lengths + positions_BT.shape[1])

  def slots(self, positions_BT: Array) -> Array:
    return row_slots(positions_BT, self.capacity)


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

  def layer(self, storage, layer, positions_BT) -> LatentLayer:
    (c,) = storage
    return LatentLayer(c, layer, self.lengths, self.lengths + positions_BT.shape[1], self.rope_dim)

  def advance(self, layers, positions_BT) -> LatentCache:
    (c,) = layers
    return self.replace(c=c, lengths=self.lengths + positions_BT.shape[1])

  def slots(self, positions_BT: Array) -> Array:
    return row_slots(positions_BT, self.capacity)
