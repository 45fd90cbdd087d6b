"""Small layers: RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

Array = jax.Array


def rms_norm(x: Array, scale: Array, eps: float) -> Array:
  """RMSNorm over the last axis, computed in float32 (the mean of squares underflows in bf16)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  # Hugging Face's Llama casts back to the input dtype before the scale; we match it exactly.
  return scale.astype(x.dtype) * x32.astype(x.dtype)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))  # [dim]
    self.eps = eps

  def __call__(self, x: Array) -> Array:
    return rms_norm(x, self.scale[...], self.eps)


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype) -> Array:
  return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class MLP(nnx.Module):
  """SwiGLU: down(silu(x @ gate) * (x @ up))."""

  def __init__(
    self,
    d_model: int,
    ffn_dim: int,
    *,
    init_std: float,
    out_std: float,
    rngs,
    param_dtype=jnp.float32,
  ):
    D, F = d_model, ffn_dim
    self.w_gate = nnx.Param(normal(rngs, (D, F), init_std, param_dtype))  # [D, F]
    self.w_up = nnx.Param(normal(rngs, (D, F), init_std, param_dtype))  # [D, F]
    self.w_down = nnx.Param(normal(rngs, (F, D), out_std, param_dtype))  # [F, D]

  def __call__(self, x_BTD: Array) -> Array:
    dtype = x_BTD.dtype
    B, T, D = x_BTD.shape
    # Flattened to 2-D matmuls: XLA's CPU backend fuses the SwiGLU product into a [B, T, F]
    # dot_general and falls off its fast GEMM path, making the backward pass ~3x slower.
    x_MD = x_BTD.reshape(B * T, D)
    gate_MF = checkpoint_name(x_MD @ self.w_gate[...].astype(dtype), "mlp_gate")
    up_MF = checkpoint_name(x_MD @ self.w_up[...].astype(dtype), "mlp_up")
    h_MF = jax.nn.silu(gate_MF) * up_MF
    out_MD = checkpoint_name(h_MF @ self.w_down[...].astype(dtype), "mlp_down")
    return out_MD.reshape(B, T, D)
