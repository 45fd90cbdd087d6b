"""Rotary position embeddings (RoPE), with Llama-3 and linear frequency scaling.

We use the "rotate half" layout (the first and second halves of the head dim form the pairs), the
convention of Hugging Face's Llama, Mistral and Qwen weights, so imported weights need no
permutation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from atlas_jax.config import RopeScaling

Array = jax.Array


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
  """f32[H/2]: the rotation speed of each dimension pair."""
  exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
  inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
  if scaling is None:
    return inv_freq
  if scaling.type == "linear":
    return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
  # Llama 3.1: keep high frequencies (short wavelengths), divide low frequencies by `factor`, and
  # interpolate smoothly between the two bands.
  old_len = scaling.original_max_position_embeddings
  low_wavelen = old_len / scaling.low_freq_factor
  high_wavelen = old_len / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth = (old_len / wavelen - scaling.low_freq_factor) / (
    scaling.high_freq_factor - scaling.low_freq_factor
  )
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_BTNH: Array, positions_BT: Array, inv_freq: np.ndarray) -> Array:
  """Rotates each (i, i + H/2) pair of `x` by position * inv_freq[i]."""
  half = x_BTNH.shape[-1] // 2
  angles_BTh = positions_BT.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]
  # Angles and their cos/sin in float32: bf16 positions lose integer precision past 256.
  cos_BT1h = jnp.cos(angles_BTh)[:, :, None, :].astype(x_BTNH.dtype)
  sin_BT1h = jnp.sin(angles_BTh)[:, :, None, :].astype(x_BTNH.dtype)
  x1, x2 = x_BTNH[..., :half], x_BTNH[..., half:]
  return jnp.concatenate([x1 * cos_BT1h - x2 * sin_BT1h, x2 * cos_BT1h + x1 * sin_BT1h], axis=-1)
