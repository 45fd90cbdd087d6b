"""RoPE: rotations keep norms, scores depend only on relative position, the hand-written gradient
equals autodiff's, cos and sin computed once per angle on a CPU, Llama-3 scaling bands; partial
rotation, LongRoPE's traced short/long choice and the YaRN / LongRoPE factors against
transformers'."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.config import ConfigError, ModelConfig, RopeScaling
from atlas_jax.model.rope import Rope, apply_rope, inverse_frequencies


def test_rotation_preserves_norm_and_is_relative():
  inv = inverse_frequencies(16, 10000.0, None)
  q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
  k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))

  def score(i, j):
    qi = apply_rope(q, jnp.array([[i]]), inv)
    kj = apply_rope(k, jnp.array([[j]]), inv)
    return float(jnp.sum(qi * kj))

  np.testing.assert_allclose(
    jnp.linalg.norm(apply_rope(q, jnp.array([[37]]), inv)), jnp.linalg.norm(q), rtol=1e-5
  )
  np.testing.assert_allclose(score(5, 2), score(105, 102), rtol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_gradient_is_autodiffs_of_the_rotation(dtype):
  """apply_rope's custom VJP (the rotation by the opposite angle) against autodiff of the same
  halves-rotation formula, at random positions: equal to float rounding."""
  B, T, N, H = 2, 5, 3, 8
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (B, T, N, H)).astype(dtype)
  dy = jax.random.normal(keys[1], (B, T, N, H)).astype(dtype)
  positions = jax.random.randint(keys[2], (B, T), 0, 4096)
  inv = inverse_frequencies(H, 10000.0, None)

  def autodiff_rope(x):
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv)
    cos, sin = jnp.cos(angles)[:, :, None].astype(dtype), jnp.sin(angles)[:, :, None].astype(dtype)
    x1, x2 = x[..., : H // 2], x[..., H // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

  out, pull = jax.vjp(lambda x: apply_rope(x, positions, inv), x)
  want_out, want_pull = jax.vjp(autodiff_rope, x)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
  (dx,), (want_dx,) = pull(dy), want_pull(dy)
  assert dx.dtype == dtype
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(want_dx, np.float32), atol=tol)


def trig_evaluations(hlo: str) -> int:
  """An upper bound on the cos and sin a compiled CPU program evaluates: in each computation,
  its cos and sin instructions times its result's element count (a loop fusion evaluates its
  instructions once per element it writes; a broadcast inside re-evaluates its operand)."""
  total = 0
  for computation in re.split(r"\n(?=%\S+ \(|ENTRY)", hlo):
    trig = len(re.findall(r" (?:cosine|sine)\(", computation))
    root = re.search(r"ROOT %\S+ = \(?\w+\[([0-9,]*)\]", computation)
    if trig and root:
      total += trig * math.prod(int(d) for d in root.group(1).split(",") if d)
  return total


def test_cos_and_sin_are_computed_once_per_angle_not_per_head():
  """The rotation of [B, T, N, H] (forward and backward, compiled for the CPU) evaluates the
  B * T * H/2 angles' cos and sin a bounded number of times, not once per head: XLA's CPU fusion
  puts them inside each rotation's loop, where the broadcast over the N heads re-evaluates them,
  unless the tables are written once (`rotation_tables(by_product=True)`, as a CPU model is
  built: `platforms.model_ops`)."""
  if jax.default_backend() != "cpu":
    pytest.skip("the count is of XLA's CPU fusions")
  B, T, N, H = 2, 32, 8, 16
  inv = inverse_frequencies(H, 10000.0, None)
  x = jax.random.normal(jax.random.key(0), (B, T, N, H))
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  rope = lambda x, p, by_product: apply_rope(x, p, inv, by_product=by_product)
  grad = jax.jit(jax.grad(lambda x, p: jnp.sum(rope(x, p, True) * x)))
  plain = jax.jit(jax.grad(lambda x, p: jnp.sum(rope(x, p, False) * x)))
  angles = B * T * H // 2
  # cos and sin, each at most twice per angle (the count bounds a concatenation of the two by
  # its whole size); once per head would be 2 * N per angle in the forward and again backward.
  assert trig_evaluations(grad.lower(x, positions).compile().as_text()) <= 4 * angles
  assert trig_evaluations(plain.lower(x, positions).compile().as_text()) > 4 * angles


def test_llama3_scaling_bands():
  s = RopeScaling(
    type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
  )
  base = inverse_frequencies(128, 500000.0, None)
  scaled = inverse_frequencies(128, 500000.0, s)
  wavelen = 2 * math.pi / base
  high = wavelen < 8192 / 4  # short wavelengths are kept
  low = wavelen > 8192 / 1  # long wavelengths are divided by the factor
  np.testing.assert_allclose(scaled[high], base[high])
  np.testing.assert_allclose(scaled[low], base[low] / 8.0, rtol=1e-6)
  mid = ~high & ~low
  assert mid.any() and np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / 8)


# ---------------------------------------------------------------------------------------------
# `Rope`: partial rotation, LongRoPE's short/long choice, the scalings' attention factors.

LONGROPE = RopeScaling(
  type="longrope",
  factor=4.0,
  original_max_position_embeddings=16,
  short_factor=(1.0, 1.2, 1.5, 2.0, 3.0, 4.0),
  long_factor=(1.0, 2.0, 4.0, 8.0, 12.0, 16.0),
)


def test_partial_rotation_rotates_the_leading_dims_only():
  x = jax.random.normal(jax.random.key(0), (2, 5, 3, 16))
  positions = jnp.broadcast_to(jnp.arange(5) * 7, (2, 5))
  out = Rope(16, 10000.0, None, rotary_dim=12)(x, positions)
  np.testing.assert_array_equal(out[..., 12:], x[..., 12:])
  want = Rope(12, 10000.0)(x[..., :12], positions)
  np.testing.assert_allclose(out[..., :12], want, rtol=1e-6, atol=1e-6)
  # rotate-half within the 12 rotated dims: dims i and i + 6 form a pair.
  inv = inverse_frequencies(12, 10000.0, None)
  np.testing.assert_allclose(want, apply_rope(x[..., :12], positions, inv), atol=1e-6)


def test_longrope_chooses_its_factors_per_call_in_one_program():
  """Short factors while max(position) + 1 <= original (16), long ones past it, padding (-1)
  ignored; one compiled program serves both; cos and sin carry sqrt(1 + ln 4 / ln 16)."""
  rope = Rope(12, 10000.0, LONGROPE)
  x = jax.random.normal(jax.random.key(1), (1, 4, 2, 12))
  short = 1.0 / (
    np.array(LONGROPE.short_factor, np.float32) * 10000.0 ** (np.arange(0, 12, 2) / 12)
  )
  long = short * np.array(LONGROPE.short_factor) / np.array(LONGROPE.long_factor)
  factor = math.sqrt(1 + math.log(4.0) / math.log(16))
  assert rope.attention_factor() == pytest.approx(factor)
  rotate = jax.jit(lambda x, p: rope(x, p))
  for positions, inv in (
    ([[12, 13, 14, 15]], short),
    ([[13, 14, 15, 16]], long),
    ([[14, 15, -1, -1]], short),
  ):
    p = jnp.asarray(positions)
    want = apply_rope(x, p, inv.astype(np.float32)) * factor
    np.testing.assert_allclose(rotate(x, p), want, rtol=1e-5, atol=1e-5)
  assert rotate._cache_size() == 1


def test_yarn_scales_cos_and_sin_by_its_attention_factor():
  s = RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=32, mscale=0.0)
  x = jax.random.normal(jax.random.key(2), (1, 3, 2, 16))
  out = Rope(16, 10000.0, s)(x, jnp.array([[0, 40, 100]]))
  norms = jnp.linalg.norm(out, axis=-1) / jnp.linalg.norm(x, axis=-1)
  np.testing.assert_allclose(norms, 0.1 * math.log(4.0) + 1, rtol=1e-5)


def test_rope_frequencies_match_transformers():
  """LongRoPE's two sets and attention factor, YaRN's frequencies on a partial head, as
  transformers' `ROPE_INIT_FUNCTIONS` compute them."""
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("torch")
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  hf = transformers.Phi3Config(
    hidden_size=64,
    num_attention_heads=4,
    max_position_embeddings=64,
    original_max_position_embeddings=16,
    partial_rotary_factor=0.75,
    rope_scaling={
      "rope_type": "longrope",
      "short_factor": list(LONGROPE.short_factor),
      "long_factor": list(LONGROPE.long_factor),
    },
  )
  rope = Rope(16, 10000.0, LONGROPE, rotary_dim=12)
  for seq_len, row in ((None, 0), (17, 1)):
    inv, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, seq_len=seq_len)
    np.testing.assert_allclose(rope.frequencies()[row], inv.numpy(), rtol=1e-6)
    assert rope.attention_factor() == pytest.approx(factor, rel=1e-7)
  yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
  hf = transformers.Qwen3Config(
    head_dim=32, max_position_embeddings=64, rope_scaling=yarn, partial_rotary_factor=0.5
  )
  inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
  s = RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=0.0)
  rope = Rope(32, hf.rope_parameters["rope_theta"], s, rotary_dim=16)
  np.testing.assert_allclose(rope.frequencies()[0], inv.numpy(), rtol=1e-6)
  assert rope.attention_factor() == pytest.approx(factor, rel=1e-7)


def test_rope_config_errors_name_the_field():
  with pytest.raises(ConfigError, match=r"model\.rope_scaling\.long_factor=\[\] .* longrope"):
    RopeScaling(type="longrope", short_factor=(1.0,))
  with pytest.raises(ConfigError, match=r"short_factor=.* one entry per rotated dimension pair: 8"):
    ModelConfig(d_model=64, n_heads=4, rope_scaling=LONGROPE)
  with pytest.raises(ConfigError, match=r"model\.partial_rotary_factor=1\.5 .* \(0, 1\]"):
    ModelConfig(partial_rotary_factor=1.5)
  with pytest.raises(ConfigError, match=r"int\(head_dim=16 \* 0\.6\) = 9"):
    ModelConfig(d_model=64, n_heads=4, partial_rotary_factor=0.6)
  assert ModelConfig(d_model=64, n_heads=4, partial_rotary_factor=0.75, rope_scaling=LONGROPE)
