"""`attention(..., implementation=None)`: the selection rules, checked per platform on a CPU."""

import jax.numpy as jnp
import pytest

from atlas_jax.kernels.attention import (
  AttentionCall,
  cudnn_unsupported,
  default_implementation,
  device_compute_capability,
  select_implementation,
)

HOPPER, AMPERE = (9, 0), (8, 0)
BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)


def call(dtype=BF16, T=1024, S=1024, H=128, **masking) -> AttentionCall:
  return AttentionCall(dtype=dtype, q_len=T, kv_len=S, head_dim=H, **masking)


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_cpu_runs_the_reference(dtype):
  for c in (call(dtype), call(dtype, causal=True, segments=True)):
    assert select_implementation(c, platform="cpu") == "xla"


@pytest.mark.parametrize("dtype,want", [(BF16, "pallas"), (F32, "pallas"), (F16, "pallas")])
def test_tpu_runs_flash_attention(dtype, want):
  assert select_implementation(call(dtype, causal=True, segments=True), platform="tpu") == want
  assert select_implementation(call(jnp.dtype(jnp.int8)), platform="tpu") == "xla"


@pytest.mark.parametrize(
  "c,want",
  [
    (call(causal=True), "cudnn"),  # training without packing, prefill
    (call(), "cudnn"),  # not causal
    (call(F16, causal=True, sliding_window=256), "cudnn"),  # causal window: cuDNN's own
    (call(T=1, S=4096), "cudnn"),  # one query against all keys, not causal
    (call(causal=True, segments=True), "pallas"),  # packed training batch: ours, not XLA
    (call(causal=True, q_positions=True), "pallas"),  # cache prefill at explicit positions
    (call(T=16, S=4096, causal=True), "pallas"),  # bottom-right causal, T != S
    (call(causal=True, kv_lengths=True), "pallas"),
    (call(kv_lengths=True), "pallas"),
    (call(sliding_window=128), "pallas"),  # a window without causal also sees later keys
    (call(F32, causal=True), "pallas"),  # cuDNN takes 16-bit floats only
    (call(H=96 + 4), "pallas"),  # not a multiple of 8
    (call(H=512), "xla"),  # past both kernels' head dim
    (call(jnp.dtype(jnp.int8)), "xla"),
  ],
)
def test_gpu_prefers_cudnn_where_its_masking_covers_the_call(c, want):
  assert select_implementation(c, platform="gpu", compute_capability=HOPPER) == want
  assert select_implementation(c, platform="cuda", compute_capability=HOPPER) == want


def test_gpu_head_dim_limit_depends_on_the_architecture():
  c = call(H=256, causal=True)
  assert select_implementation(c, platform="gpu", compute_capability=HOPPER) == "cudnn"
  assert select_implementation(c, platform="gpu", compute_capability=AMPERE) == "pallas"
  assert select_implementation(call(H=128), platform="gpu", compute_capability=AMPERE) == "cudnn"


def test_gpu_without_cudnn_runs_flash_attention():
  # A GPU with no compute capability (ROCm): no cuDNN, ours.
  assert select_implementation(call(causal=True), platform="rocm") == "pallas"
  assert select_implementation(call(causal=True), platform="gpu") == "pallas"


def test_packed_training_batch_never_takes_the_reference():
  """What the model's training step passes: causal with segment ids, bf16, T == S."""
  q = jnp.zeros((2, 512, 8, 64), jnp.bfloat16)
  seg = jnp.zeros((2, 512), jnp.int32)
  c = AttentionCall.of(q, q, causal=True, q_segment_ids=seg, kv_segment_ids=seg)
  assert c == call(T=512, S=512, H=64, causal=True, segments=True)
  for capability in (HOPPER, AMPERE, None):
    assert select_implementation(c, platform="gpu", compute_capability=capability) == "pallas"


@pytest.mark.parametrize(
  "c,capability,match",
  [
    (call(), None, "no NVIDIA GPU"),
    (call(F32), HOPPER, "bfloat16 or float16, got float32"),
    (call(H=300), HOPPER, "at most 256 .* got 300"),
    (call(segments=True), HOPPER, "packed layout"),
    (call(T=4, causal=True), HOPPER, "T == S when causal, got T=4 S=1024"),
    (call(sliding_window=8), HOPPER, "sliding window"),
  ],
)
def test_cudnn_reasons_name_the_value(c, capability, match):
  assert cudnn_unsupported(call(), HOPPER) is None
  with pytest.raises(AssertionError, match=match):
    reason = cudnn_unsupported(c, capability)
    raise AssertionError(reason)


def test_default_implementation_on_this_cpu():
  q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
  assert default_implementation(q, causal=True) == "xla"
  assert device_compute_capability() is None
