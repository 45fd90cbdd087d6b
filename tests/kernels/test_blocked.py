"""Causal attention in query blocks (`kernels.blocked`) against the reference: values and
gradients, every mask it takes, and the scores it skips counted in the compiled program."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.kernels import attention, attention_reference
from atlas_jax.kernels.blocked import blocked_causal_attention, default_block


def qkv(B=2, T=40, N=6, K=2, H=16, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (rng.standard_normal((B, T, n, H)) for n in (N, K, K))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def segments(B, T, seed=1):
  """Packed documents: ids that step up at random points."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(np.cumsum(rng.random((B, T)) < 0.1, axis=1), jnp.int32)


MASKINGS = {
  "causal": {},
  "sliding_window7": {"sliding_window": 7},
  "sliding_window1": {"sliding_window": 1},
  "segments": "segments",
  "segments+window": "segments+window",
}


# 13 rows: blocks that do not divide T = 40 (the last one shorter); 64: one block, T rows. The
# default run takes every masking with 13 and the causal one with 64; the rest with -m slow.
@pytest.mark.parametrize(
  "block, masking",
  [
    pytest.param(
      block,
      masking,
      id=f"{block}-{name}",
      marks=pytest.mark.slow if block == 64 and name != "causal" else (),
    )
    for block in (13, 64)
    for name, masking in MASKINGS.items()
  ],
)
def test_values_and_gradients_equal_the_reference(masking, block):
  q, k, v = qkv()
  B, T = q.shape[:2]
  if isinstance(masking, str):
    seg = segments(B, T)
    window = {"sliding_window": 5} if "window" in masking else {}
    masking = {"q_segment_ids": seg, "kv_segment_ids": seg, **window}

  def loss(fn, **kw):
    return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, causal=True, **masking, **kw)))

  def blocked(q, k, v, causal, **m):
    return blocked_causal_attention(q, k, v, block=block, **m)

  want, want_grads = jax.value_and_grad(loss(attention_reference), argnums=(0, 1, 2))(q, k, v)
  got, got_grads = jax.value_and_grad(loss(blocked), argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, w, atol=2e-5)
  out = blocked_causal_attention(q, k, v, block=block, **masking)
  np.testing.assert_allclose(out, attention_reference(q, k, v, causal=True, **masking), atol=1e-6)


def test_bfloat16_is_computed_in_float32_like_the_reference():
  q, k, v = qkv(dtype=jnp.bfloat16)
  got = blocked_causal_attention(q, k, v, block=16)
  assert got.dtype == jnp.bfloat16
  want = attention_reference(q, k, v, causal=True)
  # Both round one float32 result to bfloat16: at most one bfloat16 step (2^-8 relative) apart.
  np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=2**-8, atol=1e-6)


def test_rows_that_see_no_key_give_zeros_and_zero_gradients():
  """A query whose segment id no key shares: output 0 and no gradient through it (the hand-written
  backward's +inf log-sum-exp), every other row as in the reference."""
  q, k, v = qkv()
  B, T = q.shape[:2]
  kv_seg = segments(B, T)
  q_seg = kv_seg.at[:, ::5].set(-1)  # rows 0, 5, 10, ... match no key
  masking = {"q_segment_ids": q_seg, "kv_segment_ids": kv_seg}

  def loss(fn, **kw):
    return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, causal=True, **masking, **kw)))

  def blocked(q, k, v, causal, **m):
    return blocked_causal_attention(q, k, v, block=13, **m)

  out = blocked_causal_attention(q, k, v, block=13, **masking)
  np.testing.assert_array_equal(out[:, ::5], 0.0)
  want, want_grads = jax.value_and_grad(loss(attention_reference), argnums=(0, 1, 2))(q, k, v)
  got, got_grads = jax.value_and_grad(loss(blocked), argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_array_equal(got_grads[0][:, ::5], 0.0)
  for g, w in zip(got_grads, want_grads):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, atol=2e-5)


@pytest.mark.slow  # 14 s; the default run checks bf16 values and float32 gradients above
def test_bfloat16_gradients_come_back_in_bfloat16():
  q, k, v = qkv(T=24, dtype=jnp.bfloat16)

  def loss(fn, **kw):
    return lambda q, k, v: jnp.sum(fn(q, k, v, causal=True, **kw).astype(jnp.float32) ** 2)

  want = jax.grad(loss(attention_reference), argnums=(0, 1, 2))(q, k, v)
  got = jax.grad(
    loss(lambda q, k, v, causal: blocked_causal_attention(q, k, v, block=10)), argnums=(0, 1, 2)
  )(q, k, v)
  for g, w in zip(got, want):
    assert g.dtype == jnp.bfloat16
    # Both from float32 math on the same bfloat16 inputs; the forward's bfloat16 output rounding
    # feeds the cotangent, so allow a few bfloat16 steps.
    np.testing.assert_allclose(np.float32(g), np.float32(w), rtol=2**-5, atol=2**-5)


def test_the_dispatcher_takes_it_only_in_the_default_alignment():
  """`attention(implementation="xla")`: blocked for causal self-attention, the reference for
  everything else; both equal the reference."""
  q, k, v = qkv(T=64)
  lengths = jnp.array([64, 30])
  calls = [
    {"causal": True},
    {"causal": False},
    {"causal": True, "kv_lengths": lengths},
    {"causal": True, "q_positions": jnp.tile(jnp.arange(64), (2, 1))},
  ]
  for masking in calls:
    got = attention(q, k, v, implementation="xla", **masking)
    np.testing.assert_allclose(got, attention_reference(q, k, v, **masking), atol=1e-6)

  def scores(masking):
    fn = jax.jit(lambda q, k, v: attention(q, k, v, implementation="xla", **masking))
    return fn.lower(q, k, v).compile().cost_analysis()["flops"]

  # 4 blocks of 16 rows score 16 * (16 + 32 + 48 + 64) keys per head, 5/8 of the 64 * 64.
  assert default_block(64) == 16
  ratio = scores({"causal": True}) / scores({"causal": True, "kv_lengths": jnp.array([64, 64])})
  assert 0.55 < ratio < 0.7


def test_rejects_cross_attention_and_bad_blocks():
  q, k, v = qkv(T=8)
  _, k2, v2 = qkv(T=12)
  with pytest.raises(ValueError, match=r"T == S.*q.shape=\(2, 8, 6, 16\)"):
    blocked_causal_attention(q, k2, v2)
  with pytest.raises(ValueError, match="block=0"):
    blocked_causal_attention(q, k, v, block=0)


def test_every_compiled_product_of_the_gradient_contracts_a_minor_axis():
  """dk = ds^T q and dv = p^T dout contract the query axis; XLA folds a plain transpose into the
  dot, and its CPU backend runs a dot whose left operand contracts a major axis with its own
  loops, not YNNPACK's GEMM. The backward keeps the transposes as copies instead."""
  q, k, v = qkv(B=2, T=64, N=6, K=2, H=16)
  loss = lambda q, k, v: jnp.sum(jnp.sin(blocked_causal_attention(q, k, v, block=16)))
  grad = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
  hlo = grad.lower(q, k, v).compile().as_text()
  dots = re.findall(r"dot\(.*?lhs_batch_dims=\{0,1\}, lhs_contracting_dims=\{(\d+)\}", hlo)
  # 4 blocks: the scores and the output forward, dp, dq, dk and dv backward.
  assert len(dots) == 4 * 6, hlo
  assert set(dots) == {"3"}, dots
