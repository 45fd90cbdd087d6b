"""The Mosaic GPU FlashAttention forward: it cannot run on a CPU, so it is lowered for CUDA here
(Pallas to the Mosaic GPU dialect: shared-memory layouts, barriers, wgmma shapes) and its argument
checks are tested; `bench/gpu.py --only mgpu` checks its numbers against the reference on sm_90."""

import jax
import jax.numpy as jnp
import pytest

from atlas_jax.kernels.flash_mgpu import flash_attention_mgpu


def lower(q_shape, kv_shape, dtype=jnp.bfloat16, **kw):
  q = jax.ShapeDtypeStruct(q_shape, dtype)
  kv = jax.ShapeDtypeStruct(kv_shape, dtype)
  fn = jax.jit(lambda q, k, v: flash_attention_mgpu(q, k, v, **kw))
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


def test_rejects_float32():
  with pytest.raises(ValueError, match=r"must share a dtype in \['bfloat16', 'float16'\]"):
    lower((1, 256, 4, 64), (1, 256, 2, 64), dtype=jnp.float32)
