"""Paged KV cache: a pool of fixed-size blocks per layer, a block table per sequence.

Keys and values of every sequence live in one pool of P blocks of Z token slots each. A sequence
owns a list of block ids (its row of the block table, written by the host-side
`atlas_jax.cache.allocator.BlockAllocator`); token position p of sequence b lives in slot

    slot = block_table[b, p // Z] * Z + p % Z

so the memory a sequence holds grows a block at a time instead of being reserved for the maximum
length, and sequences with a common prefix can point at the same blocks.

Layouts (L layers, P blocks, Z slots per block, K kv heads, H head dim, C latent dim):

* `KVPool`: k and v [L, P, Z, K, H]. The layer axis leads so that a `jax.lax.scan` over layers
  slices one layer's [P, Z, K, H] pool (and stacks the updated ones back).
* `LatentPool`: the MLA latent [L, P, Z, C + R] (compressed KV plus the shared rope key).
* `PageTable`: block_table i32[B, max_blocks] and lengths i32[B], replicated on every device.

A layer writes its new tokens with `write_kv` (a scatter by slot, the pool donated under `jit`)
and reads its pages with `gather_kv` (dense, for the reference path) or the Pallas kernel
`atlas_jax.kernels.paged_attention`, which reads pages in place through the block table.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

Array = jax.Array

TENSOR_AXIS = "tensor"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
  """Key and value blocks for every layer (MHA, GQA, MQA)."""

  k: Array  # [L, P, Z, K, H]
  v: Array  # [L, P, Z, K, H]

  @property
  def n_layers(self) -> int:
    return self.k.shape[0]

  @property
  def n_blocks(self) -> int:
    return self.k.shape[1]

  @property
  def block_size(self) -> int:
    return self.k.shape[2]

  @property
  def n_kv_heads(self) -> int:
    return self.k.shape[3]

  @property
  def head_dim(self) -> int:
    return self.k.shape[4]

  def layer(self, layer: int | Array) -> tuple[Array, Array]:
    """(k, v), each [P, Z, K, H]: one layer's pool, for code that does not scan over layers."""
    return self.k[layer], self.v[layer]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentPool:
  """MLA cache blocks: one compressed KV vector (plus the rope key) per token and layer."""

  c: Array  # [L, P, Z, C + R]

  @property
  def n_layers(self) -> int:
    return self.c.shape[0]

  @property
  def n_blocks(self) -> int:
    return self.c.shape[1]

  @property
  def block_size(self) -> int:
    return self.c.shape[2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageTable:
  """Which blocks each sequence of the batch reads, and how many tokens it holds."""

  block_table: Array  # i32[B, max_blocks]; entries past a sequence's blocks are never read
  lengths: Array  # i32[B]; tokens held, including those written this step

  @classmethod
  def from_host(cls, block_table: np.ndarray, lengths: np.ndarray) -> PageTable:
    block_table = np.asarray(block_table)
    lengths = np.asarray(lengths)
    if block_table.ndim != 2 or lengths.shape != block_table.shape[:1]:
      raise ValueError(
        f"PageTable: need block_table [B, max_blocks] and lengths [B], got "
        f"block_table.shape={block_table.shape} lengths.shape={lengths.shape}"
      )
    return cls(jnp.asarray(block_table, jnp.int32), jnp.asarray(lengths, jnp.int32))


def _check_positive(name: str, value: int) -> None:
  if not isinstance(value, int | np.integer) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


def kv_pool_shape(
  *, n_layers: int, n_blocks: int, block_size: int, n_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
  """(L, P, Z, K, H), validated."""
  dims = dict(
    n_layers=n_layers,
    n_blocks=n_blocks,
    block_size=block_size,
    n_kv_heads=n_kv_heads,
    head_dim=head_dim,
  )
  for name, value in dims.items():
    _check_positive(name, value)
  return (n_layers, n_blocks, block_size, n_kv_heads, head_dim)


def pool_sharding(mesh: Mesh, pool: KVPool | LatentPool) -> KVPool | LatentPool:
  """The NamedSharding of every pool array, as a pytree shaped like `pool`.

  K/V blocks are split over kv heads on the mesh's `tensor` axis, matching tensor-parallel
  attention (each device holds the heads its attention shard computes), and replicated on every
  other axis. When there is no `tensor` axis, or K is not a multiple of its size (MQA on a wide
  mesh), the heads are replicated: every tensor shard then needs all of them. The MLA latent has
  no head axis and is replicated. `pool` may hold arrays or `jax.ShapeDtypeStruct`s.
  """
  if isinstance(pool, LatentPool):
    return LatentPool(c=NamedSharding(mesh, PS()))
  if not isinstance(pool, KVPool):
    raise ValueError(f"pool_sharding: expected a KVPool or LatentPool, got {type(pool).__name__}")
  n_kv_heads = pool.k.shape[3]
  tp = mesh.shape.get(TENSOR_AXIS, 1)
  heads = TENSOR_AXIS if TENSOR_AXIS in mesh.shape and n_kv_heads % tp == 0 else None
  sharding = NamedSharding(mesh, PS(None, None, None, heads, None))
  return KVPool(k=sharding, v=sharding)


def page_table_sharding(mesh: Mesh) -> PageTable:
  """Block tables and lengths are tiny and read by every shard: replicated."""
  replicated = NamedSharding(mesh, PS())
  return PageTable(block_table=replicated, lengths=replicated)


def init_kv_pool(
  *,
  n_layers: int,
  n_blocks: int,
  block_size: int,
  n_kv_heads: int,
  head_dim: int,
  dtype: jnp.dtype = jnp.bfloat16,
  mesh: Mesh | None = None,
) -> KVPool:
  """A zeroed pool, created directly in its sharded layout (never as an unsharded copy)."""
  shape = kv_pool_shape(
    n_layers=n_layers,
    n_blocks=n_blocks,
    block_size=block_size,
    n_kv_heads=n_kv_heads,
    head_dim=head_dim,
  )
  make = lambda: KVPool(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
  if mesh is None:
    return jax.jit(make)()
  return jax.jit(make, out_shardings=pool_sharding(mesh, jax.eval_shape(make)))()


def init_latent_pool(
  *,
  n_layers: int,
  n_blocks: int,
  block_size: int,
  latent_dim: int,
  dtype: jnp.dtype = jnp.bfloat16,
  mesh: Mesh | None = None,
) -> LatentPool:
  """A zeroed MLA pool [L, P, Z, C + R]; `latent_dim` is C + R."""
  for name, value in dict(
    n_layers=n_layers, n_blocks=n_blocks, block_size=block_size, latent_dim=latent_dim
  ).items():
    _check_positive(name, value)
  make = lambda: LatentPool(c=jnp.zeros((n_layers, n_blocks, block_size, latent_dim), dtype))
  if mesh is None:
    return jax.jit(make)()
  return jax.jit(make, out_shardings=pool_sharding(mesh, jax.eval_shape(make)))()


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


def _scatter_slots(pool_PZX: Array, slots_S: Array, new_SX: Array) -> Array:
  P, Z = pool_PZX.shape[:2]
  flat = pool_PZX.reshape(P * Z, *pool_PZX.shape[2:])
  # Negative indices would wrap around to the last slots; send padding out of bounds instead,
  # where mode="drop" discards it.
  slots_S = jnp.where(slots_S < 0, P * Z, slots_S)
  flat = flat.at[slots_S].set(new_SX.astype(pool_PZX.dtype), mode="drop")
  return flat.reshape(pool_PZX.shape)


def _check_write(name: str, pool: Array, slots: Array, new: Array, trailing: int) -> None:
  if pool.ndim != 2 + trailing or new.shape[-trailing:] != pool.shape[2:]:
    raise ValueError(
      f"{name}: pool must be [P, Z, ...] and new values [..., {pool.shape[2:]}], got "
      f"pool.shape={tuple(pool.shape)} new.shape={tuple(new.shape)}"
    )
  if new.shape[:-trailing] != slots.shape:
    raise ValueError(
      f"{name}: slot_mapping.shape={tuple(slots.shape)} must match the token axes of "
      f"new.shape={tuple(new.shape)}"
    )


def write_kv(
  pool_k: Array, pool_v: Array, slot_mapping: Array, k_new: Array, v_new: Array
) -> tuple[Array, Array]:
  """Scatters new tokens' keys and values into their slots of one layer's pool.

  Call it inside the jitted step that donates the pool (or use `write_kv_donated`) so XLA updates
  the pool in place.

  Args:
    pool_k: [P, Z, K, H].
    pool_v: [P, Z, K, H].
    slot_mapping: i32[...] slot (block_id * Z + offset) of each new token; -1 skips the token.
    k_new: [..., K, H] with the token axes of slot_mapping.
    v_new: [..., K, H].

  Returns:
    (pool_k, pool_v), updated.
  """
  if pool_k.shape != pool_v.shape:
    raise ValueError(
      f"write_kv: pool_k.shape={tuple(pool_k.shape)} != pool_v.shape={tuple(pool_v.shape)}"
    )
  _check_write("write_kv", pool_k, slot_mapping, k_new, trailing=2)
  _check_write("write_kv", pool_v, slot_mapping, v_new, trailing=2)
  slots_S = slot_mapping.reshape(-1).astype(jnp.int32)
  k_SKH = k_new.reshape(-1, *pool_k.shape[2:])
  v_SKH = v_new.reshape(-1, *pool_v.shape[2:])
  return _scatter_slots(pool_k, slots_S, k_SKH), _scatter_slots(pool_v, slots_S, v_SKH)


def write_latent(pool_c: Array, slot_mapping: Array, c_new: Array) -> Array:
  """MLA version of `write_kv`: pool_c [P, Z, C + R], c_new [..., C + R]."""
  _check_write("write_latent", pool_c, slot_mapping, c_new, trailing=1)
  return _scatter_slots(
    pool_c, slot_mapping.reshape(-1).astype(jnp.int32), c_new.reshape(-1, pool_c.shape[-1])
  )


write_kv_donated = jax.jit(write_kv, donate_argnums=(0, 1))
write_latent_donated = jax.jit(write_latent, donate_argnums=(0,))


@functools.partial(jax.jit, donate_argnums=(0,))
def write_kv_layers(pool: KVPool, slot_mapping: Array, k_new: Array, v_new: Array) -> KVPool:
  """Writes every layer's new keys and values at once, the pool donated.

  Args:
    pool: k and v [L, P, Z, K, H].
    slot_mapping: i32[...] as in `write_kv`, the same for every layer.
    k_new: [L, ..., K, H].
    v_new: [L, ..., K, H].
  """
  if k_new.shape[0] != pool.n_layers or v_new.shape[0] != pool.n_layers:
    raise ValueError(
      f"write_kv_layers: k_new.shape={tuple(k_new.shape)} and v_new.shape={tuple(v_new.shape)} "
      f"must lead with L={pool.n_layers}"
    )
  write = lambda pk, pv, kn, vn: write_kv(pk, pv, slot_mapping, kn, vn)
  k, v = jax.vmap(write)(pool.k, pool.v, k_new, v_new)
  return KVPool(k=k, v=v)


def gather_kv(
  pool_k: Array, pool_v: Array, block_table: Array, lengths: Array
) -> tuple[Array, Array]:
  """Reads one layer's pages into dense per-sequence K/V (the reference path of attention).

  Slots at or past a sequence's length are zeroed: they hold stale or uninitialised data, and a
  NaN there would survive a zero attention weight (0 * NaN = NaN).

  Args:
    pool_k: [P, Z, K, H].
    pool_v: [P, Z, K, H].
    block_table: i32[B, max_blocks].
    lengths: i32[B].

  Returns:
    (k, v), each [B, S, K, H] with S = max_blocks * Z.
  """
  if pool_k.ndim != 4 or pool_k.shape != pool_v.shape:
    raise ValueError(
      f"gather_kv: pools must be [P, Z, K, H] of one shape, got pool_k.shape="
      f"{tuple(pool_k.shape)} pool_v.shape={tuple(pool_v.shape)}"
    )
  if block_table.ndim != 2 or lengths.shape != block_table.shape[:1]:
    raise ValueError(
      f"gather_kv: need block_table [B, max_blocks] and lengths [B], got block_table.shape="
      f"{tuple(block_table.shape)} lengths.shape={tuple(lengths.shape)}"
    )
  B, max_blocks = block_table.shape
  _, Z, K, H = pool_k.shape
  S = max_blocks * Z
  valid_BS11 = (jnp.arange(S)[None, :] < lengths[:, None])[:, :, None, None]
  k_BSKH = pool_k[block_table].reshape(B, S, K, H)
  v_BSKH = pool_v[block_table].reshape(B, S, K, H)
  zero = jnp.zeros((), pool_k.dtype)
  return jnp.where(valid_BS11, k_BSKH, zero), jnp.where(valid_BS11, v_BSKH, zero)
