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


def apply_rope(
  x_BTNH: Array, positions_BT: Array, inv_freq: np.ndarray, *, by_product: bool = False
) -> Array:
  """Rotates each (i, i + H/2) pair of `x` by position * inv_freq[i] (`by_product`: the tables
  written once first, `rotation_tables`)."""
  cos_BTh, sin_BTh = rotation_tables(positions_BT, inv_freq, by_product=by_product)
  cos_BT1h = cos_BTh[:, :, None, :].astype(x_BTNH.dtype)
  sin_BT1h = sin_BTh[:, :, None, :].astype(x_BTNH.dtype)
  return _rotate(x_BTNH, cos_BT1h, sin_BT1h)


def rotation_tables(
  positions_BT: Array, inv_freq: np.ndarray, *, by_product: bool = False
) -> tuple[Array, Array]:
  """(f32[B, T, H/2] cos, sin) of the angles position * inv_freq.

  Angles and their cos/sin are float32: bf16 positions lose integer precision past 256. With
  `by_product` (`layers.Ops.rope_tables_by_product`) the tables go through a product with the
  identity (exact: one term per output is nonzero), which a compiler runs as a GEMM of its own
  whose result its consumers read, so they are written once: a fusing compiler would otherwise
  evaluate cos and sin inside each rotation, once per head of its broadcast (an
  `optimization_barrier` does not stop that fusion). The scope tells profiles
  (`bench/step_profile.py`) that the product is RoPE's, not a model matmul.
  """
  angles_BTh = positions_BT.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]
  cos_BTh, sin_BTh = jnp.cos(angles_BTh), jnp.sin(angles_BTh)
  if not by_product:
    return cos_BTh, sin_BTh
  h = angles_BTh.shape[-1]
  with jax.named_scope("rope_tables"):
    both = jnp.concatenate([cos_BTh, sin_BTh], axis=-1)
    both = jnp.dot(both, jnp.eye(2 * h, dtype=jnp.float32), precision=jax.lax.Precision.HIGHEST)
  return both[..., :h], both[..., h:]


def _rotate_halves(x_BTNH: Array, cos_BT1h: Array, sin_BT1h: Array) -> Array:
  half = x_BTNH.shape[-1] // 2
  x1, x2 = x_BTNH[..., :half], x_BTNH[..., half:]
  return jnp.concatenate([x1 * cos_BT1h - x2 * sin_BT1h, x2 * cos_BT1h + x1 * sin_BT1h], axis=-1)


# The gradient of a rotation is the rotation by the opposite angle. Written out, it is one pass
# like the forward; left to autodiff, each half's slice transposes to a pad of the whole head dim
# and the pads are summed: a fusion reading four full-size inputs to write one. The same products
# are summed, so the gradient is equal.
@jax.custom_vjp
def _rotate(x_BTNH: Array, cos_BT1h: Array, sin_BT1h: Array) -> Array:
  return _rotate_halves(x_BTNH, cos_BT1h, sin_BT1h)


def _rotate_fwd(x_BTNH, cos_BT1h, sin_BT1h):
  return _rotate_halves(x_BTNH, cos_BT1h, sin_BT1h), (cos_BT1h, sin_BT1h)


def _rotate_bwd(residuals, dy_BTNH):
  cos_BT1h, sin_BT1h = residuals
  # cos and sin come from positions, never from anything trained: no gradient for them.
  return _rotate_halves(dy_BTNH, cos_BT1h, -sin_BT1h), None, None


_rotate.defvjp(_rotate_fwd, _rotate_bwd)


# ---------------------------------------------------------------------------------------------
# YaRN (DeepSeek-V2/V3 long-context scaling), used by MLA.


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's attention temperature correction 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: RopeScaling) -> float:
  """The factor cos/sin are multiplied by (so q_rope . k_rope grows by its square)."""
  if scaling.attention_factor is not None:
    return float(scaling.attention_factor)
  if scaling.mscale and scaling.mscale_all_dim:
    return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(
      scaling.factor, scaling.mscale_all_dim
    )
  return yarn_mscale(scaling.factor)


def yarn_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
  """f32[H/2]: YaRN frequencies: extrapolate fast dims, interpolate slow ones by `factor`.

  Dimension pairs that turn more than `beta_fast` times over the original context keep their
  frequency, those turning fewer than `beta_slow` times are divided by `factor`, with a linear
  ramp between (computed in float32 like Hugging Face's `_compute_yarn_parameters`).
  """
  dim, base, old_len = head_dim, float(theta), scaling.original_max_position_embeddings

  def correction_dim(rotations: float) -> float:
    return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

  low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
  if scaling.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # avoid a zero-width ramp
  pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
  extrapolation = (1.0 / pos_freqs).astype(np.float32)
  interpolation = (1.0 / (np.float32(scaling.factor) * pos_freqs)).astype(np.float32)
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (keep the frequency)
  return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)
