"""RoPE: rotations keep norms, scores depend only on relative position, Llama-3 scaling bands."""

import math

import jax
import jax.numpy as jnp
import numpy as np

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
