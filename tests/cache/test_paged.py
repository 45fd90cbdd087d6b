"""Paged pools: slot writes, page reads, the allocator's slots, pool shapes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.cache.allocator import BlockAllocator
from atlas_jax.cache.paged import (
  KVPool,
  LatentPool,
  gather_pages,
  pool_bytes_per_token,
  slot_mapping,
  write_slots,
)


def test_write_slots_scatters_and_drops_padding():
  P, Z, K, H = 4, 3, 2, 5
  rng = np.random.default_rng(0)
  pool = rng.normal(size=(P, Z, K, H)).astype(np.float32)
  slots = np.array([[7, 0, -1], [11, -1, 5]], np.int32)
  new = rng.normal(size=(2, 3, K, H)).astype(np.float32)
  out = write_slots(jnp.asarray(pool), jnp.asarray(slots), jnp.asarray(new))
  expected = pool.reshape(P * Z, K, H).copy()
  for (b, t), slot in np.ndenumerate(slots):
    if slot >= 0:
      expected[slot] = new[b, t]
  # -1 must be dropped, not wrapped around to the last slot.
  np.testing.assert_array_equal(out, expected.reshape(P, Z, K, H))


def test_write_slots_donated_updates_in_place():
  pool = jnp.zeros((2, 4, 1, 2))
  new = jnp.ones((3, 1, 2))
  slots = jnp.array([1, 4, 6], jnp.int32)
  expected = write_slots(pool, slots, new)
  donated = jnp.zeros_like(pool)
  out = jax.jit(write_slots, donate_argnums=0)(donated, slots, new)
  chex.assert_trees_all_equal(out, expected)
  assert donated.is_deleted()


def test_write_slots_rejects_mismatched_shapes():
  pool = jnp.zeros((2, 4, 1, 2))
  with pytest.raises(ValueError, match=r"slot_mapping.shape=\(2,\)"):
    write_slots(pool, jnp.zeros((2,), jnp.int32), jnp.zeros((3, 1, 2)))
  with pytest.raises(ValueError, match=r"new.shape=\(3, 2, 2\)"):
    write_slots(pool, jnp.zeros((3,), jnp.int32), jnp.zeros((3, 2, 2)))


def test_slot_mapping_matches_the_allocator_and_gather_reads_back():
  Z, K, H = 4, 2, 3
  alloc = BlockAllocator(12, Z)
  alloc.add_sequence("a", range(9))
  alloc.add_sequence("b", range(100, 102))
  alloc.append("a", range(9, 14))
  table, lengths = alloc.block_table(["a", "b"], max_blocks=5)
  positions = np.array([[3, 13, -1], [0, 1, -1]], np.int32)
  slots = slot_mapping(jnp.asarray(table), jnp.asarray(positions), block_size=Z)
  assert (
    slots[0, :2].tolist() == alloc.slots("a", 3, 4).tolist() + alloc.slots("a", 13, 14).tolist()
  )
  assert slots[1, :2].tolist() == alloc.slots("b", 0, 2).tolist()
  assert slots[:, 2].tolist() == [-1, -1]

  # Write every token's position as its entry, then read the pages back densely.
  pool = jnp.full((12, Z, K, H), jnp.nan)
  for i, seq in enumerate(["a", "b"]):
    n = alloc.length(seq)
    val = jnp.broadcast_to(jnp.arange(n, dtype=jnp.float32)[:, None, None] + 1000 * i, (n, K, H))
    pool = write_slots(pool, jnp.asarray(alloc.slots(seq, 0, n)), val)
  dense_BSKH = gather_pages(pool, jnp.asarray(table), jnp.asarray(lengths))
  chex.assert_shape(dense_BSKH, (2, 5 * Z, K, H))
  expected = np.zeros((2, 5 * Z))
  expected[0, :14] = np.arange(14)
  expected[1, :2] = 1000 + np.arange(2)
  # Slots past each length are zeroed, so the NaN the pool started with never leaks out.
  np.testing.assert_array_equal(dense_BSKH[:, :, 0, 0], expected)
  np.testing.assert_array_equal(dense_BSKH[:, :, 1, 2], expected)


def test_layer_scan_reads_and_writes_its_slice():
  # The model's use: scan over layers with the pool's layer axis as xs and ys.
  pool = KVPool.init(
    n_layers=3, n_blocks=4, block_size=2, n_kv_heads=1, head_dim=2, dtype=jnp.float32
  )
  slots = jnp.array([3], jnp.int32)

  def layer(carry, kv):
    pool_k, pool_v = kv
    new = jnp.full((1, 1, 2), carry)
    return carry + 1.0, (write_slots(pool_k, slots, new), write_slots(pool_v, slots, -new))

  _, (k, v) = jax.lax.scan(layer, 0.0, pool.arrays)
  assert k[:, 1, 1, 0, 0].tolist() == [0.0, 1.0, 2.0]
  assert v[:, 1, 1, 0, 0].tolist() == [0.0, -1.0, -2.0]
  assert float(jnp.abs(k).sum()) == 2 * (0 + 1 + 2)


def test_latent_pool_write_and_bytes():
  pool = LatentPool.init(
    n_layers=2, n_blocks=2, block_size=4, kv_lora_rank=4, rope_dim=2, dtype=jnp.float32
  )
  c_new = jnp.arange(12, dtype=jnp.float32).reshape(2, 6)
  out = write_slots(pool.c[0], jnp.array([5, -1], jnp.int32), c_new)
  np.testing.assert_array_equal(out[1, 1], c_new[0])
  assert float(jnp.abs(out).sum()) == float(c_new[0].sum())
  assert pool_bytes_per_token(pool) == 2 * 6 * 4  # L * (C + R) * float32


def test_big_pool_shapes_without_allocating():
  kv = jax.eval_shape(
    lambda: KVPool.init(n_layers=80, n_blocks=65536, block_size=16, n_kv_heads=8, head_dim=128)
  )
  chex.assert_shape([kv.k, kv.v], (80, 65536, 16, 8, 128))
  assert kv.k.dtype == jnp.bfloat16
  assert pool_bytes_per_token(kv) == 2 * 80 * 8 * 128 * 2  # LLaMA-2-70B: 320 KiB per token
  latent = jax.eval_shape(
    lambda: LatentPool.init(
      n_layers=61, n_blocks=4096, block_size=64, kv_lora_rank=512, rope_dim=64
    )
  )
  chex.assert_shape(latent.c, (61, 4096, 64, 576))


def test_init_validation():
  with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
    KVPool.init(n_layers=1, n_blocks=2, block_size=0, n_kv_heads=1, head_dim=2)
  with pytest.raises(ValueError, match="rope_dim must be a positive int, got -1"):
    LatentPool.init(n_layers=1, n_blocks=2, block_size=4, kv_lora_rank=8, rope_dim=-1)
  assert isinstance(jax.tree.leaves(LatentPool(c=jnp.zeros(1), rope_dim=2))[0], jax.Array)
