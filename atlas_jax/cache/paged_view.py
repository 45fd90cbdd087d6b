"""The paged cache as the model sees it: the pool, each sequence's block table and length.

`PagedKVCache` is what `Transformer.__call__` takes (in place of a contiguous `KVCache`) to run
on the block pool; `PagedLayerCache` is one layer's slice of it, handed to `Attention`. The host
scheduler (`atlas_jax.serving.engine`) owns which blocks a sequence holds; the model only writes
the new tokens' K/V into their slots and reads the pages back.
"""

from __future__ import annotations

import dataclasses

import jax

from atlas_jax.cache.paged import KVPool

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """A batch of sequences over a shared block pool.

  The new tokens of row b are written at positions `lengths[b] + t` (or the explicit
  `positions_BT` passed to the model); a negative position marks a padding token, which is neither
  written nor counted, so rows of one call may add different numbers of tokens.
  """

  pool: KVPool  # k, v [L, P, Z, K, H]
  block_table: Array  # i32[B, M]; entries past a sequence's blocks are never read
  lengths: Array  # i32[B] tokens held before this call

  def replace(self, **changes) -> PagedKVCache:
    return dataclasses.replace(self, **changes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLayerCache:
  """One layer's view: its pool slice and the lengths *after* this call's tokens."""

  k: Array  # [P, Z, K, H]
  v: Array  # [P, Z, K, H]
  block_table: Array  # i32[B, M]
  kv_lengths: Array  # i32[B] tokens held including the new ones
