"""Paged attention kernel vs dense attention, with NaN in every slot the kernel must not read."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.cache.paged import slot_mapping, write_slots
from atlas_jax.kernels import attention_reference, paged_attention, paged_attention_reference
from atlas_jax.kernels.paged_attention import paged_attention_pallas, paged_attention_xla

LENGTHS = (0, 1, 3, 255, 256, 257, 1023)
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_case(*, lengths, T, N, K, H, Z, dtype, seed=0):
  """A paged pool built through a permuted block table, and the same K/V as dense arrays.

  Every slot the kernel must not read is NaN: the unused tail of each sequence's last page, the
  pages a sequence does not hold, and the spare pages padding table rows point at.
  """
  rng = np.random.default_rng(seed)
  B = len(lengths)
  lengths = np.asarray(lengths, np.int32)
  max_blocks = max(1, -(-int(lengths.max()) // Z))
  S = max_blocks * Z
  n_held = -(-lengths // Z)
  P = int(n_held.sum()) + 3
  perm = rng.permutation(P)
  table = np.full((B, max_blocks), perm[-1], np.int32)  # padding points at a NaN page
  start = 0
  for b in range(B):
    table[b, : n_held[b]] = perm[start : start + n_held[b]]
    start += n_held[b]
  valid_BS = np.arange(S)[None, :] < lengths[:, None]
  k_BSKH = np.where(valid_BS[..., None, None], rng.normal(size=(B, S, K, H)), 0.0)
  v_BSKH = np.where(valid_BS[..., None, None], rng.normal(size=(B, S, K, H)), 0.0)
  q_BTNH = rng.normal(size=(B, T, N, H))

  k_BSKH, v_BSKH, q_BTNH = (jnp.asarray(x, dtype) for x in (k_BSKH, v_BSKH, q_BTNH))
  table, lengths = jnp.asarray(table), jnp.asarray(lengths)
  positions_BS = jnp.where(jnp.asarray(valid_BS), jnp.arange(S)[None, :], -1)
  slots_BS = slot_mapping(table, positions_BS, block_size=Z)
  nan_PZKH = jnp.full((P, Z, K, H), jnp.nan, dtype)
  pool_k, pool_v = write_slots(nan_PZKH, slots_BS, k_BSKH), write_slots(nan_PZKH, slots_BS, v_BSKH)
  dense = dict(k=k_BSKH, v=v_BSKH)
  return q_BTNH, pool_k, pool_v, table, lengths, dense


def dense_expected(q_BTNH, dense, lengths):
  return attention_reference(q_BTNH, dense["k"], dense["v"], causal=True, kv_lengths=lengths)


class PagedAttentionTest:
  INTERPRET = False

  def run_kernel(self, *args, **kwargs):
    return paged_attention_pallas(*args, interpret=self.INTERPRET, **kwargs)

  @pytest.mark.parametrize(
    "Z,dtype", [(8, jnp.float32), (16, jnp.bfloat16), (32, jnp.float32), (64, jnp.bfloat16)]
  )
  def test_decode_matches_dense(self, Z, dtype):
    q_BTNH, pool_k, pool_v, table, lengths, dense = make_case(
      lengths=LENGTHS, T=1, N=4, K=2, H=32, Z=Z, dtype=dtype, seed=Z
    )
    q_BNH = q_BTNH[:, 0]
    out_BNH = self.run_kernel(q_BNH, pool_k, pool_v, table, lengths)
    chex.assert_shape(out_BNH, q_BNH.shape)
    chex.assert_type(out_BNH, dtype)
    chex.assert_tree_all_finite(out_BNH)
    expected_BNH = dense_expected(q_BTNH, dense, lengths)[:, 0]
    tol = TOLERANCE[dtype]
    chex.assert_trees_all_close(out_BNH, expected_BNH, atol=tol, rtol=tol)
    ref_BNH = paged_attention_reference(q_BNH, pool_k, pool_v, table, lengths)
    chex.assert_trees_all_close(ref_BNH, expected_BNH, atol=tol, rtol=tol)
    # Length 0 attends to nothing: exactly zero, not NaN.
    np.testing.assert_array_equal(np.asarray(out_BNH[0], np.float32), 0.0)

  @pytest.mark.parametrize("Z,N,K", [(8, 4, 1), (16, 6, 2), (64, 2, 2)])
  def test_speculative_tokens_causal(self, Z, N, K):
    # T = 3 new tokens: bottom-right causal, so lengths 0 and 1 leave some rows with no key.
    lengths = (0, 1, 3, 257, 1023)
    q_BTNH, pool_k, pool_v, table, lengths, dense = make_case(
      lengths=lengths, T=3, N=N, K=K, H=16, Z=Z, dtype=jnp.float32, seed=N
    )
    out_BTNH = self.run_kernel(q_BTNH, pool_k, pool_v, table, lengths)
    expected_BTNH = dense_expected(q_BTNH, dense, lengths)
    chex.assert_trees_all_close(out_BTNH, expected_BTNH, atol=1e-5, rtol=1e-5)
    ref_BTNH = paged_attention_reference(q_BTNH, pool_k, pool_v, table, lengths)
    chex.assert_trees_all_close(ref_BTNH, expected_BTNH, atol=1e-5, rtol=1e-5)
    # Sequence 1 holds one token: only its last query row (position 0) sees a key.
    np.testing.assert_array_equal(np.asarray(out_BTNH[1, :2]), 0.0)
    chex.assert_trees_all_close(out_BTNH[1, 2], dense["v"][1, 0].repeat(N // K, axis=0))

  def test_queries_see_only_their_prefix(self):
    # Perturbing the newest token's K/V changes only the last query row's output.
    q_BTNH, pool_k, pool_v, table, lengths, _ = make_case(
      lengths=(20,), T=2, N=2, K=1, H=8, Z=8, dtype=jnp.float32
    )
    out = self.run_kernel(q_BTNH, pool_k, pool_v, table, lengths)
    slot = int(table[0, 19 // 8]) * 8 + 19 % 8
    pool_v2 = pool_v.reshape(-1, 1, 8).at[slot].add(10.0).reshape(pool_v.shape)
    out2 = self.run_kernel(q_BTNH, pool_k, pool_v2, table, lengths)
    np.testing.assert_array_equal(np.asarray(out[0, 0]), np.asarray(out2[0, 0]))
    assert np.abs(np.asarray(out2[0, 1] - out[0, 1])).min() > 1e-3

  def test_scale(self):
    q_BTNH, pool_k, pool_v, table, lengths, dense = make_case(
      lengths=(5, 40), T=1, N=2, K=2, H=8, Z=8, dtype=jnp.float32
    )
    out = self.run_kernel(q_BTNH, pool_k, pool_v, table, lengths, scale=0.3)
    expected = attention_reference(
      q_BTNH, dense["k"], dense["v"], causal=True, kv_lengths=lengths, scale=0.3
    )
    chex.assert_trees_all_close(out, expected, atol=1e-5, rtol=1e-5)

  @pytest.mark.parametrize("T", [1, 3])
  @pytest.mark.parametrize(
    "options",
    [
      dict(sliding_window=9),
      dict(soft_cap=1.5, sinks=True),
      dict(sliding_window=5, soft_cap=2.0, sinks=True),
    ],
    ids=["window", "cap_sinks", "window_cap_sinks"],
  )
  def test_window_soft_cap_and_sinks(self, T, options):
    q_BTNH, pool_k, pool_v, table, lengths, dense = make_case(
      lengths=(0, 1, 3, 40, 70), T=T, N=4, K=2, H=16, Z=8, dtype=jnp.float32, seed=T
    )
    q_BTNH = q_BTNH * 3.0  # scores large enough for the cap to matter
    kw = dict(options)
    if kw.pop("sinks", False):
      kw["sinks"] = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    q = q_BTNH[:, 0] if T == 1 else q_BTNH
    out = self.run_kernel(q, pool_k, pool_v, table, lengths, **kw)
    expected = attention_reference(
      q_BTNH, dense["k"], dense["v"], causal=True, kv_lengths=lengths, **kw
    )
    expected = expected[:, 0] if T == 1 else expected
    chex.assert_trees_all_close(out, expected, atol=1e-5, rtol=1e-5)
    ref = paged_attention_reference(q, pool_k, pool_v, table, lengths, **kw)
    chex.assert_trees_all_close(ref, expected, atol=1e-5, rtol=1e-5)


class TestPagedAttentionInterpret(PagedAttentionTest):
  INTERPRET = True

  def test_window_skips_the_pages_before_it(self):
    """Pages wholly before every query's window are never read: NaN there stays out."""
    q_BTNH, pool_k, pool_v, table, lengths, dense = make_case(
      lengths=(70, 45), T=1, N=4, K=2, H=16, Z=8, dtype=jnp.float32
    )
    window = 12  # the queries at 69 and 44 see from 58 and 33: pages 0-6 and 0-3 unread
    before = jnp.concatenate([table[0, :7], table[1, :4]])
    pool_k, pool_v = (x.at[before].set(jnp.nan) for x in (pool_k, pool_v))
    out = self.run_kernel(
      q_BTNH[:, 0], pool_k, pool_v, table, lengths, sliding_window=window, num_splits=3
    )
    expected = attention_reference(
      q_BTNH, dense["k"], dense["v"], causal=True, kv_lengths=lengths, sliding_window=window
    )
    chex.assert_trees_all_close(out, expected[:, 0], atol=1e-5, rtol=1e-5)


class TestPagedAttentionXLA(PagedAttentionTest):
  """The jnp loop over pages (the "xla" implementation), with the same NaN-filled pools."""

  def run_kernel(self, *args, **kwargs):
    return paged_attention_xla(*args, **kwargs)


@pytest.mark.parametrize("T", [2, 12])  # 4 queries a kv head (products), 24 (einsums)
@pytest.mark.parametrize("keys_per_step", [1, 8, 24, 40, 2048])
def test_xla_loop_steps_of_any_width_match_the_reference(keys_per_step, T):
  """Steps of one page up to the whole table, and widths that do not divide the table (its
  last step padded with columns past every length), in both of the loop's score layouts."""
  q_BTNH, pool_k, pool_v, table, lengths, dense = make_case(
    lengths=(0, 1, 9, 40, 63), T=T, N=4, K=2, H=8, Z=8, dtype=jnp.float32, seed=3
  )
  out = paged_attention_xla(q_BTNH, pool_k, pool_v, table, lengths, keys_per_step=keys_per_step)
  chex.assert_tree_all_finite(out)
  chex.assert_trees_all_close(out, dense_expected(q_BTNH, dense, lengths), atol=1e-5, rtol=1e-5)


def _inputs(B=2, T=None, N=4, K=2, H=8, P=6, Z=8, max_blocks=3, dtype=jnp.float32):
  q = jnp.zeros((B, N, H) if T is None else (B, T, N, H), dtype)
  pool = jnp.zeros((P, Z, K, H), dtype)
  return [q, pool, pool, jnp.zeros((B, max_blocks), jnp.int32), jnp.zeros((B,), jnp.int32)]


@pytest.mark.parametrize(
  "index,bad,match",
  [
    (0, jnp.zeros((2, 8)), "q must be"),
    (0, jnp.zeros((2, 3, 8)), "query heads N=3"),
    (0, jnp.zeros((2, 4, 16)), "head dim"),
    (1, jnp.zeros((6, 8, 8)), "pool_k and pool_v"),
    (2, jnp.zeros((6, 8, 1, 8)), "pool_k and pool_v"),
    (3, jnp.zeros((3, 3), jnp.int32), "block_table"),
    (4, jnp.zeros((3,), jnp.int32), "lengths"),
    (3, jnp.zeros((2, 3), jnp.float32), "block_table must be integer"),
    (1, jnp.zeros((6, 8, 2, 8), jnp.bfloat16), "share a floating dtype"),
  ],
)
@pytest.mark.parametrize("fn", [paged_attention_pallas, paged_attention_reference])
def test_bad_inputs_raise_naming_shapes(fn, index, bad, match):
  args = _inputs()
  args[index] = bad
  with pytest.raises(ValueError, match=match) as info:
    fn(*args)
  assert "q.shape=" in str(info.value) and "pool_k.shape=" in str(info.value)


def test_dispatcher():
  q_BTNH, pool_k, pool_v, table, lengths, dense = make_case(
    lengths=(9, 17), T=1, N=2, K=1, H=8, Z=8, dtype=jnp.float32
  )
  expected = dense_expected(q_BTNH, dense, lengths)[:, 0]
  for implementation in ("pallas", "xla", None):
    out = paged_attention(
      q_BTNH[:, 0], pool_k, pool_v, table, lengths, implementation=implementation
    )
    chex.assert_trees_all_close(out, expected, atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="implementation='triton'"):
    paged_attention(q_BTNH[:, 0], pool_k, pool_v, table, lengths, implementation="triton")


def test_kernel_under_jit_with_traced_lengths():
  # The block table and lengths change every step: they must be data, not compile-time constants.
  q_BTNH, pool_k, pool_v, table, lengths, dense = make_case(
    lengths=(30, 3), T=1, N=2, K=1, H=8, Z=8, dtype=jnp.float32
  )
  step = jax.jit(lambda *a: paged_attention(*a, implementation="pallas", interpret=True))
  for lens in ((30, 3), (17, 1)):
    lens = jnp.asarray(lens, jnp.int32)
    out = step(q_BTNH[:, 0], pool_k, pool_v, table, lens)
    expected = dense_expected(q_BTNH, dense, lens)[:, 0]
    chex.assert_trees_all_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_stacked_pool_reads_the_given_layer_in_place(implementation):
  """Pools stacked over layers with a layer index (as the model's layer scan carries them) give
  what the layer's own pool gives."""
  q, pool_k, pool_v, table, lengths, _ = make_case(
    lengths=(5, 17, 0), T=1, N=4, K=2, H=16, Z=4, dtype=jnp.float32
  )
  other_k, other_v = jnp.flip(pool_k, 0), jnp.flip(pool_v, 0)  # layers 0 and 2 hold other data
  stack_k = jnp.stack([other_k, pool_k, other_k])
  stack_v = jnp.stack([other_v, pool_v, other_v])
  kw = dict(implementation=implementation, interpret=True)
  want = paged_attention(q[:, 0], pool_k, pool_v, table, lengths, **kw)
  got = paged_attention(q[:, 0], stack_k, stack_v, table, lengths, layer=jnp.int32(1), **kw)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match=r"\[L, P, Z, K, H\]"):
    paged_attention(q[:, 0], pool_k, pool_v, table, lengths, layer=jnp.int32(0), **kw)


# -- flash decoding: KV splits and several pages per iteration ------------------------------------


@pytest.mark.parametrize(
  "num_splits,pages_per_step,N,K,dtype",
  [
    (1, 3, 4, 4, jnp.float32),  # MHA, one split, 3 pages per step
    (2, 1, 8, 2, jnp.bfloat16),  # G = 4
    (3, 2, 8, 1, jnp.float32),  # MQA, G = 8
    (7, 1, 8, 2, jnp.float32),  # more splits than some sequences have pages
    (4, 2, 4, 1, jnp.bfloat16),
  ],
)
def test_splits_match_reference(num_splits, pages_per_step, N, K, dtype):
  # Z = 4 and 10 pages: lengths off every page and split boundary, one token, and an empty row.
  q_BTNH, pool_k, pool_v, table, lengths, dense = make_case(
    lengths=(0, 1, 13, 37, 40), T=1, N=N, K=K, H=16, Z=4, dtype=dtype, seed=num_splits
  )
  out_BNH = paged_attention_pallas(
    q_BTNH[:, 0],
    pool_k,
    pool_v,
    table,
    lengths,
    num_splits=num_splits,
    pages_per_step=pages_per_step,
    interpret=True,
  )
  chex.assert_type(out_BNH, dtype)
  chex.assert_tree_all_finite(out_BNH)
  want_BNH = paged_attention_reference(q_BTNH[:, 0], pool_k, pool_v, table, lengths)
  tol = TOLERANCE[dtype]
  chex.assert_trees_all_close(out_BNH, want_BNH, atol=tol, rtol=tol)
  np.testing.assert_array_equal(np.asarray(out_BNH[0], np.float32), 0.0)


def test_splits_with_speculative_tokens():
  # T = 3 over 4 splits: the causal rows of a sequence end in different splits.
  q_BTNH, pool_k, pool_v, table, lengths, dense = make_case(
    lengths=(2, 9, 30), T=3, N=4, K=2, H=16, Z=4, dtype=jnp.float32
  )
  out = paged_attention_pallas(
    q_BTNH, pool_k, pool_v, table, lengths, num_splits=4, pages_per_step=2, interpret=True
  )
  chex.assert_trees_all_close(out, dense_expected(q_BTNH, dense, lengths), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(num_splits=0), "num_splits must be a positive int or None, got 0"),
    (dict(pages_per_step=2.0), "pages_per_step must be a positive int or None, got 2.0"),
  ],
)
def test_bad_split_options_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    paged_attention(*_inputs(), implementation="pallas", interpret=True, **kwargs)


def test_lowers_to_triton_for_cuda_on_a_cpu():
  """The compiled kernel (not interpret mode) lowers for CUDA here: Triton, grid (B, K, X)."""
  q = jax.ShapeDtypeStruct((4, 32, 128), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((2, 64, 16, 8, 128), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((4, 16), jnp.int32)
  lengths = jax.ShapeDtypeStruct((4,), jnp.int32)
  layer = jax.ShapeDtypeStruct((), jnp.int32)
  fn = jax.jit(
    lambda q, k, v, t, n, l: paged_attention_pallas(q, k, v, t, n, layer=l, num_splits=4)
  )
  text = (
    fn.trace(q, pool, pool, table, lengths, layer).lower(lowering_platforms=("cuda",)).as_text()
  )
  assert "xla.gpu.triton" in text
  assert "grid_x = 4 : i32, grid_y = 8 : i32, grid_z = 4 : i32" in text


def test_window_soft_cap_and_sinks_lower_to_triton_for_cuda():
  q = jax.ShapeDtypeStruct((4, 32, 128), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((2, 64, 16, 8, 128), jnp.bfloat16)
  ints = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  sinks = jax.ShapeDtypeStruct((32,), jnp.float32)
  fn = jax.jit(
    lambda q, k, v, t, n, l, sinks: paged_attention_pallas(
      q, k, v, t, n, layer=l, sliding_window=64, soft_cap=30.0, sinks=sinks
    )
  )
  args = (q, pool, pool, ints(4, 16), ints(4), ints(), sinks)
  assert "xla.gpu.triton" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
