"""The Pallas MLA decode kernel (interpret mode on CPU) against its pure-jnp reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.kernels.mla_decode import mla_decode, mla_decode_pallas, mla_decode_reference

C, R = 32, 8
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def inputs(B, T, N, S, dtype, seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  q_nope = jax.random.normal(k[0], (B, T, N, C), jnp.float32).astype(dtype)
  q_rope = jax.random.normal(k[1], (B, T, N, R), jnp.float32).astype(dtype)
  cache = jax.random.normal(k[2], (B, S, C + R), jnp.float32).astype(dtype)
  return q_nope, q_rope, cache


def dense_attention(q_nope, q_rope, cache, lengths, scale):
  """Independent numpy check: per sequence, per query, softmax over the visible slots."""
  q_nope, q_rope, cache = (np.asarray(x, np.float64) for x in (q_nope, q_rope, cache))
  B, T, N, _ = q_nope.shape
  out = np.zeros((B, T, N, C))
  for b in range(B):
    for t in range(T):
      visible = lengths[b] - T + t + 1
      if visible <= 0:
        continue
      keys = cache[b, :visible]
      s = (q_nope[b, t] @ keys[:, :C].T + q_rope[b, t] @ keys[:, C:].T) * scale
      p = np.exp(s - s.max(-1, keepdims=True))
      out[b, t] = (p / p.sum(-1, keepdims=True)) @ keys[:, :C]
  return out


@pytest.mark.parametrize(
  "N,T,dtype",
  [
    (1, 1, jnp.float32),
    (7, 1, jnp.float32),
    (128, 1, jnp.float32),
    (3, 3, jnp.float32),
    (33, 2, jnp.bfloat16),
  ],
)
def test_contiguous_matches_reference(N, T, dtype):
  B, S = 4, 40
  lengths = jnp.array([0, 1, 17, 40], jnp.int32)  # empty, a single token, ragged, full
  q_nope, q_rope, cache = inputs(B, T, N, S, dtype)
  scale = (C + R) ** -0.5
  got = mla_decode_pallas(q_nope, q_rope, cache, lengths, scale=scale, block_k=8, interpret=True)
  want = mla_decode_reference(q_nope, q_rope, cache, lengths, scale=scale)
  assert got.shape == (B, T, N, C) and got.dtype == dtype
  tol = TOL[dtype]
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol
  )
  if dtype == jnp.float32:
    exact = dense_attention(q_nope, q_rope, cache, np.asarray(lengths), scale)
    np.testing.assert_allclose(np.asarray(want), exact, atol=1e-5, rtol=1e-5)
  # Length 0: no visible key, zeros (not NaN).
  assert not np.asarray(got[0]).any()


def test_paged_matches_contiguous_with_stale_pages():
  """Pages in shuffled order through a block table; unused pages and slots hold NaN."""
  B, T, N, Z, max_blocks = 3, 1, 5, 8, 4
  lengths = np.array([1, 30, 9], np.int32)
  q_nope, q_rope, dense = inputs(B, T, N, Z * max_blocks, jnp.float32, seed=1)
  n_pages = B * max_blocks + 2
  perm = np.random.RandomState(0).permutation(n_pages)[: B * max_blocks].reshape(B, max_blocks)
  pool = np.full((n_pages, Z, C + R), np.nan, np.float32)
  for b in range(B):
    for i in range(-(-lengths[b] // Z)):
      rows = np.asarray(dense[b, i * Z : (i + 1) * Z])
      pool[perm[b, i]] = np.where(np.arange(Z)[:, None] + i * Z < lengths[b], rows, np.nan)
  table = jnp.asarray(perm, jnp.int32)
  lengths = jnp.asarray(lengths)
  kw = dict(block_table=table, scale=0.2)
  got = mla_decode(
    q_nope[:, 0],
    q_rope[:, 0],
    jnp.asarray(pool),
    lengths,
    implementation="pallas",
    interpret=True,
    **kw,
  )
  ref = mla_decode(
    q_nope[:, 0], q_rope[:, 0], jnp.asarray(pool), lengths, implementation="xla", **kw
  )
  want = mla_decode_reference(q_nope, q_rope, dense, lengths, scale=0.2)[:, 0]
  assert got.shape == (B, N, C) and np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(ref), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_rejects_mismatched_shapes():
  q_nope, q_rope, cache = inputs(2, 1, 4, 16, jnp.float32)
  with pytest.raises(ValueError, match=r"cache must be \[B, S, C \+ R\]"):
    mla_decode(q_nope, q_rope, cache[..., :-1], jnp.array([1, 2]), scale=1.0)
  with pytest.raises(ValueError, match="lengths must be"):
    mla_decode(q_nope, q_rope, cache, jnp.array([1, 2, 3]), scale=1.0)
  with pytest.raises(ValueError, match="implementation"):
    mla_decode(q_nope, q_rope, cache, jnp.array([1, 2]), scale=1.0, implementation="cudnn")


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize("paged", [False, True])
def test_stacked_cache_reads_the_given_layer_in_place(implementation, paged):
  q_nope, q_rope, cache = inputs(2, 1, 4, 32, jnp.float32)
  lengths = jnp.array([7, 30], jnp.int32)
  table = None
  if paged:  # 8 pages of 4 per sequence, in order
    cache = cache.reshape(16, 4, C + R)
    table = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
  stack = jnp.stack([cache[::-1], cache, cache * 2])
  kw = dict(block_table=table, scale=0.3, implementation=implementation, interpret=True)
  want = mla_decode(q_nope, q_rope, cache, lengths, **kw)
  got = mla_decode(q_nope, q_rope, stack, lengths, layer=jnp.int32(1), **kw)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def paged_pool(dense, lengths, Z, seed=0):
  """The contiguous cache [B, S, E] as shuffled pages, NaN in every slot past a length."""
  B, S, E = dense.shape
  M = S // Z
  n_pages = B * M + 2
  perm = np.random.RandomState(seed).permutation(n_pages)[: B * M].reshape(B, M)
  pool = np.full((n_pages, Z, E), np.nan, np.float32)
  for b in range(B):
    for i in range(-(-int(lengths[b]) // Z)):
      rows = np.asarray(dense[b, i * Z : (i + 1) * Z], np.float32)
      pool[perm[b, i]] = np.where(np.arange(Z)[:, None] + i * Z < lengths[b], rows, np.nan)
  return jnp.asarray(pool, dense.dtype), jnp.asarray(perm, jnp.int32)


@pytest.mark.parametrize(
  "paged,num_splits,pages_per_step,T,N,block_q,dtype",
  [
    (False, 1, 2, 1, 4, 64, jnp.float32),
    (False, 3, 1, 1, 16, 64, jnp.bfloat16),
    (False, 5, 2, 2, 4, 4, jnp.float32),  # two row blocks per split, speculative rows
    (True, 2, 3, 1, 8, 64, jnp.float32),
    (True, 4, 1, 1, 4, 64, jnp.bfloat16),
    (True, 9, 1, 3, 2, 64, jnp.float32),  # more splits than most sequences have pages
  ],
)
def test_splits_match_reference(paged, num_splits, pages_per_step, T, N, block_q, dtype):
  B, S, Z = 4, 48, 4
  lengths = jnp.array([0, 1, 19, 46], jnp.int32)  # empty, one token, off page and split bounds
  q_nope, q_rope, dense = inputs(B, T, N, S, dtype, seed=num_splits)
  cache, table = paged_pool(dense, lengths, Z) if paged else (dense, None)
  kw = dict(block_table=table, scale=0.25)
  got = mla_decode_pallas(
    q_nope,
    q_rope,
    cache,
    lengths,
    block_k=Z,
    block_q=block_q,
    num_splits=num_splits,
    pages_per_step=pages_per_step,
    interpret=True,
    **kw,
  )
  want = mla_decode_reference(q_nope, q_rope, cache, lengths, **kw)
  assert got.shape == (B, T, N, C) and got.dtype == dtype
  assert np.isfinite(np.asarray(got, np.float32)).all()
  tol = TOL[dtype]
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol
  )
  assert not np.asarray(got[0], np.float32).any()


def test_bad_split_options_raise():
  q_nope, q_rope, cache = inputs(2, 1, 4, 16, jnp.float32)
  kw = dict(scale=1.0, implementation="pallas", interpret=True)
  with pytest.raises(ValueError, match="mla_decode: num_splits must be a positive int or None"):
    mla_decode(q_nope, q_rope, cache, jnp.array([1, 2]), num_splits=0, **kw)
  with pytest.raises(ValueError, match="mla_decode: block_q must be a positive int or None"):
    mla_decode(q_nope, q_rope, cache, jnp.array([1, 2]), block_q=-4, **kw)


def test_lowers_to_triton_for_cuda_on_a_cpu():
  """DeepSeek-V3's shape lowers for CUDA here: a Triton call, grid (B, X, row blocks)."""
  qn = jax.ShapeDtypeStruct((4, 128, 512), jnp.bfloat16)
  qr = jax.ShapeDtypeStruct((4, 128, 64), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((2, 64, 64, 576), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((4, 16), jnp.int32)
  lengths = jax.ShapeDtypeStruct((4,), jnp.int32)
  layer = jax.ShapeDtypeStruct((), jnp.int32)
  fn = jax.jit(
    lambda qn, qr, c, n, t, l: mla_decode_pallas(
      qn, qr, c, n, block_table=t, layer=l, scale=0.1, num_splits=2
    )
  )
  text = fn.trace(qn, qr, pool, lengths, table, layer).lower(lowering_platforms=("cuda",)).as_text()
  assert "xla.gpu.triton" in text
  assert "grid_x = 4 : i32, grid_y = 2 : i32, grid_z = 2 : i32" in text
