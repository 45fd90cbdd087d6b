"""Paged KV pool: slot writes, page reads, the allocator's slots, and sharding on 8 devices."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from atlas_jax.cache.allocator import BlockAllocator
from atlas_jax.cache.paged import (
  KVPool,
  LatentPool,
  PageTable,
  gather_kv,
  init_kv_pool,
  init_latent_pool,
  page_table_sharding,
  pool_sharding,
  slot_mapping,
  write_kv,
  write_kv_donated,
  write_kv_layers,
  write_latent,
)


def test_write_kv_scatters_into_slots_and_drops_padding():
  P, Z, K, H = 4, 3, 2, 5
  rng = np.random.default_rng(0)
  pool_k = rng.normal(size=(P, Z, K, H)).astype(np.float32)
  pool_v = rng.normal(size=(P, Z, K, H)).astype(np.float32)
  slots = np.array([[7, 0, -1], [11, -1, 5]], np.int32)
  k_new = rng.normal(size=(2, 3, K, H)).astype(np.float32)
  v_new = rng.normal(size=(2, 3, K, H)).astype(np.float32)
  out_k, out_v = write_kv(*map(jnp.asarray, (pool_k, pool_v, slots, k_new, v_new)))
  expected_k = pool_k.reshape(P * Z, K, H).copy()
  expected_v = pool_v.reshape(P * Z, K, H).copy()
  for (b, t), slot in np.ndenumerate(slots):
    if slot >= 0:
      expected_k[slot], expected_v[slot] = k_new[b, t], v_new[b, t]
  # -1 must be dropped, not wrapped around to the last slot.
  np.testing.assert_array_equal(out_k, expected_k.reshape(P, Z, K, H))
  np.testing.assert_array_equal(out_v, expected_v.reshape(P, Z, K, H))


def test_write_kv_donated_matches_and_consumes_the_pool():
  pool = jnp.zeros((2, 4, 1, 2))
  k_new = jnp.ones((3, 1, 2))
  slots = jnp.array([1, 4, 6], jnp.int32)
  expected, _ = write_kv(pool, pool, slots, k_new, k_new)
  pool_k, pool_v = jnp.zeros_like(pool), jnp.zeros_like(pool)
  out_k, out_v = write_kv_donated(pool_k, pool_v, slots, k_new, 2 * k_new)
  chex.assert_trees_all_equal(out_k, expected)
  chex.assert_trees_all_equal(out_v, 2 * expected)
  assert pool_k.is_deleted() and pool_v.is_deleted()


def test_write_kv_rejects_mismatched_shapes():
  pool = jnp.zeros((2, 4, 1, 2))
  with pytest.raises(ValueError, match=r"slot_mapping.shape=\(2,\)"):
    write_kv(pool, pool, jnp.zeros((2,), jnp.int32), jnp.zeros((3, 1, 2)), jnp.zeros((3, 1, 2)))
  with pytest.raises(ValueError, match=r"new.shape=\(3, 2, 2\)"):
    write_kv(pool, pool, jnp.zeros((3,), jnp.int32), jnp.zeros((3, 2, 2)), jnp.zeros((3, 2, 2)))


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

  # Write every token's position as its K/V, then read the pages back densely.
  pool = jnp.full((12, Z, K, H), jnp.nan)
  for i, seq in enumerate(["a", "b"]):
    n = alloc.length(seq)
    val = jnp.broadcast_to(jnp.arange(n, dtype=jnp.float32)[:, None, None] + 1000 * i, (n, K, H))
    pool, _ = write_kv(pool, pool, jnp.asarray(alloc.slots(seq, 0, n)), val, val)
  k_BSKH, v_BSKH = gather_kv(pool, pool, jnp.asarray(table), jnp.asarray(lengths))
  chex.assert_shape(k_BSKH, (2, 5 * Z, K, H))
  expected = np.zeros((2, 5 * Z))
  expected[0, :14] = np.arange(14)
  expected[1, :2] = 1000 + np.arange(2)
  # Slots past each length are zeroed, so the NaN the pool started with never leaks out.
  np.testing.assert_array_equal(k_BSKH[:, :, 0, 0], expected)
  np.testing.assert_array_equal(v_BSKH[:, :, 1, 2], expected)


def test_write_kv_layers_matches_per_layer_writes():
  L, P, Z, K, H = 3, 4, 2, 1, 2
  rng = np.random.default_rng(1)
  pool = KVPool(
    k=jnp.asarray(rng.normal(size=(L, P, Z, K, H)), jnp.float32),
    v=jnp.asarray(rng.normal(size=(L, P, Z, K, H)), jnp.float32),
  )
  slots = jnp.array([[5, -1, 2]], jnp.int32)
  k_new = jnp.asarray(rng.normal(size=(L, 1, 3, K, H)), jnp.float32)
  v_new = jnp.asarray(rng.normal(size=(L, 1, 3, K, H)), jnp.float32)
  expected = [write_kv(*pool.layer(l), slots, k_new[l], v_new[l]) for l in range(L)]
  out = write_kv_layers(pool, slots, k_new, v_new)
  chex.assert_trees_all_equal(out.k, jnp.stack([e[0] for e in expected]))
  chex.assert_trees_all_equal(out.v, jnp.stack([e[1] for e in expected]))


def test_layer_scan_reads_and_writes_its_slice():
  # The intended model use: scan over layers with the pool's layer axis as xs and ys.
  pool = init_kv_pool(
    n_layers=3, n_blocks=4, block_size=2, n_kv_heads=1, head_dim=2, dtype=jnp.float32
  )
  slots = jnp.array([3], jnp.int32)

  def layer(carry, kv):
    pool_k, pool_v = kv
    new = jnp.full((1, 1, 2), carry)
    return carry + 1.0, write_kv(pool_k, pool_v, slots, new, -new)

  _, (k, v) = jax.lax.scan(layer, 0.0, (pool.k, pool.v))
  assert k[:, 1, 1, 0, 0].tolist() == [0.0, 1.0, 2.0]
  assert v[:, 1, 1, 0, 0].tolist() == [0.0, -1.0, -2.0]
  assert float(jnp.abs(k).sum()) == 2 * (0 + 1 + 2)


def test_latent_pool_write():
  pool = init_latent_pool(n_layers=1, n_blocks=2, block_size=4, latent_dim=6, dtype=jnp.float32)
  c_new = jnp.arange(12, dtype=jnp.float32).reshape(2, 6)
  out = write_latent(pool.c[0], jnp.array([5, -1], jnp.int32), c_new)
  np.testing.assert_array_equal(out[1, 1], c_new[0])
  assert float(jnp.abs(out).sum()) == float(c_new[0].sum())


def test_pool_sharded_over_kv_heads_on_tensor_axis():
  devices = np.array(jax.devices()[:8]).reshape(2, 4)
  mesh = Mesh(devices, ("data", "tensor"))
  pool = init_kv_pool(
    n_layers=2, n_blocks=8, block_size=4, n_kv_heads=8, head_dim=16, dtype=jnp.bfloat16, mesh=mesh
  )
  assert pool.k.sharding.spec == PS(None, None, None, "tensor", None)
  assert {s.data.shape for s in pool.v.addressable_shards} == {(2, 8, 4, 2, 16)}

  # Writing keeps the layout (the scatter runs per shard, no gather of the pool).
  slots = jnp.array([0, 9, 31], jnp.int32)
  k_new = jnp.ones((3, 8, 16), jnp.bfloat16)
  write = jax.jit(write_kv, donate_argnums=(0, 1))
  out_k, _ = write(pool.k[0], pool.v[0], slots, k_new, k_new)
  layer_sharding = NamedSharding(mesh, PS(None, None, "tensor", None))
  assert out_k.sharding.is_equivalent_to(layer_sharding, 4)
  assert float(out_k.astype(jnp.float32).sum()) == 3 * 8 * 16

  # K not divisible by the tensor axis (MQA), no tensor axis, or MLA latent: replicated.
  mqa = jax.eval_shape(lambda: KVPool(k=jnp.zeros((1, 8, 4, 2, 16)), v=jnp.zeros((1, 8, 4, 2, 16))))
  assert pool_sharding(mesh, mqa).k.spec == PS(None, None, None, None, None)
  data_only = Mesh(np.array(jax.devices()[:8]), ("data",))
  assert pool_sharding(data_only, pool).v.spec == PS(None, None, None, None, None)
  latent = init_latent_pool(n_layers=1, n_blocks=4, block_size=4, latent_dim=8, mesh=mesh)
  assert latent.c.sharding.is_fully_replicated
  assert page_table_sharding(mesh).block_table.is_fully_replicated
  with pytest.raises(ValueError, match="KVPool or LatentPool"):
    pool_sharding(mesh, {"k": pool.k})


def test_big_pool_shapes_without_allocating():
  shape = jax.eval_shape(
    lambda: init_kv_pool(n_layers=80, n_blocks=65536, block_size=16, n_kv_heads=8, head_dim=128)
  )
  chex.assert_shape([shape.k, shape.v], (80, 65536, 16, 8, 128))
  assert shape.k.dtype == jnp.bfloat16
  latent = jax.eval_shape(
    lambda: init_latent_pool(n_layers=61, n_blocks=4096, block_size=64, latent_dim=576)
  )
  chex.assert_shape(latent.c, (61, 4096, 64, 576))


def test_init_and_page_table_validation():
  with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
    init_kv_pool(n_layers=1, n_blocks=2, block_size=0, n_kv_heads=1, head_dim=2)
  with pytest.raises(ValueError, match=r"block_table.shape=\(2, 3\) lengths.shape=\(3,\)"):
    PageTable.from_host(np.zeros((2, 3)), np.zeros(3))
  table = PageTable.from_host(np.zeros((2, 3)), np.array([1, 2]))
  assert table.block_table.dtype == jnp.int32 and table.lengths.tolist() == [1, 2]
  assert isinstance(jax.tree.leaves(LatentPool(c=jnp.zeros(1)))[0], jax.Array)
