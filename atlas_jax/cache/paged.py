"""Paged caches: a pool of fixed-size blocks per layer, a block table per sequence.

The entries of every sequence live in one pool of P blocks of Z token slots each. A sequence owns
a list of block ids (its row of the block table, written by the host-side
`atlas_jax.cache.allocator.BlockAllocator`); token position p of sequence b lives in slot

    slot = block_table[b, p // Z] * Z + p % Z

so the memory a sequence holds grows a block at a time instead of being reserved for the maximum
length, and sequences with a common prefix can point at the same blocks.

Pools (L layers, P blocks, Z slots per block, K kv heads, H head dim, C + R latent dim):

* `KVPool`: k and v [L, P, Z, K, H] (MHA, GQA, MQA).
* `LatentPool`: the MLA latent [L, P, Z, C + R] (compressed KV plus the shared rope key).

The layer axis leads. The model's layer scan carries the whole pool, and each layer scatters its
new tokens into its own slice and reads it in place (the kernels take the stacked pool and a
layer index), so no layer of the pool is ever copied out or stacked back.
`PagedCache(pool, block_table, lengths)` is what the model takes for a batch of sequences
(`atlas_jax.cache.protocol`); its per-layer views write new tokens with a scatter by slot (the
pool donated under `jit`, so in place) and attend through the paged kernels, which read pages
in place through the block table: `kernels.paged_attention` for one KV decode token,
`kernels.mla_decode` for one latent decode token. Several tokens per row (prefill chunks, padded)
gather the pages densely and mask by position.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from atlas_jax import kernels
from atlas_jax.cache.protocol import added_tokens
from atlas_jax.kernels.mla_decode import mla_decode

Array = jax.Array


def _check_positive(name: str, value: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


# -- array functions -----------------------------------------------------------------------------


def slot_mapping(block_table: Array, positions: Array, *, block_size: int) -> Array:
  """i32[B, T]: the pool slot of each token; -1 where the position is negative (padding).

  Args:
    block_table: i32[B, max_blocks].
    positions: i32[B, T] token positions within each sequence; negative marks padding.
    block_size: Z.
  """
  _check_positive("block_size", block_size)
  if block_table.ndim != 2 or positions.ndim != 2 or positions.shape[0] != block_table.shape[0]:
    raise ValueError(
      f"slot_mapping: need block_table [B, max_blocks] and positions [B, T], got "
      f"block_table.shape={tuple(block_table.shape)} positions.shape={tuple(positions.shape)}"
    )
  positions = positions.astype(jnp.int32)
  valid_BT = positions >= 0
  index_BT = jnp.where(valid_BT, positions // block_size, 0)
  block_BT = jnp.take_along_axis(block_table.astype(jnp.int32), index_BT, axis=1)
  return jnp.where(valid_BT, block_BT * block_size + positions % block_size, -1)


def write_slots(pool_PZ_: Array, slot_mapping: Array, new: Array, *, layer=None) -> Array:
  """Scatters new tokens' entries into their slots of one layer's pool.

  Call it inside the jitted step that donates the pool so XLA updates it in place.

  Args:
    pool_PZ_: [P, Z, ...] (k or v [P, Z, K, H], or latents [P, Z, C + R]); with `layer`, the
      pool of every layer [L, P, Z, ...], written at that layer only.
    slot_mapping: i32[...] slot (block_id * Z + offset) of each new token; -1 skips the token.
    new: [..., *pool.shape[-len(trailing):]] with the token axes of slot_mapping.
    layer: i32[] the layer of a stacked pool, or None.

  Returns:
    The pool, updated.
  """
  lead = 2 if layer is None else 3
  trailing = pool_PZ_.shape[lead:]
  if pool_PZ_.ndim < lead or new.shape[new.ndim - len(trailing) :] != trailing:
    raise ValueError(
      f"write_slots: pool must be [P, Z, ...] and new values [..., {trailing}], got "
      f"pool.shape={tuple(pool_PZ_.shape)} new.shape={tuple(new.shape)}"
    )
  if new.shape[: new.ndim - len(trailing)] != slot_mapping.shape:
    raise ValueError(
      f"write_slots: slot_mapping.shape={tuple(slot_mapping.shape)} must match the token axes of "
      f"new.shape={tuple(new.shape)}"
    )
  P, Z = pool_PZ_.shape[lead - 2 : lead]
  slots_S = slot_mapping.reshape(-1).astype(jnp.int32)
  # Negative indices would wrap around to the last slots; send padding out of bounds instead,
  # where mode="drop" discards it.
  slots_S = jnp.where(slots_S < 0, P * Z, slots_S)
  new_S_ = new.reshape(-1, *trailing).astype(pool_PZ_.dtype)
  index = (slots_S // Z, slots_S % Z) if layer is None else (layer, slots_S // Z, slots_S % Z)
  return pool_PZ_.at[index].set(new_S_, mode="drop")


def gather_pages(pool_PZ_: Array, block_table: Array, lengths: Array, *, layer=None) -> Array:
  """Reads one layer's pages into dense per-sequence entries [B, S, ...], S = max_blocks * Z.

  Slots at or past a sequence's length are zeroed: they hold stale or uninitialised data, and a
  NaN there would survive a zero attention weight (0 * NaN = NaN).

  Args:
    pool_PZ_: [P, Z, ...], or [L, P, Z, ...] with `layer` (one gather, no layer copied out).
    block_table: i32[B, max_blocks].
    lengths: i32[B].
    layer: i32[] the layer of a stacked pool, or None.
  """
  lead = 2 if layer is None else 3
  if pool_PZ_.ndim < lead:
    raise ValueError(f"gather_pages: pool must be [(L,) P, Z, ...], got {tuple(pool_PZ_.shape)}")
  if block_table.ndim != 2 or lengths.shape != block_table.shape[:1]:
    raise ValueError(
      f"gather_pages: need block_table [B, max_blocks] and lengths [B], got block_table.shape="
      f"{tuple(block_table.shape)} lengths.shape={tuple(lengths.shape)}"
    )
  B, max_blocks = block_table.shape
  Z, trailing = pool_PZ_.shape[lead - 1], pool_PZ_.shape[lead:]
  S = max_blocks * Z
  pages = pool_PZ_[block_table] if layer is None else pool_PZ_[layer, block_table]
  dense_BS_ = pages.reshape(B, S, *trailing)
  valid_BS = jnp.arange(S)[None, :] < lengths[:, None]
  valid = valid_BS.reshape(B, S, *(1,) * len(trailing))
  return jnp.where(valid, dense_BS_, jnp.zeros((), pool_PZ_.dtype))


# -- pools ---------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
  """Key and value blocks for every layer (MHA, GQA, MQA)."""

  k: Array  # [L, P, Z, K, H]
  v: Array  # [L, P, Z, K, H]

  @classmethod
  def init(
    cls,
    *,
    n_layers: int,
    n_blocks: int,
    block_size: int,
    n_kv_heads: int,
    head_dim: int,
    dtype=jnp.bfloat16,
  ) -> KVPool:
    """A zeroed pool."""
    shape = (n_layers, n_blocks, block_size, n_kv_heads, head_dim)
    for name, value in zip(("n_layers", "n_blocks", "block_size", "n_kv_heads", "head_dim"), shape):
      _check_positive(name, value)
    return cls(*_zeros((shape, shape), jnp.dtype(dtype)))

  @property
  def arrays(self) -> tuple[Array, Array]:
    return self.k, self.v

  def with_arrays(self, arrays) -> KVPool:
    return KVPool(*arrays)

  def layer(self, storage, layer, block_table: Array, kv_lengths: Array) -> PagedKVLayer:
    return PagedKVLayer(*storage, layer, block_table, kv_lengths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentPool:
  """MLA cache blocks: one compressed KV vector (plus the rope key) per token and layer."""

  c: Array  # [L, P, Z, C + R]
  rope_dim: int = dataclasses.field(metadata=dict(static=True))  # R

  @classmethod
  def init(
    cls,
    *,
    n_layers: int,
    n_blocks: int,
    block_size: int,
    kv_lora_rank: int,
    rope_dim: int,
    dtype=jnp.bfloat16,
  ) -> LatentPool:
    """A zeroed pool [L, P, Z, C + R]."""
    dims = (n_layers, n_blocks, block_size, kv_lora_rank, rope_dim)
    for name, value in zip(
      ("n_layers", "n_blocks", "block_size", "kv_lora_rank", "rope_dim"), dims
    ):
      _check_positive(name, value)
    shape = (n_layers, n_blocks, block_size, kv_lora_rank + rope_dim)
    (c,) = _zeros((shape,), jnp.dtype(dtype))
    return cls(c, rope_dim)

  @property
  def arrays(self) -> tuple[Array]:
    return (self.c,)

  def with_arrays(self, arrays) -> LatentPool:
    (c,) = arrays
    return LatentPool(c, self.rope_dim)

  def layer(self, storage, layer, block_table: Array, kv_lengths: Array) -> PagedLatentLayer:
    (c,) = storage
    return PagedLatentLayer(c, layer, block_table, kv_lengths, self.rope_dim)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _zeros(shapes: tuple[tuple[int, ...], ...], dtype) -> tuple[Array, ...]:
  """Zeroed arrays made on the device; compiled once per shape, not once per pool."""
  return tuple(jnp.zeros(s, dtype) for s in shapes)


def pool_layers(pool: KVPool | LatentPool) -> int:
  """L."""
  return pool.arrays[0].shape[0]


def pool_blocks(pool: KVPool | LatentPool) -> tuple[int, int]:
  """(P, Z)."""
  return pool.arrays[0].shape[1], pool.arrays[0].shape[2]


def pool_bytes_per_token(pool: KVPool | LatentPool) -> int:
  """Bytes one token occupies across every layer of the pool."""
  L, P, Z = pool.arrays[0].shape[:3]
  return sum(a.size * a.dtype.itemsize for a in pool.arrays) // (P * Z)


# -- the cache and its per-layer views -----------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVLayer:
  """Layer `layer` of a paged KV pool, for the rows of one call; the pool of every layer is
  carried through the model's layer scan and this layer is written and read in place."""

  k: Array  # [L, P, Z, K, H]
  v: Array  # [L, P, Z, K, H]
  layer: Array  # i32[]
  block_table: Array  # i32[B, M]
  kv_lengths: Array  # i32[B] tokens held including the new ones

  @property
  def storage(self) -> tuple[Array, Array]:
    return self.k, self.v

  def write(self, positions_BT: Array, k_BTKH: Array, v_BTKH: Array) -> PagedKVLayer:
    slots_BT = slot_mapping(self.block_table, positions_BT, block_size=self.k.shape[2])
    return dataclasses.replace(
      self,
      k=write_slots(self.k, slots_BT, k_BTKH, layer=self.layer),
      v=write_slots(self.v, slots_BT, v_BTKH, layer=self.layer),
    )

  def attend(self, q_BTNH, positions_BT, *, scale=None, sliding_window=None, implementation=None):
    dtype = q_BTNH.dtype
    if q_BTNH.shape[1] == 1 and sliding_window is None:
      # Decoding: the query is the last token held (bottom-right aligned), the paged kernel's
      # contract; it reads pages in place. Padding rows have kv_lengths 0 and give zeros. The
      # query takes the pool's dtype, so the pool is never converted.
      out_BNH = kernels.paged_attention(
        q_BTNH[:, 0].astype(self.k.dtype),
        self.k,
        self.v,
        self.block_table,
        self.kv_lengths,
        layer=self.layer,
        scale=scale,
        implementation=implementation if implementation in ("pallas", "xla") else None,
      )
      return out_BNH[:, None].astype(dtype)
    # Several tokens per row (prefill chunks, right-padded): gather the pages densely and mask by
    # absolute position. Padding queries (position -1) are clamped; callers discard their rows.
    k_BSKH, v_BSKH = self.read()
    return kernels.attention(
      q_BTNH,
      k_BSKH.astype(dtype),
      v_BSKH.astype(dtype),
      causal=True,
      scale=scale,
      sliding_window=sliding_window,
      q_positions=jnp.maximum(positions_BT, 0),
      kv_lengths=self.kv_lengths,
      implementation=implementation,
    )

  def read(self) -> tuple[Array, Array]:
    table, lengths = self.block_table, self.kv_lengths
    return (
      gather_pages(self.k, table, lengths, layer=self.layer),
      gather_pages(self.v, table, lengths, layer=self.layer),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLatentLayer:
  """Layer `layer` of a paged MLA latent pool, for the rows of one call."""

  c: Array  # [L, P, Z, C + R]
  layer: Array  # i32[]
  block_table: Array  # i32[B, M]
  kv_lengths: Array  # i32[B]
  rope_dim: int = dataclasses.field(metadata=dict(static=True))  # R

  @property
  def storage(self) -> tuple[Array]:
    return (self.c,)

  def write(self, positions_BT: Array, latent_BTY: Array) -> PagedLatentLayer:
    slots_BT = slot_mapping(self.block_table, positions_BT, block_size=self.c.shape[2])
    return dataclasses.replace(self, c=write_slots(self.c, slots_BT, latent_BTY, layer=self.layer))

  def attend(self, q_BTNY, positions_BT, *, scale=None, sliding_window=None, implementation=None):
    """Absorbed MLA attention over the latents: [B, T, N, C]."""
    if sliding_window is not None:
      raise ValueError("PagedLatentLayer.attend: MLA has no sliding window")
    dtype = q_BTNY.dtype
    C = self.c.shape[-1] - self.rope_dim
    if q_BTNY.shape[1] == 1:
      # Decoding: the MLA kernel walks each sequence's pages in place; every head shares a load.
      impl = implementation if implementation in ("pallas", "xla") else None
      q_BTNE_c = q_BTNY.astype(self.c.dtype)
      out_BTNC = mla_decode(
        q_BTNE_c[..., :C],
        q_BTNE_c[..., C:],
        self.c,
        self.kv_lengths,
        scale=scale,
        block_table=self.block_table,
        layer=self.layer,
        implementation=impl,
      )
      return out_BTNC.astype(dtype)
    # Absorbed MLA is multi-query attention with the latent as both key and value (one kv head):
    # the first C dims of the output are the weighted latent sum. Padded rows need the
    # positions, so several tokens per row take the dense path.
    (c_BSY,) = self.read()
    c_BS1Y = c_BSY[:, :, None, :].astype(dtype)
    out_BTNY = kernels.attention(
      q_BTNY,
      c_BS1Y,
      c_BS1Y,
      causal=True,
      scale=scale,
      q_positions=jnp.maximum(positions_BT, 0),
      kv_lengths=self.kv_lengths,
      implementation=implementation,
    )
    return out_BTNY[..., :C]

  def read(self) -> tuple[Array]:
    return (gather_pages(self.c, self.block_table, self.kv_lengths, layer=self.layer),)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
  """A batch of sequences over a shared block pool (KV or latent).

  The new tokens of row b are written at their positions (by default `lengths[b] + t`); a
  negative position marks a padding token, which is neither written nor counted, so rows of one
  call may add different numbers of tokens.
  """

  pool: KVPool | LatentPool
  block_table: Array  # i32[B, M]; entries past a sequence's blocks are never read
  lengths: Array  # i32[B] tokens held before this call

  @property
  def layers(self) -> tuple[Array, ...]:
    return self.pool.arrays

  def layer(self, storage, layer, positions_BT):
    kv_lengths_B = self.lengths + added_tokens(positions_BT)
    return self.pool.layer(storage, layer, self.block_table, kv_lengths_B)

  def advance(self, layers, positions_BT) -> PagedCache:
    return dataclasses.replace(
      self, pool=self.pool.with_arrays(layers), lengths=self.lengths + added_tokens(positions_BT)
    )
