"""The reference attention against jax.nn.dot_product_attention, and the dispatcher's contract."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.kernels import attention, attention_reference


def qkv(B, T, S, N, K, H, dtype=jnp.float32, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (
    jax.random.normal(kq, (B, T, N, H), dtype),
    jax.random.normal(kk, (B, S, K, H), dtype),
    jax.random.normal(kv, (B, S, K, H), dtype),
  )


@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_jax_dot_product_attention(N, K, causal):
  q, k, v = qkv(2, 19, 19, N, K, 16)
  want = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
  chex.assert_trees_all_close(attention_reference(q, k, v, causal=causal), want, atol=1e-5)


def test_kv_lengths_and_bottom_right_alignment():
  q, k, v = qkv(2, 3, 10, 4, 2, 8)
  lengths = jnp.array([10, 6], jnp.int32)
  got = attention_reference(q, k, v, causal=True, kv_lengths=lengths)
  for b, n in enumerate([10, 6]):
    # The three queries are the last three of the n valid keys: a causal T=S problem on the tail.
    full = jax.nn.dot_product_attention(
      jnp.concatenate([jnp.zeros((1, n - 3, 4, 8)), q[b : b + 1]], 1),
      k[b : b + 1, :n],
      v[b : b + 1, :n],
      is_causal=True,
      implementation="xla",
    )
    chex.assert_trees_all_close(got[b], full[0, -3:], atol=1e-5)


def test_fully_masked_rows_are_zero_not_nan():
  q, k, v = qkv(1, 4, 4, 2, 1, 8)
  seg_q = jnp.array([[0, 0, 1, 1]])
  seg_k = jnp.array([[0, 0, 2, 2]])
  out, lse = attention_reference(
    q, k, v, q_segment_ids=seg_q, kv_segment_ids=seg_k, return_lse=True
  )
  np.testing.assert_array_equal(out[0, 2:], 0.0)
  assert np.all(np.isneginf(lse[0, 2:]))
  g = jax.grad(
    lambda q: attention_reference(q, k, v, q_segment_ids=seg_q, kv_segment_ids=seg_k).sum()
  )(q)
  assert np.all(np.isfinite(g))


def test_lse_matches_logsumexp():
  q, k, v = qkv(1, 5, 7, 4, 2, 8)
  _, lse = attention_reference(q, k, v, return_lse=True)
  logits = jnp.einsum("btnh,bsnh->btns", q, jnp.repeat(k, 2, axis=2)) / jnp.sqrt(8.0)
  chex.assert_trees_all_close(lse, jax.nn.logsumexp(logits, -1), atol=1e-5)


def test_sliding_window():
  q, k, v = qkv(1, 9, 9, 2, 2, 8)
  got = attention_reference(q, k, v, causal=True, sliding_window=3)
  want = jax.nn.dot_product_attention(
    q, k, v, is_causal=True, local_window_size=(2, 0), implementation="xla"
  )
  chex.assert_trees_all_close(got, want, atol=1e-5)


@pytest.mark.parametrize(
  "shapes, match",
  [
    (((2, 4, 4, 8), (2, 4, 3, 8), (2, 4, 3, 8)), "multiple of kv heads K=3"),
    (((2, 4, 4, 8), (2, 4, 2, 16), (2, 4, 2, 16)), "head dim mismatch"),
    (((2, 4, 4), (2, 4, 2, 8), (2, 4, 2, 8)), "rank 4"),
    (((2, 4, 4, 8), (3, 4, 2, 8), (3, 4, 2, 8)), "batch mismatch"),
    (((2, 4, 4, 8), (2, 4, 2, 8), (2, 5, 2, 8)), "same shape"),
  ],
)
def test_bad_shapes_raise_naming_them(shapes, match):
  arrays = [jnp.zeros(s) for s in shapes]
  with pytest.raises(ValueError, match=match):
    attention(*arrays)


def test_dispatcher_rejects_bad_arguments():
  q, k, v = qkv(1, 4, 4, 2, 2, 8)
  with pytest.raises(ValueError, match="implementation='fast'"):
    attention(q, k, v, implementation="fast")
  with pytest.raises(ValueError, match="share a dtype"):
    attention(q, k.astype(jnp.bfloat16), v)
  with pytest.raises(ValueError, match="implementation='cudnn' cannot run this call.*no NVIDIA"):
    attention(q, k, v, implementation="cudnn")
  chex.assert_trees_all_close(
    attention(q, k, v, implementation="xla"), attention_reference(q, k, v)
  )
