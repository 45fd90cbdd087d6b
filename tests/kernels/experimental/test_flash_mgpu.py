"""The Mosaic GPU FlashAttention, forward and backward: it cannot run on a CPU, so it is lowered
for CUDA here (Pallas to the Mosaic GPU dialect: shared-memory layouts, barriers, wgmma shapes),
its argument checks are tested, and so is its one jnp piece, `backward_delta`, against jax.grad;
`bench/gpu.py --only mgpu` checks the kernels' numbers against the reference on sm_90."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.kernels.experimental.flash_mgpu import backward_delta, flash_attention_mgpu


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


def test_backward_delta_is_rowsum_of_do_times_out():
  rng = np.random.default_rng(1)
  out, do = (jnp.asarray(rng.normal(size=(2, 8, 3, 16)), jnp.bfloat16) for _ in range(2))
  want = np.einsum("btnh,btnh->bnt", np.float32(out), np.float32(do))
  got = backward_delta(out, do)
  assert got.dtype == jnp.float32 and got.shape == (2, 3, 8)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_backward_delta_with_an_lse_cotangent_gives_the_score_gradient():
  """With a cotangent g on the log-sum-exp, the score gradient jax.grad finds through softmax and
  log-sum-exp is dS = P (dP - delta), delta = `backward_delta(out, do, g)`: the identity both
  backward kernels rely on (GQA 4 / 2, T < S)."""
  B, T, S, N, K, H = 2, 8, 12, 4, 2, 16
  rng = np.random.default_rng(2)
  s_BNTS = jnp.asarray(rng.normal(size=(B, N, T, S)), jnp.float32)
  v_BSKH = jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32)
  do_BTNH = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
  dlse_BNT = jnp.asarray(rng.normal(size=(B, N, T)), jnp.float32)
  v_BSNH = jnp.repeat(v_BSKH, N // K, axis=2)  # query head n reads kv head n // G

  def attend(s_BNTS):
    p_BNTS = jax.nn.softmax(s_BNTS, axis=-1)
    out_BTNH = jnp.einsum("BNTS,BSNH->BTNH", p_BNTS, v_BSNH)
    return out_BTNH, jax.nn.logsumexp(s_BNTS, axis=-1)

  (out_BTNH, _), vjp = jax.vjp(attend, s_BNTS)
  (want_BNTS,) = vjp((do_BTNH, dlse_BNT))
  p_BNTS = jax.nn.softmax(s_BNTS, axis=-1)
  dp_BNTS = jnp.einsum("BTNH,BSNH->BNTS", do_BTNH, v_BSNH)
  delta_BNT = backward_delta(out_BTNH, do_BTNH, dlse_BNT)
  got_BNTS = p_BNTS * (dp_BNTS - delta_BNT[..., None])
  np.testing.assert_allclose(np.asarray(got_BNTS), np.asarray(want_BNTS), atol=1e-5, rtol=1e-5)
