"""Chunked local attention (Llama 4's `attention_chunk_size`): query q sees key k only when
k // C == q // C (and k <= q when causal). The reference against an explicit-mask jnp attention,
then every kernel's chunked variant against the reference."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.kernels.attention import attention
from atlas_jax.kernels.blocked import blocked_causal_attention
from atlas_jax.kernels.flash_attention import flash_attention
from atlas_jax.kernels.reference import attention_reference


def _qkv(B, T, S, N, K, H, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (B, T, N, H), jnp.float32)
  k = jax.random.normal(keys[1], (B, S, K, H), jnp.float32)
  v = jax.random.normal(keys[2], (B, S, K, H), jnp.float32)
  do = jax.random.normal(keys[3], (B, T, N, H), jnp.float32)
  return q, k, v, do


def _explicit(q, k, v, *, chunk, causal, window=None):
  """Attention with the mask written out position by position (bottom-right aligned queries)."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  allowed = np.zeros((T, S), bool)
  for t in range(T):
    qpos = S - T + t
    for s in range(S):
      ok = s // chunk == qpos // chunk
      ok &= not causal or s <= qpos
      ok &= window is None or qpos - s < window
      allowed[t, s] = ok
  k_BSNH = jnp.repeat(k, N // K, axis=2)
  v_BSNH = jnp.repeat(v, N // K, axis=2)
  logits = jnp.einsum("BTNH,BSNH->BNTS", q, k_BSNH) * H**-0.5
  logits = jnp.where(jnp.asarray(allowed), logits, -jnp.inf)
  p = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("BNTS,BSNH->BTNH", p, v_BSNH)


@pytest.mark.parametrize(
  "T, S, chunk, causal, window",
  [(12, 12, 4, True, None), (5, 13, 4, True, None), (9, 9, 3, False, None), (16, 16, 8, True, 5)],
)
def test_reference_equals_an_explicit_mask(T, S, chunk, causal, window):
  q, k, v, _ = _qkv(2, T, S, 4, 2, 8)
  got = attention_reference(q, k, v, causal=causal, attention_chunk=chunk, sliding_window=window)
  want = _explicit(q, k, v, chunk=chunk, causal=causal, window=window)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


def _grads(fn, q, k, v, do):
  out, vjp = jax.vjp(fn, q, k, v)
  return out, vjp(do)


@pytest.mark.parametrize(
  "backend, T, S, chunk, causal, window, blocks",
  [
    ("gpu", 40, 40, 16, True, None, dict(block_q=16, block_k=16)),
    ("gpu", 24, 56, 8, True, 12, dict(block_q=16, block_k=16)),  # decode-like: queries last
    ("gpu", 24, 24, 5, False, None, dict(block_q=16, block_k=16)),
    ("tpu", 40, 256, 32, True, None, dict(block_q=8, block_k=128)),
  ],
)
def test_flash_forward_and_backward_equal_the_reference(
  backend, T, S, chunk, causal, window, blocks
):
  q, k, v, do = _qkv(1, T, S, 4, 2, 16, seed=1)
  masks = dict(causal=causal, attention_chunk=chunk, sliding_window=window)
  flash = functools.partial(flash_attention, **masks, **blocks, backend=backend, interpret=True)
  ref = functools.partial(attention_reference, **masks)
  out, grads = jax.jit(functools.partial(_grads, flash))(q, k, v, do)
  ref_out, ref_grads = jax.jit(functools.partial(_grads, ref))(q, k, v, do)
  chex.assert_trees_all_close(out, ref_out, atol=2e-5, rtol=2e-5)
  chex.assert_trees_all_close(grads, ref_grads, atol=1e-4, rtol=1e-4)


def test_flash_skips_the_key_tiles_before_a_chunk():
  """The key bounds put every row's first key at its chunk's start: with chunks of one tile, a
  query tile's key range is its own tile (the causal diagonal's), never an earlier one."""
  from atlas_jax.kernels.flash_attention import _key_bounds

  klo, khi = _key_bounds(
    1,
    64,
    64,
    64,
    64,
    causal=True,
    sliding_window=None,
    q_positions=None,
    kv_lengths=None,
    attention_chunk=16,
  )
  qpos = np.arange(64)
  np.testing.assert_array_equal(np.asarray(klo)[0, :, 0], qpos - qpos % 16)
  np.testing.assert_array_equal(np.asarray(khi)[0, :, 0], qpos + 1)


def test_blocked_and_dispatcher_equal_the_reference():
  q, k, v, do = _qkv(2, 20, 20, 4, 2, 8, seed=2)
  ref = functools.partial(attention_reference, causal=True, attention_chunk=6)
  blocked = functools.partial(blocked_causal_attention, attention_chunk=6, block=8)
  out, grads = _grads(blocked, q, k, v, do)
  ref_out, ref_grads = _grads(ref, q, k, v, do)
  chex.assert_trees_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(grads, ref_grads, atol=1e-5, rtol=1e-5)
  for implementation in ("xla", "pallas"):
    got = attention(q, k, v, causal=True, attention_chunk=6, implementation=implementation)
    chex.assert_trees_all_close(got, ref_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [0, 2.5, True])
def test_bad_chunk_is_named(chunk):
  q, k, v, _ = _qkv(1, 4, 4, 2, 1, 8)
  with pytest.raises(ValueError, match=rf"attention_chunk must be a positive int.*{chunk!r}"):
    attention(q, k, v, causal=True, attention_chunk=chunk)


@pytest.mark.parametrize(
  "backend, platform, kernel", [("gpu", "cuda", "triton"), ("tpu", "tpu", "tpu_custom_call")]
)
def test_flash_chunked_lowers_for_accelerators(backend, platform, kernel):
  q, k, v, do = _qkv(1, 256, 256, 4, 2, 64)
  flash = functools.partial(
    flash_attention,
    causal=True,
    attention_chunk=128,
    sliding_window=200,
    backend=backend,
    interpret=False,
  )
  fn = jax.jit(functools.partial(_grads, flash))
  assert kernel in fn.trace(q, k, v, do).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("T", [1, 5])  # decoding, speculative verification
@pytest.mark.parametrize("implementation", ["pallas", "xla", "reference"])
def test_paged_attention_skips_the_pages_before_a_chunk(T, implementation):
  """Chunked queries over a paged pool equal the reference; for the kernel the pages wholly
  before every query's chunk are NaN, and never read (the jnp loop starts at the batch's
  earliest chunk, so it is given finite pages)."""
  from atlas_jax.kernels.paged_attention import (
    paged_attention,
    paged_attention_reference,
  )
  from tests.kernels.test_paged_attention import make_case

  chunk, Z = 16, 8
  q_BTNH, pool_k, pool_v, table, lengths, dense = make_case(
    lengths=(70, 45, 3), T=T, N=4, K=2, H=16, Z=Z, dtype=jnp.float32, seed=T
  )
  expected = attention_reference(
    q_BTNH, dense["k"], dense["v"], causal=True, kv_lengths=lengths, attention_chunk=chunk
  )
  # The first queries sit at 70 - T and 45 - T: their chunks start at 64 and 32 (T = 1, 5).
  before = jnp.concatenate([table[0, : 64 // Z], table[1, : 32 // Z]])
  q = q_BTNH[:, 0] if T == 1 else q_BTNH
  if implementation == "reference":
    out = paged_attention_reference(q, pool_k, pool_v, table, lengths, attention_chunk=chunk)
  else:
    if implementation == "pallas":
      pool_k, pool_v = (x.at[before].set(jnp.nan) for x in (pool_k, pool_v))
    out = paged_attention(
      q, pool_k, pool_v, table, lengths, attention_chunk=chunk, implementation=implementation
    )
  out = out[:, None] if T == 1 else out
  chex.assert_trees_all_close(out, expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_chunked_lowers_to_triton_for_cuda():
  from atlas_jax.kernels.paged_attention import paged_attention_pallas

  q = jax.ShapeDtypeStruct((4, 32, 128), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((2, 64, 16, 8, 128), jnp.bfloat16)
  ints = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  fn = jax.jit(
    lambda q, k, v, t, n, l: paged_attention_pallas(
      q, k, v, t, n, layer=l, sliding_window=64, attention_chunk=128
    )
  )
  args = (q, pool, pool, ints(4, 16), ints(4), ints())
  assert "xla.gpu.triton" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
  "implementation, backend", [("pallas", "triton"), ("pallas", "mosaic"), ("xla", None)]
)
def test_ragged_paged_attention_chunked_equals_the_reference(implementation, backend):
  """A step mixing a prompt chunk that crosses a chunk boundary, decode tokens and padding: each
  implementation equals the reference. For the kernels the pages wholly before a sequence's
  first query's chunk are NaN, so a read of one would show."""
  from atlas_jax.kernels.ragged_paged_attention import (
    ragged_paged_attention_pallas,
    ragged_paged_attention_reference,
    ragged_paged_attention_xla,
  )
  from tests.kernels.test_ragged_paged_attention import make_step

  chunk, Z = 16, 8
  q, k, v, table, start, qlen, kvlen, layer = make_step(Z=Z)
  ref = ragged_paged_attention_reference(
    q, k, v, table, start, qlen, kvlen, layer=layer, attention_chunk=chunk
  )
  if implementation == "xla":
    got = ragged_paged_attention_xla(
      q, k, v, table, start, qlen, kvlen, layer=layer, attention_chunk=chunk
    )
  else:
    # Sequence 0's queries sit at 40..60 (chunks from 32), sequence 3's at 63 (chunk from 48).
    before = jnp.concatenate([table[0, : 32 // Z], table[3, : 48 // Z]])
    k, v = (x.at[layer, before].set(jnp.nan) for x in (k, v))
    got = ragged_paged_attention_pallas(
      q,
      k,
      v,
      table,
      start,
      qlen,
      kvlen,
      layer=layer,
      attention_chunk=chunk,
      backend=backend,
      interpret=True,
      block_q=8,
    )
  chex.assert_tree_all_finite(got)
  chex.assert_trees_all_close(got, ref, atol=2e-5, rtol=2e-5)


def test_ragged_reference_chunk_is_the_dense_mask():
  """The ragged reference on one sequence equals `attention_reference` on its dense K/V."""
  from atlas_jax.kernels.ragged_paged_attention import ragged_paged_attention_reference
  from tests.kernels.test_ragged_paged_attention import make_step

  q, k, v, table, start, qlen, kvlen, layer = make_step(seqs=((40, 21),), Z=8, gap=0)
  got = ragged_paged_attention_reference(
    q, k, v, table, start, qlen, kvlen, layer=layer, attention_chunk=16
  )
  dense = lambda pool: pool[1, table[0]].reshape(1, -1, *pool.shape[3:])[:, :61]
  want = _explicit(q[None, :21], dense(k), dense(v), chunk=16, causal=True)
  chex.assert_trees_all_close(got[:21], want[0], atol=2e-5, rtol=2e-5)


def test_ragged_chunked_lowers_for_cuda_and_tpu():
  from atlas_jax.kernels.ragged_paged_attention import ragged_paged_attention

  q = jax.ShapeDtypeStruct((64, 8, 128), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((2, 128, 16, 2, 128), jnp.bfloat16)
  ints = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  fn = jax.jit(
    lambda q, k, v, t, s, n, kv, l: ragged_paged_attention(
      q, k, v, t, s, n, kv, layer=l, sliding_window=64, attention_chunk=128
    )
  )
  args = (q, pool, pool, ints(8, 32), ints(8), ints(8), ints(8), ints())
  for platform, kernel in (("cuda", "xla.gpu.triton"), ("tpu", "tpu_custom_call")):
    assert kernel in fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
