"""The Mosaic GPU FlashAttention, forward and backward: it cannot run on a CPU, so it is lowered
for CUDA here (Pallas to the Mosaic GPU dialect: shared-memory layouts, barriers, wgmma shapes),
its argument checks are tested, and so is the backward's math in plain jnp against the
reference's gradients; `bench/gpu.py --only mgpu` checks its numbers against the reference on
sm_90."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.kernels import attention_reference
from atlas_jax.kernels.flash_mgpu import backward_delta, flash_attention_mgpu


def lower(q_shape, kv_shape, dtype=jnp.bfloat16, **kw):
  q = jax.ShapeDtypeStruct(q_shape, dtype)
  kv = jax.ShapeDtypeStruct(kv_shape, dtype)
  fn = jax.jit(lambda q, k, v: flash_attention_mgpu(q, k, v, **kw))
  return fn.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()


def lower_grad(q_shape, kv_shape, dtype=jnp.bfloat16, with_lse=False, **kw):
  """The gradient of a loss through the kernel (and its log-sum-exp), lowered for CUDA."""

  def loss(q, k, v):
    if with_lse:
      out, lse = flash_attention_mgpu(q, k, v, return_lse=True, **kw)
      return out.astype(jnp.float32).sum() + lse.sum()
    return flash_attention_mgpu(q, k, v, **kw).astype(jnp.float32).sum()

  q = jax.ShapeDtypeStruct(q_shape, dtype)
  kv = jax.ShapeDtypeStruct(kv_shape, dtype)
  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return fn.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
  "causal,q_shape,kv_shape,kw",
  [
    (False, (1, 256, 4, 128), (1, 256, 2, 128), {}),
    (True, (1, 256, 4, 64), (1, 384, 1, 64), dict(stages=3, return_lse=True)),  # T < S
  ],
)
def test_lowers_for_cuda_on_a_cpu(causal, q_shape, kv_shape, kw):
  text = lower(q_shape, kv_shape, causal=causal, **kw)
  assert "mosaic_gpu" in text


@pytest.mark.parametrize(
  "q_shape,kv_shape,kw",
  [
    ((1, 256, 4, 128), (1, 256, 2, 128), dict(causal=False)),  # GQA 4 / 2
    # T < S, GQA 8 / 2; the forward's 128-key blocks, the backward's own 64
    ((2, 256, 8, 128), (2, 512, 2, 128), dict(causal=True, block_kv=128)),
    ((1, 256, 4, 64), (1, 384, 1, 64), dict(causal=True, stages=3)),  # MQA, a 3-slot ring
    ((1, 512, 4, 64), (1, 512, 4, 64), dict(causal=True, block_q=128, dtype=jnp.float16)),
    ((1, 128, 2, 128), (1, 256, 1, 128), dict(causal=True, with_lse=True)),  # lse cotangent
  ],
)
def test_gradient_lowers_for_cuda_on_a_cpu(q_shape, kv_shape, kw):
  text = lower_grad(q_shape, kv_shape, **kw)
  # The forward, the dQ kernel and the dK/dV kernel.
  assert text.count("custom_call @mosaic_gpu") == 3


@pytest.mark.parametrize(
  "q_shape,kv_shape,kw,match",
  [
    ((1, 256, 4, 96), (1, 256, 2, 96), {}, "head dim H=96 must be a multiple of 64"),
    ((1, 192, 4, 64), (1, 256, 2, 64), {}, "T=192 must be a multiple of 2 \\* block_q=128"),
    ((1, 256, 4, 64), (1, 256, 2, 64), dict(block_kv=32), "block_kv=32 must be a multiple"),
    ((1, 256, 4, 64), (1, 256, 2, 64), dict(stages=1), "stages=1 must be at least 2"),
    ((1, 256, 4, 64), (1, 128, 2, 64), dict(causal=True), "causal needs T <= S, got T=256"),
    ((1, 256, 3, 64), (1, 256, 2, 64), {}, "need q \\[B, T, N, H\\], k = v \\[B, S, K, H\\]"),
  ],
)
def test_rejects_what_it_does_not_cover(q_shape, kv_shape, kw, match):
  with pytest.raises(ValueError, match=match):
    lower(q_shape, kv_shape, **kw)


@pytest.mark.parametrize(
  "q_shape,kv_shape,kw,match",
  [
    ((1, 128, 2, 256), (1, 128, 1, 256), {}, "backward: head dim H=256 must be <= 128"),
    ((1, 128, 2, 64), (1, 320, 1, 64), {}, "backward: S=320 must be a multiple of 128"),
  ],
)
def test_gradient_rejects_what_it_does_not_cover(q_shape, kv_shape, kw, match):
  lower(q_shape, kv_shape, **kw)  # the forward covers these
  with pytest.raises(ValueError, match=match):
    lower_grad(q_shape, kv_shape, **kw)


def test_rejects_float32():
  with pytest.raises(ValueError, match=r"must share a dtype in \['bfloat16', 'float16'\]"):
    lower((1, 256, 4, 64), (1, 256, 2, 64), dtype=jnp.float32)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_math_matches_the_reference_gradient(causal):
  """The math the two backward kernels implement, in jnp: P from the saved log-sum-exp,
  dS = P (dP - delta) with `backward_delta` (the lse cotangent folded in), dQ = scale dS K,
  dK = scale dS^T Q and dV = P^T dO summed over each kv head's G query heads, matches
  jax.grad of the reference (GQA 4 / 2, causal with T < S)."""
  B, T, S, N, K, H = 2, 8, 12, 4, 2, 16
  G, scale = N // K, 0.3
  rng = np.random.default_rng(0)
  q, do = (jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32) for _ in range(2))
  k, v = (jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32) for _ in range(2))
  dlse_BTN = jnp.asarray(rng.normal(size=(B, T, N)), jnp.float32)

  def ref(q, k, v):
    return attention_reference(q, k, v, causal=causal, scale=scale, return_lse=True)

  (out, lse_BTN), vjp = jax.vjp(ref, q, k, v)
  want_dq, want_dk, want_dv = vjp((do, dlse_BTN))

  rep = lambda x: jnp.repeat(x, G, axis=2)  # noqa: E731  kv head n // G for query head n
  s_BNTS = jnp.einsum("btnh,bsnh->bnts", q, rep(k)) * scale
  if causal:  # bottom-right aligned: query t sits at position S - T + t
    visible_TS = jnp.arange(S)[None, :] <= (S - T) + jnp.arange(T)[:, None]
    s_BNTS = jnp.where(visible_TS, s_BNTS, -jnp.inf)
  p_BNTS = jnp.exp(s_BNTS - jnp.transpose(lse_BTN, (0, 2, 1))[..., None])
  dp_BNTS = jnp.einsum("btnh,bsnh->bnts", do, rep(v))
  delta_BNT = backward_delta(out, do, jnp.transpose(dlse_BTN, (0, 2, 1)))
  ds_BNTS = p_BNTS * (dp_BNTS - delta_BNT[..., None])
  dq = jnp.einsum("bnts,bsnh->btnh", ds_BNTS, rep(k)) * scale
  group = lambda x: x.reshape(B, S, K, G, H).sum(axis=3)  # noqa: E731  the in-kernel group sum
  dk = group(jnp.einsum("bnts,btnh->bsnh", ds_BNTS, q)) * scale
  dv = group(jnp.einsum("bnts,btnh->bsnh", p_BNTS, do))
  for got, want in ((dq, want_dq), (dk, want_dk), (dv, want_dv)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


def test_backward_delta_is_rowsum_of_do_times_out():
  rng = np.random.default_rng(1)
  out, do = (jnp.asarray(rng.normal(size=(2, 8, 3, 16)), jnp.bfloat16) for _ in range(2))
  want = np.einsum("btnh,btnh->bnt", np.float32(out), np.float32(do))
  got = backward_delta(out, do)
  assert got.dtype == jnp.float32 and got.shape == (2, 3, 8)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
