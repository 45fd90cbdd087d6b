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

Either may hold 8-bit codes (int8 or FP8 e4m3, `--kv-cache-dtype`) beside a float32 scale per
token and kv head (`kernels.quantized_kv`): new tokens are quantized as they are written and the
kernels dequantize pages as they read them.

The layer axis leads. The model's layer scan carries the whole pool, and each layer scatters its
new tokens into its own slice and reads it in place (the kernels take the stacked pool and a
layer index), so no layer of the pool is ever copied out or stacked back.
`PagedCache(pool, block_table, lengths)` is what the model takes for a batch of sequences
(`atlas_jax.cache.protocol`), in rows (one sequence per row, right-padded) or ragged (every new
token of a serving step on one flat axis, `query_start` and `query_len` per sequence). Its
per-layer views write new tokens with a scatter by slot (the pool donated under `jit`, so in
place) and attend through `kernels.ragged_paged_attention`, which reads each sequence's pages in
place through its block table for any number of new tokens: a decode token, a speculative
round, a prompt chunk after a cached prefix. No call copies a sequence's pages into a dense
array; `read` does, for callers that want one.

On a device mesh (`PoolLayout`), a pool's pages are split over the `data` axis (each replica
holds its own, and its rows' block tables name only them: global ids, replica r owning
[r * P, (r + 1) * P) for P pages per replica) and a KV pool's kv heads over the `tensor` axis
(an MLA latent pool is held whole by every tensor device: its one latent serves every head).
Every write and read of a pool runs per shard (`jax.shard_map`) on the replica's own pages and
the device's own heads, so no device ever gathers another's entries; the kernels are the same.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from atlas_jax import kernels
from atlas_jax.cache.protocol import added_tokens, refuse_latent_options
from atlas_jax.kernels.quantized_kv import SCALE_DTYPE, dequantize, is_quantized, quantize

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


# -- placement on a device mesh ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PoolLayout:
  """Where a paged pool and the arrays of a call over it lie on a device mesh.

  `rules` map logical axes to mesh axes (the serving rules table, `atlas_jax.serving.mesh`):
  "batch" (a call's rows) and "pages" (a pool's blocks) to the data axis, "q_heads" and
  "kv_heads" to the tensor axis, or not at all for a model whose heads every device holds.
  """

  mesh: Mesh
  rules: tuple[tuple[str, str], ...]  # (logical axis, mesh axis) pairs; hashable, so static

  def spec(self, *axes: str | None) -> P:
    """The PartitionSpec of an array with these logical axes."""
    rules = dict(self.rules)
    return P(*(rules.get(a) if a else None for a in axes))

  @property
  def data(self) -> str | None:
    return dict(self.rules).get("pages")

  @property
  def tokens(self) -> str | None:
    """The mesh axis that splits a ragged call's tokens (prefill context parallelism), where
    it has more than one device; else None."""
    axis = dict(self.rules).get("tokens")
    return axis if axis is not None and self.mesh.shape.get(axis, 1) > 1 else None

  def shard(self, fn, in_specs, out_specs):
    """`fn` run on every device's shards (no check of replication: the specs say it)."""
    return jax.shard_map(
      fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )


def per_shard(layout: PoolLayout | None, fn, in_specs, out_specs):
  """`fn` on every shard under `layout`, or `fn` itself without one (a single device)."""
  return fn if layout is None else layout.shard(fn, in_specs, out_specs)


def local_table(block_table_BM: Array, layout: PoolLayout | None, n_blocks: int) -> Array:
  """Inside a shard: the block table's global ids as ids into this replica's own `n_blocks`
  pages. Entries naming another replica's pages (padding past a row's blocks, never read) are
  clamped into range."""
  data = None if layout is None else layout.data
  if data is None:
    return block_table_BM
  first = jax.lax.axis_index(data) * n_blocks
  return jnp.clip(block_table_BM - first, 0, n_blocks - 1)


def copy_pages(array_LP_: Array, src_c: Array, dst_c: Array, layout: PoolLayout | None) -> Array:
  """Copies pages src -> dst (i32[c] global ids each) of a pool array [L, P, ...], in every L.

  Per replica: each copies the pairs of its own pages (a copy-on-write never crosses replicas).
  """

  def local(a_LP_, src_c, dst_c):
    n = a_LP_.shape[1]
    if layout is not None and layout.data is not None:
      first = jax.lax.axis_index(layout.data) * n
      mine_c = (dst_c >= first) & (dst_c < first + n)
      src_c = jnp.clip(src_c - first, 0, n - 1)
      dst_c = jnp.where(mine_c, dst_c - first, n)  # out of range: dropped
    return a_LP_.at[:, dst_c].set(a_LP_[:, src_c], mode="drop")

  spec = None if layout is None else layout.spec(None, "pages", *(None,) * (array_LP_.ndim - 2))
  return per_shard(layout, local, (spec, P(), P()), spec)(array_LP_, src_c, dst_c)


# -- pools ---------------------------------------------------------------------------------------


def _static(default=None):
  return dataclasses.field(default=default, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
  """Key and value blocks for every layer (MHA, GQA, MQA)."""

  k: Array  # [L, P, Z, K, H]
  v: Array  # [L, P, Z, K, H]
  k_scale: Array | None = None  # f32[L, P, Z, K] when k and v hold 8-bit codes
  v_scale: Array | None = None  # f32[L, P, Z, K]

  # Every array's logical axes, which the serving rules table maps to the mesh.
  logical_axes = ("layers", "pages", "page_slots", "kv_heads", "head_dim")

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
    """A zeroed pool; an 8-bit `dtype` (int8, float8_e4m3fn) adds the scales."""
    shape = (n_layers, n_blocks, block_size, n_kv_heads, head_dim)
    for name, value in zip(("n_layers", "n_blocks", "block_size", "n_kv_heads", "head_dim"), shape):
      _check_positive(name, value)
    k, v = _zeros((shape, shape), jnp.dtype(dtype))
    if not is_quantized(dtype):
      return cls(k, v)
    return cls(k, v, *_zeros((shape[:-1], shape[:-1]), SCALE_DTYPE))

  @property
  def arrays(self) -> tuple[Array, ...]:
    """(k, v), then (k_scale, v_scale) for 8-bit pools."""
    return (
      (self.k, self.v) if self.k_scale is None else (self.k, self.v, self.k_scale, self.v_scale)
    )

  def with_arrays(self, arrays) -> KVPool:
    return KVPool(*arrays)

  def layer(self, storage, layer, block_table, queries, layout=None) -> PagedKVLayer:
    k, v, *scales = storage
    return PagedKVLayer(k, v, layer, block_table, queries, layout, (), *scales)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentPool:
  """MLA cache blocks: one compressed KV vector (plus the rope key) per token and layer."""

  c: Array  # [L, P, Z, C + R]
  rope_dim: int = dataclasses.field(metadata=dict(static=True))  # R
  c_scale: Array | None = None  # f32[L, P, Z, 1] when c holds 8-bit codes

  # One latent serves every head: no head axis, so every tensor device holds the whole pool.
  logical_axes = ("layers", "pages", "page_slots", "kv_lora")

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
    if not is_quantized(dtype):
      return cls(c, rope_dim)
    (scale,) = _zeros((shape[:-1] + (1,),), SCALE_DTYPE)
    return cls(c, rope_dim, scale)

  @property
  def arrays(self) -> tuple[Array, ...]:
    """(c,), then (c_scale,) for an 8-bit pool."""
    return (self.c,) if self.c_scale is None else (self.c, self.c_scale)

  def with_arrays(self, arrays) -> LatentPool:
    return LatentPool(arrays[0], self.rope_dim, *arrays[1:])

  def layer(self, storage, layer, block_table, queries, layout=None) -> PagedLatentLayer:
    c, *scale = storage
    return PagedLatentLayer(c, layer, block_table, queries, self.rope_dim, layout, (), *scale)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridPool:
  """The pools of a model whose layers mix full attention with sliding windows (Gemma 2 and 3,
  gpt-oss): the full-attention layers' `full` pool, one block per Z tokens of each sequence,
  and the windowed layers' `sliding` pool, where a sequence holds only the blocks of its
  window (`atlas_jax.cache.allocator.HybridAllocator`), each read through its own block table.

  Layer l of the model is layer `rank` of its group's pool, its group given by `windowed_L`
  (static); a `PagedCache` over it takes the sliding pool's table as `window_table`.
  """

  full: KVPool  # [L_full, P, Z, K, H]
  sliding: KVPool  # [L_windowed, P_w, Z, K, H]
  windowed_L: tuple[bool, ...] = _static(())  # per model layer: whether it is windowed

  @classmethod
  def init(cls, windowed_L, *, n_blocks: int, n_window_blocks: int, **dims) -> HybridPool:
    """Zeroed pools of `n_blocks` and `n_window_blocks` blocks for the model's layers, split by
    `windowed_L`; `dims` as `KVPool.init`'s (without n_layers and n_blocks)."""
    windowed_L = tuple(bool(w) for w in windowed_L)
    n_windowed = sum(windowed_L)
    if not 0 < n_windowed < len(windowed_L):
      raise ValueError(
        f"HybridPool: needs windowed and full-attention layers both, got {n_windowed} windowed "
        f"of {len(windowed_L)}"
      )
    full = KVPool.init(n_layers=len(windowed_L) - n_windowed, n_blocks=n_blocks, **dims)
    sliding = KVPool.init(n_layers=n_windowed, n_blocks=n_window_blocks, **dims)
    return cls(full, sliding, windowed_L)

  @property
  def arrays(self) -> tuple[Array, ...]:
    """The full pool's arrays, then the sliding pool's."""
    return self.full.arrays + self.sliding.arrays

  def with_arrays(self, arrays) -> HybridPool:
    n = len(self.full.arrays)
    return HybridPool(
      self.full.with_arrays(arrays[:n]), self.sliding.with_arrays(arrays[n:]), self.windowed_L
    )

  def offset(self) -> int:
    """The first copy id naming the sliding pool (the full pool's block count)."""
    return self.full.k.shape[1]

  def layer(
    self, storage, layer, block_table, queries, layout=None, window_table=None
  ) -> HybridKVLayer:
    if window_table is None:
      raise ValueError("HybridPool.layer: a hybrid pool needs the windowed layers' window_table")
    n = len(self.full.arrays)
    windowed_L = np.asarray(self.windowed_L)
    # Each layer's index within its own group's pool.
    rank_L = np.where(windowed_L, np.cumsum(windowed_L) - 1, np.cumsum(~windowed_L) - 1)
    windowed = jnp.asarray(windowed_L)[layer]
    rank = jnp.asarray(rank_L, jnp.int32)[layer]
    full = self.full.layer(storage[:n], jnp.where(windowed, 0, rank), block_table, queries, layout)
    sliding = self.sliding.layer(
      storage[n:], jnp.where(windowed, rank, 0), window_table, queries, layout
    )
    return HybridKVLayer(full, sliding, windowed)

  def copy(self, src_c: Array, dst_c: Array, layout: PoolLayout | None) -> HybridPool:
    """`copy_pages` of pairs whose ids from `offset()` on name the sliding pool's pages (as the
    scheduler numbers them); each pool copies its own pairs and drops the other's."""
    off = self.offset()
    out_of_range = jnp.int32(2**30)
    is_full = src_c < off
    full_src, full_dst = jnp.where(is_full, src_c, 0), jnp.where(is_full, dst_c, out_of_range)
    slide_src = jnp.where(is_full, 0, src_c - off)
    slide_dst = jnp.where(is_full, out_of_range, dst_c - off)
    return HybridPool(
      jax.tree.map(lambda a: copy_pages(a, full_src, full_dst, layout), self.full),
      jax.tree.map(lambda a: copy_pages(a, slide_src, slide_dst, layout), self.sliding),
      self.windowed_L,
    )


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


def token_slots(
  block_table_BM: Array,
  query_start_B: Array,
  query_len_B: Array,
  positions_RT: Array,
  *,
  block_size: int,
) -> Array:
  """i32[R, T]: the pool slot of each token of a ragged call, -1 for padding.

  The call's tokens are R rows of T; its B sequences are the rows' in order, B / R per row,
  sequence b's tokens at `query_start[b]` .. + `query_len[b]` of its row. A token no sequence
  owns, or at a negative position, is padding.
  """
  R, T = positions_RT.shape
  B = block_table_BM.shape[0]
  per_row = B // R
  start_RB = query_start_B.reshape(R, per_row)
  end_RB = start_RB + query_len_B.reshape(R, per_row)
  t_1T1 = jnp.arange(T, dtype=jnp.int32)[None, :, None]
  owns_RTB = (t_1T1 >= start_RB[:, None]) & (t_1T1 < end_RB[:, None])
  seq_RT = jnp.argmax(owns_RTB, axis=-1) + (jnp.arange(R, dtype=jnp.int32) * per_row)[:, None]
  valid_RT = owns_RTB.any(-1) & (positions_RT >= 0)
  index_RT = jnp.where(valid_RT, positions_RT // block_size, 0)
  block_RT = block_table_BM.astype(jnp.int32)[seq_RT, index_RT]
  return jnp.where(valid_RT, block_RT * block_size + positions_RT % block_size, -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Queries:
  """Where one call's new tokens are, per sequence, on the rows of tokens it takes ([R, T]).

  Rows form (`ragged` False): sequence b is row b, its tokens the row's first non-padding
  ones. Ragged form: each row holds B / R sequences' runs, sequence b's at `start[b]` of its
  row (one row without a mesh; one per data-parallel replica on one)."""

  start: Array  # i32[B] the index in its row of each sequence's first new token
  length: Array  # i32[B] its new tokens
  kv_lengths: Array  # i32[B] tokens held, the new ones included
  max_length: int | None = _static()  # the most new tokens any sequence has, if known

  def shard(self, T: int, index: Array) -> Queries:
    """The queries of shard `index` of the call's token axis split into pieces of T: each
    sequence's tokens within it, and what the sequence holds up to its last one there (a
    sequence with none there holds nothing here)."""
    offset = index * T
    lo = jnp.clip(self.start - offset, 0, T)
    hi = jnp.clip(self.start + self.length - offset, 0, T)
    length = hi - lo
    held = self.kv_lengths - self.length + (offset + hi - self.start)
    longest = T if self.max_length is None else min(T, self.max_length)
    return Queries(lo, length, jnp.where(length > 0, held, 0), longest)

  def flat_starts(self, R: int, T: int) -> Array:
    """i32[B] each sequence's first token on the call's flattened [R * T] axis."""
    per_row = self.start.shape[0] // R
    return self.start + (jnp.arange(self.start.shape[0], dtype=jnp.int32) // per_row) * T


def _attend(q_RTN_, storage, table_BM, queries: Queries, layer, **kw):
  """Ragged paged attention of a call's [R, T] tokens (one shard's)."""
  R, T = q_RTN_.shape[:2]
  out = kernels.ragged_paged_attention(
    q_RTN_.reshape(R * T, *q_RTN_.shape[2:]),
    *storage,
    table_BM,
    queries.flat_starts(R, T),
    queries.length,
    queries.kv_lengths,
    layer=layer,
    max_query_len=queries.max_length,
    **kw,
  )
  return out.reshape(R, T, *out.shape[1:])


def _split_axis(view) -> str | None:
  """The mesh axis a view's call splits its tokens over, or None."""
  if not view.split_tokens or view.layout is None:
    return None
  return view.layout.tokens


def _implementation(implementation):
  # The model's attention choice names FlashAttention's too ("cudnn"); the paged kernels have
  # their Pallas kernel and an XLA path, and the dispatcher picks per platform for the rest.
  return implementation if implementation in ("pallas", "xla") else None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVLayer:
  """Layer `layer` of a paged KV pool, for the tokens of one call; the pool of every layer is
  carried through the model's layer scan and this layer is written and read in place."""

  k: Array  # [L, P, Z, K, H]
  v: Array  # [L, P, Z, K, H]
  layer: Array  # i32[]
  block_table: Array  # i32[B, M]
  queries: Queries  # [B] where each sequence's new tokens are and what it holds with them
  layout: PoolLayout | None = _static()  # on a mesh: every read and write per shard
  options: tuple = _static(())  # (name, value) pairs for the attention kernel's dispatcher
  k_scale: Array | None = None  # f32[L, P, Z, K] when k and v hold 8-bit codes
  v_scale: Array | None = None  # f32[L, P, Z, K]
  # The call's tokens split over the layout's `tokens` axis (`PagedCache.split_tokens`).
  split_tokens: bool = _static(False)

  # Attention reads the pool in place for any number of new tokens: no dense `read` is needed.
  attends_in_place = True

  @property
  def kv_lengths(self) -> Array:
    return self.queries.kv_lengths

  @property
  def storage(self) -> tuple[Array, ...]:
    if self.k_scale is None:
      return self.k, self.v
    return self.k, self.v, self.k_scale, self.v_scale

  def _specs(self):
    """(pool, sequences [B, ...] of rank n, per-head [R, T, heads, H]) specs under the layout."""
    lay = self.layout
    if lay is None:
      return None, lambda n: None, lambda heads: None
    return (
      lay.spec(None, "pages", None, "kv_heads", None),
      lambda n: lay.spec("batch", *(None,) * (n - 1)),
      lambda heads: lay.spec("batch", None, heads, None),
    )

  def write(self, positions_BT: Array, k_BTKH: Array, v_BTKH: Array) -> PagedKVLayer:
    layout = self.layout
    scaled = self.k_scale is not None

    def local(table_BM, queries, positions_RT, k_RTKH, v_RTKH, layer, *arrays):
      k = arrays[0]
      table_BM = local_table(table_BM, layout, k.shape[1])
      slots_RT = token_slots(
        table_BM, queries.start, queries.length, positions_RT, block_size=k.shape[2]
      )
      new = (k_RTKH, v_RTKH)
      if scaled:  # codes into k and v, their scales into k_scale and v_scale
        (kq, ks), (vq, vs) = (quantize(x, k.dtype) for x in new)
        new = (kq, vq, ks, vs)
      return tuple(write_slots(a, slots_RT, x, layer=layer) for a, x in zip(arrays, new))

    pool, seqs, heads = self._specs()
    scale = self._scale_spec()
    q_specs = jax.tree.map(lambda _: seqs(1), self.queries)
    pools = (pool, pool) + ((scale, scale) if scaled else ())
    specs = (seqs(2), q_specs, seqs(2), heads("kv_heads"), heads("kv_heads"), P(), *pools)
    arrays = per_shard(layout, local, specs, pools)(
      self.block_table, self.queries, positions_BT, k_BTKH, v_BTKH, self.layer, *self.storage
    )
    if scaled:
      k, v, ks, vs = arrays
      return dataclasses.replace(self, k=k, v=v, k_scale=ks, v_scale=vs)
    k, v = arrays
    return dataclasses.replace(self, k=k, v=v)

  def _scale_spec(self):
    return None if self.layout is None else self.layout.spec(None, "pages", None, "kv_heads")

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
    """Causal attention of the call's tokens over their sequences' pages (the ragged kernel),
    in the pool's dtype; padding tokens get zeros. `sinks` f32[N] lie with the query heads."""
    del positions_BT  # each token's position follows from its sequence's `queries`
    dtype = q_BTNH.dtype
    layout = self.layout
    kw = dict(
      scale=scale,
      sliding_window=sliding_window,
      soft_cap=soft_cap,
      implementation=_implementation(implementation),
      **dict(self.options),
    )
    if attention_chunk is not None:
      kw["attention_chunk"] = attention_chunk

    tokens = _split_axis(self)

    def local(q_RTNH, table_BM, queries, layer, sinks_N, k, v, *scales):
      table_BM = local_table(table_BM, layout, k.shape[1])
      if tokens is not None:  # this device's share of the tokens
        queries = queries.shard(q_RTNH.shape[1], jax.lax.axis_index(tokens))
      if scales:  # 8-bit codes: the queries stay in the model's dtype
        scaled = dict(k_scale=scales[0], v_scale=scales[1])
        return _attend(q_RTNH, (k, v), table_BM, queries, layer, sinks=sinks_N, **scaled, **kw)
      q_RTNH = q_RTNH.astype(k.dtype)
      return _attend(q_RTNH, (k, v), table_BM, queries, layer, sinks=sinks_N, **kw)

    pool, seqs, heads = self._specs()
    q_specs = jax.tree.map(lambda _: seqs(1), self.queries)
    scale = self._scale_spec()
    pools = (pool, pool) + ((scale, scale) if self.k_scale is not None else ())
    sink_spec = None if layout is None or sinks is None else layout.spec("q_heads")
    q_spec = heads("q_heads") if tokens is None else layout.spec("batch", "tokens", "q_heads")
    specs = (q_spec, seqs(2), q_specs, P(), sink_spec, *pools)
    out = per_shard(layout, local, specs, q_spec)(
      q_BTNH, self.block_table, self.queries, self.layer, sinks, *self.storage
    )
    return out.astype(dtype)

  def read(self) -> tuple[Array, Array]:
    """Every sequence's entries densely, [B, S, K, H] each (a copy of its pages: for callers
    off the serving path)."""
    layout = self.layout

    def local(table_BM, lengths_B, layer, k, v, *scales):
      table_BM = local_table(table_BM, layout, k.shape[1])
      k_BSKH, v_BSKH = (gather_pages(x, table_BM, lengths_B, layer=layer) for x in (k, v))
      if not scales:
        return k_BSKH, v_BSKH
      ks_BSK, vs_BSK = (gather_pages(x, table_BM, lengths_B, layer=layer) for x in scales)
      return dequantize(k_BSKH, ks_BSK), dequantize(v_BSKH, vs_BSK)

    pool, seqs, heads = self._specs()
    dense = heads("kv_heads")
    scale = self._scale_spec()
    pools = (pool, pool) + ((scale, scale) if self.k_scale is not None else ())
    return per_shard(layout, local, (seqs(2), seqs(1), P(), *pools), (dense, dense))(
      self.block_table, self.kv_lengths, self.layer, *self.storage
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLatentLayer:
  """Layer `layer` of a paged MLA latent pool, for the tokens of one call."""

  c: Array  # [L, P, Z, C + R]
  layer: Array  # i32[]
  block_table: Array  # i32[B, M]
  queries: Queries  # [B]
  rope_dim: int = _static(0)  # R
  layout: PoolLayout | None = _static()  # on a mesh: every read and write per shard
  options: tuple = _static(())
  c_scale: Array | None = None  # f32[L, P, Z, 1] when c holds 8-bit codes
  split_tokens: bool = _static(False)  # as `PagedKVLayer`'s

  attends_in_place = True

  @property
  def kv_lengths(self) -> Array:
    return self.queries.kv_lengths

  @property
  def storage(self) -> tuple[Array, ...]:
    return (self.c,) if self.c_scale is None else (self.c, self.c_scale)

  def _scale_spec(self):
    return None if self.layout is None else self.layout.spec(None, "pages", None, None)

  def _specs(self):
    """(pool, sequences [B, ...] of rank n, per-head queries [R, T, N, _]) specs."""
    lay = self.layout
    if lay is None:
      return None, lambda n: None, None
    return (
      lay.spec(None, "pages", None, None),
      lambda n: lay.spec("batch", *(None,) * (n - 1)),
      lay.spec("batch", None, "q_heads", None),
    )

  def write(self, positions_BT: Array, latent_BTY: Array) -> PagedLatentLayer:
    layout = self.layout

    scaled = self.c_scale is not None

    def local(table_BM, queries, positions_RT, latent_RTY, layer, c, *scale):
      table_BM = local_table(table_BM, layout, c.shape[1])
      slots_RT = token_slots(
        table_BM, queries.start, queries.length, positions_RT, block_size=c.shape[2]
      )
      if not scaled:
        return (write_slots(c, slots_RT, latent_RTY, layer=layer),)
      codes, s_RT = quantize(latent_RTY, c.dtype)
      return (
        write_slots(c, slots_RT, codes, layer=layer),
        write_slots(scale[0], slots_RT, s_RT[..., None], layer=layer),
      )

    pool, seqs, _ = self._specs()
    q_specs = jax.tree.map(lambda _: seqs(1), self.queries)
    pools = (pool, self._scale_spec()) if scaled else (pool,)
    specs = (seqs(2), q_specs, seqs(2), seqs(3), P(), *pools)
    arrays = per_shard(layout, local, specs, pools)(
      self.block_table, self.queries, positions_BT, latent_BTY, self.layer, *self.storage
    )
    if scaled:
      return dataclasses.replace(self, c=arrays[0], c_scale=arrays[1])
    return dataclasses.replace(self, c=arrays[0])

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
    """Absorbed MLA attention over the latents, read in place: [R, T, N, C]."""
    del positions_BT
    refuse_latent_options("PagedLatentLayer.attend", sliding_window, soft_cap, sinks)
    dtype = q_BTNY.dtype
    C = self.c.shape[-1] - self.rope_dim
    layout = self.layout
    kw = dict(scale=scale, implementation=_implementation(implementation), **dict(self.options))

    tokens = _split_axis(self)

    def local(q_RTNY, table_BM, queries, layer, c, *scale):
      table_BM = local_table(table_BM, layout, c.shape[1])
      if tokens is not None:  # this device's share of the tokens
        queries = queries.shard(q_RTNY.shape[1], jax.lax.axis_index(tokens))
      if scale:  # 8-bit codes: the queries stay in the model's dtype
        return _attend(
          q_RTNY, (c, None), table_BM, queries, layer, value_dim=C, k_scale=scale[0], **kw
        )
      return _attend(q_RTNY.astype(c.dtype), (c, None), table_BM, queries, layer, value_dim=C, **kw)

    pool, seqs, heads = self._specs()
    q_specs = jax.tree.map(lambda _: seqs(1), self.queries)
    pools = (pool, self._scale_spec()) if self.c_scale is not None else (pool,)
    if tokens is not None:
      heads = layout.spec("batch", "tokens", "q_heads", None)
    specs = (heads, seqs(2), q_specs, P(), *pools)
    out = per_shard(layout, local, specs, heads)(
      q_BTNY, self.block_table, self.queries, self.layer, *self.storage
    )
    return out.astype(dtype)

  def read(self) -> tuple[Array]:
    layout = self.layout

    def local(table_BM, lengths_B, layer, c, *scale):
      table_BM = local_table(table_BM, layout, c.shape[1])
      dense_BSY = gather_pages(c, table_BM, lengths_B, layer=layer)
      if not scale:
        return dense_BSY
      return dequantize(dense_BSY, gather_pages(scale[0], table_BM, lengths_B, layer=layer)[..., 0])

    pool, seqs, _ = self._specs()
    pools = (pool, self._scale_spec()) if self.c_scale is not None else (pool,)
    dense = per_shard(layout, local, (seqs(2), seqs(1), P(), *pools), seqs(3))(
      self.block_table, self.kv_lengths, self.layer, *self.storage
    )
    return (dense,)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridKVLayer:
  """Layer `layer` of a `HybridPool`: its views of both pools, of which it writes and reads
  only its own group's (the other's writes are dropped, its reads never made): attention within
  a sliding window or a chunk reads the sliding pool, attention to everything the full pool."""

  full: PagedKVLayer
  sliding: PagedKVLayer
  windowed: Array  # bool[] whether this layer is one of the windowed ones

  attends_in_place = True

  @property
  def kv_lengths(self) -> Array:
    return self.full.kv_lengths

  @property
  def storage(self) -> tuple[Array, ...]:
    return self.full.storage + self.sliding.storage

  def write(self, positions_BT: Array, k_BTKH: Array, v_BTKH: Array) -> HybridKVLayer:
    # A negative position is padding, which neither pool writes.
    none = jnp.full_like(positions_BT, -1)
    full = self.full.write(jnp.where(self.windowed, none, positions_BT), k_BTKH, v_BTKH)
    sliding = self.sliding.write(jnp.where(self.windowed, positions_BT, none), k_BTKH, v_BTKH)
    return HybridKVLayer(full, sliding, self.windowed)

  def attend(self, q_BTNH, positions_BT, *, sliding_window=None, attention_chunk=None, **options):
    own = self.full if sliding_window is None and attention_chunk is None else self.sliding
    return own.attend(
      q_BTNH,
      positions_BT,
      sliding_window=sliding_window,
      attention_chunk=attention_chunk,
      **options,
    )

  def read(self) -> tuple[Array, Array]:
    raise NotImplementedError(
      "HybridKVLayer.read: a windowed layer's pool no longer holds the blocks before its window; "
      "attend in place instead"
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
  """A batch of sequences over a shared block pool (KV or latent).

  Two layouts of a call's tokens [R, T]:

  * rows (`query_start` None): row b is sequence b; its new tokens are written at their
    positions (by default `lengths[b] + t`), and a negative position marks a padding token,
    neither written nor counted, so rows of one call may add different numbers of tokens (right
    padding: a row's real tokens come first);
  * ragged (`query_start` and `query_len` given): every new token of the call on one flat axis
    per row, as a serving step lays them out (`atlas_jax.kernels.ragged_paged_attention`):
    sequence b's `query_len[b]` tokens start at `query_start[b]` of its row, the B sequences
    split evenly over the R rows in order (R = 1, or one row per data-parallel replica).

  Either way attention reads each sequence's pages in place, whatever the number of new tokens.
  """

  pool: KVPool | LatentPool
  block_table: Array  # i32[B, M] global block ids; entries past a sequence's blocks are never read
  lengths: Array  # i32[B] tokens held before this call
  layout: PoolLayout | None = _static()  # the pool on a device mesh; None: one device
  query_start: Array | None = None  # i32[B] ragged: each sequence's first token in its row
  query_len: Array | None = None  # i32[B] ragged: its new tokens
  max_query_len: int | None = _static()  # the most new tokens a sequence has, if known
  options: tuple = _static(())  # (name, value) pairs for `kernels.ragged_paged_attention`
  # i32[B, M] the windowed layers' blocks of a `HybridPool` (global ids into its sliding pool)
  window_table: Array | None = None
  # Ragged: the call's tokens split over the layout's `tokens` axis (prefill context
  # parallelism), each device attending with its share of the queries. New entries are written
  # whole on every device (each holds the whole pool).
  split_tokens: bool = _static(False)

  @property
  def layers(self) -> tuple[Array, ...]:
    return self.pool.arrays

  def _added(self, positions_BT) -> Array:
    return added_tokens(positions_BT) if self.query_len is None else self.query_len

  def queries(self, positions_BT: Array) -> Queries:
    """Where the call's tokens are per sequence (`Queries`)."""
    added_B = self._added(positions_BT)
    if self.query_start is None:
      return Queries(
        jnp.zeros_like(added_B), added_B, self.lengths + added_B, positions_BT.shape[1]
      )
    return Queries(self.query_start, added_B, self.lengths + added_B, self.max_query_len)

  def layer(self, storage, layer, positions_BT):
    queries = self.queries(positions_BT)
    if isinstance(self.pool, HybridPool):
      view = self.pool.layer(
        storage, layer, self.block_table, queries, self.layout, self.window_table
      )
      kw = dict(options=self.options, split_tokens=self.split_tokens)
      return dataclasses.replace(
        view,
        full=dataclasses.replace(view.full, **kw),
        sliding=dataclasses.replace(view.sliding, **kw),
      )
    view = self.pool.layer(storage, layer, self.block_table, queries, self.layout)
    return dataclasses.replace(view, options=self.options, split_tokens=self.split_tokens)

  def advance(self, layers, positions_BT) -> PagedCache:
    return dataclasses.replace(
      self, pool=self.pool.with_arrays(layers), lengths=self.lengths + self._added(positions_BT)
    )

  def replace(self, **fields) -> PagedCache:
    return dataclasses.replace(self, **fields)

  def slots(self, positions_BT: Array) -> Array:
    """i32[R, T] each token's slot in a [P * Z] flattening of the pool; -1 where padding."""
    Z = self.pool.arrays[0].shape[2]
    if self.query_start is None:
      return slot_mapping(self.block_table, positions_BT, block_size=Z)
    q = self.queries(positions_BT)
    return token_slots(self.block_table, q.start, q.length, positions_BT, block_size=Z)
