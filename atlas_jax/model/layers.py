"""Parameters with logical axes, and the small layers: `dense`, RMSNorm and the SwiGLU MLP.

Every parameter is created by `param`, which records one logical axis name per dimension. The
sharding rules (`atlas_jax.training.sharding`) map logical names to mesh axes, so a parameter's
layout is declared where it is created and never inferred from its name. The names:

  vocab      V, the embedding and output head rows / columns
  embed      D, the residual stream
  mlp        F, the SwiGLU hidden width
  q_heads    N, query heads (also MLA's per-head key and value up-projections)
  kv_heads   K, key/value heads
  head_dim   H, Hn + R or Hv: within one head
  q_lora     Q, MLA's query bottleneck
  kv_lora    C (+ R), MLA's key/value latent
  mtp_in     2D, the concatenated input of a DeepSeek MTP module's projection
  layers     L: the stacking axis of the layer scan (split into pipeline stages)
  mtp_heads  J: the stacking axis of the multi-token-prediction heads
  lora       A, a LoRA adapter's rank (`atlas_jax.model.lora`), never split
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from atlas_jax.model.fp8 import fp8_dense
from atlas_jax.model.lora import adapter, plus
from atlas_jax.quant import is_quantized, quantized_product

Array = jax.Array


def param(value: Array, axes: tuple[str, ...], *, decay: bool = True) -> nnx.Param:
  """A parameter tagged with its logical axes (one per dimension) and whether AdamW decays it."""
  if len(axes) != value.ndim:
    raise ValueError(f"param: axes={axes} name {len(axes)} dims, value.shape={value.shape}")
  return nnx.Param(value, logical_axes=tuple(axes), weight_decay=decay)


def rms_norm(x: Array, scale: Array, eps: float) -> Array:
  """RMSNorm over the last axis, computed in float32 (the mean of squares underflows in bf16)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  # Hugging Face's Llama casts back to the input dtype before the scale; we match it exactly.
  return scale.astype(x.dtype) * x32.astype(x.dtype)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, eps: float, axis: str = "embed", param_dtype=jnp.float32):
    # Norm scales are not decayed: shrinking them toward 0 only distorts the model.
    self.scale = param(jnp.ones((dim,), param_dtype), (axis,), decay=False)  # [dim]
    self.eps = eps

  def __call__(self, x: Array) -> Array:
    return rms_norm(x, self.scale[...], self.eps)


@dataclasses.dataclass(frozen=True)
class Ops:
  """How the model spells out two computations whose plain form some compilers run badly,
  chosen once when the model is built (`Transformer(ops=)`; `atlas_jax.platforms.model_ops`
  picks per backend). Both compute the same numbers either way.

  * `copied_weight_grads`: a weight's gradient x^T dy multiplies an explicitly transposed copy of
    x, fenced by an optimization barrier so layout assignment cannot fold the copy back: left to
    autodiff, the transpose folds into a dot that contracts x's major axis, which a backend may
    run as a loop rather than its GEMM. The copy is one pass over x, small beside the GEMM.
  * `rope_tables_by_product`: RoPE's cos and sin are written once, as the product of the tables
    with the identity (exact: one nonzero term per output), where a fusing compiler would
    evaluate them inside every rotation, once per head of the broadcast.
  """

  copied_weight_grads: bool = False
  rope_tables_by_product: bool = False
  # train.fp8: the projections' matmuls in FP8 with this scaling (`atlas_jax.model.fp8`).
  fp8: str | None = None
  # Serving e4m3 weights (`atlas_jax.quant`): multiply them by activations quantized to e4m3 per
  # token (W8A8) rather than dequantizing the weights (weight-only).
  w8a8: bool = False


PLAIN = Ops()


def dense(x: Array, w: Array, contract: int = 1, ops: Ops = PLAIN) -> Array:
  """x's last `contract` axes against w's first: [..., C] x [C, ...] -> [..., ...] as one 2-D
  matmul, and its gradient as two (the weight's from a copied x^T with
  `ops.copied_weight_grads`). A quantized w (`atlas_jax.quant`, serving) is dequantized in the
  product, with no gradient."""
  if is_quantized(w):
    return quantized_product(x, w, contract, w8a8=ops.w8a8)
  if ops.fp8 is not None:
    return fp8_dense(x, w, contract, ops.fp8)
  return _dense(x, w, contract, ops)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense(x: Array, w: Array, contract: int = 1, ops: Ops = PLAIN) -> Array:
  return _dense_fwd(x, w, contract, ops)[0]


def _flat(x: Array, w: Array, contract: int) -> tuple[Array, Array]:
  C = math.prod(w.shape[:contract])
  return x.reshape(-1, C), w.reshape(C, -1)


def _dense_fwd(x, w, contract, ops):
  x_MC, w_CO = _flat(x, w, contract)
  y = (x_MC @ w_CO).reshape(*x.shape[: x.ndim - contract], *w.shape[contract:])
  return y, (x, w)


def _dense_bwd(contract, ops, residuals, dy):
  x, w = residuals
  x_MC, w_CO = _flat(x, w, contract)
  dy_MO = dy.reshape(x_MC.shape[0], w_CO.shape[1])
  x_CM = x_MC.T
  if ops.copied_weight_grads:
    x_CM = jax.lax.optimization_barrier(x_CM)
  return (dy_MO @ w_CO.T).reshape(x.shape), (x_CM @ dy_MO).reshape(w.shape)


_dense.defvjp(_dense_fwd, _dense_bwd)


def output_projection(out_BTNH: Array, wo_NHD: Array, *, serving: bool, ops: Ops = PLAIN) -> Array:
  """[B, T, N, H] x W_O [N, H, D] -> [B, T, D].

  Serving (a forward over a cache) multiplies as one [N * H, D] matmul, a 2-D product that reads
  W_O as it is held (a serving runner may hold it transposed: `serving.cpu.weights.OutMajor`)
  with no layout copy of it. Training goes through `dense`, for its weight gradient; its saved
  residuals are the einsum's (the input and W_O), which the planner counts."""
  if not serving or is_quantized(wo_NHD):
    return dense(out_BTNH, wo_NHD, 2, ops)
  B, T, N, H = out_BTNH.shape
  return out_BTNH.reshape(B, T, N * H) @ wo_NHD.reshape(N * H, -1)


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype) -> Array:
  return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class MLP(nnx.Module):
  """A gated MLP: down(act(x @ gate) * (x @ up)); SwiGLU with silu, GeGLU with gelu_tanh (the
  tanh approximation of GELU, Hugging Face's `gelu_pytorch_tanh`)."""

  def __init__(
    self,
    d_model: int,
    ffn_dim: int,
    *,
    init_std: float,
    out_std: float,
    rngs,
    param_dtype=jnp.float32,
    adapters=None,
    ops: Ops = PLAIN,
    activation: str = "silu",
  ):
    D, F = d_model, ffn_dim
    self.ops = ops  # static
    self.activation = activation  # static
    self.w_gate = param(normal(rngs, (D, F), init_std, param_dtype), ("embed", "mlp"))  # [D, F]
    self.w_up = param(normal(rngs, (D, F), init_std, param_dtype), ("embed", "mlp"))  # [D, F]
    self.w_down = param(normal(rngs, (F, D), out_std, param_dtype), ("mlp", "embed"))  # [F, D]
    # LoRA adapters (`atlas_jax.model.lora`), None where not adapted.
    self.w_gate_lora = adapter(adapters, "gate_proj", self.w_gate, 1, rngs=rngs)
    self.w_up_lora = adapter(adapters, "up_proj", self.w_up, 1, rngs=rngs)
    self.w_down_lora = adapter(adapters, "down_proj", self.w_down, 1, rngs=rngs)

  def __call__(self, x_BTD: Array) -> Array:
    dtype = x_BTD.dtype
    B, T, D = x_BTD.shape
    # Flattened to 2-D matmuls: a [B, T, F] dot_general with the SwiGLU product fused into it
    # leaves a compiler's plain GEMM path, in the backward pass above all.
    x_MD = x_BTD.reshape(B * T, D)
    ops = self.ops
    gate_MF = checkpoint_name(
      plus(dense(x_MD, self.w_gate[...].astype(dtype), 1, ops), self.w_gate_lora, x_MD), "mlp_gate"
    )
    up_MF = checkpoint_name(
      plus(dense(x_MD, self.w_up[...].astype(dtype), 1, ops), self.w_up_lora, x_MD), "mlp_up"
    )
    h_MF = ACTIVATIONS[self.activation](gate_MF) * up_MF
    out_MD = checkpoint_name(
      plus(dense(h_MF, self.w_down[...].astype(dtype), 1, ops), self.w_down_lora, h_MF), "mlp_down"
    )
    return out_MD.reshape(B, T, D)
