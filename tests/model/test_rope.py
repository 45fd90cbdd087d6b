"""RoPE: rotations keep norms, scores depend only on relative position, the hand-written gradient
equals autodiff's, cos and sin computed once per angle on a CPU, Llama-3 scaling bands."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.config import RopeScaling
from atlas_jax.model.rope import apply_rope, inverse_frequencies


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
