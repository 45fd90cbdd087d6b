"""Rotary position embeddings (RoPE), with linear, Llama-3, YaRN and LongRoPE frequency scaling and
partial rotation.

We use the "rotate half" layout (the first and second halves of the rotated dims form the pairs),
the convention of Hugging Face's Llama, Mistral, Qwen and Phi weights, so imported weights need no
permutation. An attention holds a `Rope`, a static description of its rotation (head dim, base,
scaling, rotated dims), and calls it on its queries and keys.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from atlas_jax.config import ModelConfig, RopeScaling

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Rope:
  """How one attention rotates its queries and keys by position. Static (hashed into a program).

  Only the first `rotary_dim` dims of each head rotate (partial RoPE: Phi-4-mini rotates 3/4 of
  them, GLM-4.5 half), rotate-half within them; the rest pass unchanged. cos and sin are scaled by
  the scaling's attention factor (YaRN, LongRoPE), so q.k grows by its square on the rotated dims.
  LongRoPE has two frequency sets. With `longrope_frequencies="dynamic"`: the short one while
  every position of the call is inside the original context, the long one once any is past it
  (Hugging Face's rule, per forward call); the choice is a traced select, so one compiled program
  serves both. A KV cache keeps each key as the call that wrote it rotated it, so a sequence whose
  calls fall on both sides (a chunked prefill, or a decode, crossing the original context) holds
  keys of both sets: transformers' Phi-3 generate recomputes its cache at the crossing. "short"
  or "long" fixes the set, as the serving engine does from its max_model_len (vLLM's rule).
  """

  head_dim: int  # H
  theta: float  # the base of the wavelengths
  scaling: RopeScaling | None = None
  rotary_dim: int | None = None  # the leading dims of each head that rotate; None: all H

  @classmethod
  def of(cls, cfg: ModelConfig) -> Rope:
    """The rope of a GQA model's attention."""
    return cls(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim)

  @property
  def dim(self) -> int:  # R: the rotated dims
    return self.head_dim if self.rotary_dim is None else self.rotary_dim

  def frequencies(self) -> np.ndarray:
    """f32[1, R/2] the rotation speed of each dimension pair; LongRoPE: f32[2, R/2], the short
    set then the long one."""
    if self.scaling is not None and self.scaling.type == "longrope":
      return np.stack(
        [
          longrope_inverse_frequencies(self.dim, self.theta, self.scaling, f)
          for f in (self.scaling.short_factor, self.scaling.long_factor)
        ]
      )
    return inverse_frequencies(self.dim, self.theta, self.scaling)[None]

  def attention_factor(self) -> float:
    """What cos and sin are multiplied by (1 for plain, linear and Llama-3 RoPE)."""
    s = self.scaling
    if s is None or s.type in ("linear", "llama3"):
      return 1.0
    if s.type == "yarn":
      return yarn_attention_factor(s)
    return longrope_attention_factor(s)

  def tables(self, positions_BT: Array, *, by_product: bool = False) -> tuple[Array, Array]:
    """(f32[B, T, R/2] cos, sin) at `positions_BT` (i32[B, T]; negative: padding)."""
    sets = self.frequencies()
    inv_freq = jnp.asarray(sets[0])
    if len(sets) == 2 and self.scaling.longrope_frequencies == "long":
      inv_freq = jnp.asarray(sets[1])
    elif len(sets) == 2 and self.scaling.longrope_frequencies == "dynamic":
      # The largest position of the call decides, as Hugging Face's `longrope_frequency_update`
      # does from max(position_ids) + 1; padding (-1) never wins the max over a real position.
      long = jnp.max(positions_BT) + 1 > self.scaling.original_max_position_embeddings
      inv_freq = jnp.where(long, jnp.asarray(sets[1]), inv_freq)
    cos_BTh, sin_BTh = rotation_tables(positions_BT, inv_freq, by_product=by_product)
    factor = self.attention_factor()
    if factor != 1.0:
      cos_BTh, sin_BTh = cos_BTh * np.float32(factor), sin_BTh * np.float32(factor)
    return cos_BTh, sin_BTh

  def __call__(self, x_BTNH: Array, positions_BT: Array, *, by_product: bool = False) -> Array:
    """x [B, T, N, H] with its first R dims rotated by position (`by_product`: see
    `rotation_tables`)."""
    if x_BTNH.shape[-1] != self.head_dim:
      raise ValueError(f"Rope: x has head dim {x_BTNH.shape[-1]}, this rope {self.head_dim}")
    cos_BTh, sin_BTh = self.tables(positions_BT, by_product=by_product)
    cos_BT1h = cos_BTh[:, :, None, :].astype(x_BTNH.dtype)
    sin_BT1h = sin_BTh[:, :, None, :].astype(x_BTNH.dtype)
    R = self.dim
    if R == self.head_dim:
      return _rotate(x_BTNH, cos_BT1h, sin_BT1h)
    rotated_BTNR = _rotate(x_BTNH[..., :R], cos_BT1h, sin_BT1h)
    return jnp.concatenate([rotated_BTNR, x_BTNH[..., R:]], axis=-1)


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
  """f32[H/2]: the rotation speed of each dimension pair (LongRoPE: the short set)."""
  if scaling is not None and scaling.type == "yarn":
    return yarn_inverse_frequencies(head_dim, theta, scaling)
  if scaling is not None and scaling.type == "longrope":
    return longrope_inverse_frequencies(head_dim, theta, scaling, scaling.short_factor)
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
  positions_BT: Array, inv_freq: np.ndarray | Array, *, by_product: bool = False
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
# YaRN (DeepSeek-V2/V3, Qwen3's long-context configs, gpt-oss).


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


# ---------------------------------------------------------------------------------------------
# LongRoPE (Phi-3, Phi-4): a rescale factor per dimension pair, one set for contexts inside the
# original one and one for longer contexts.


def longrope_inverse_frequencies(
  dim: int, theta: float, scaling: RopeScaling, factors: tuple[float, ...]
) -> np.ndarray:
  """f32[R/2]: 1 / (factors[i] * theta^(2i / R)), in float32 as Hugging Face computes it."""
  if len(factors) != dim // 2:
    raise ValueError(f"LongRoPE: {len(factors)} factors for {dim // 2} dimension pairs")
  exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
  ext = np.asarray(factors, np.float32)
  return (np.float32(1.0) / (ext * np.float32(theta) ** exponents)).astype(np.float32)


def longrope_attention_factor(scaling: RopeScaling) -> float:
  """sqrt(1 + ln(factor) / ln(original context)), 1 when factor <= 1 (or the config's own)."""
  if scaling.attention_factor is not None:
    return float(scaling.attention_factor)
  if scaling.factor <= 1.0:
    return 1.0
  return math.sqrt(
    1 + math.log(scaling.factor) / math.log(scaling.original_max_position_embeddings)
  )
