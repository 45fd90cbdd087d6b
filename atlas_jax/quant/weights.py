"""Quantizing a model's projections in place, and the product that dequantizes them."""

from __future__ import annotations

import functools
import math

import flax
import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

Array = jax.Array
QArray = qwix.QArray


@flax.struct.dataclass
class StaticQArray(QArray):
  """A QArray with a static activation scale (FP8 checkpoints' `input_scale`,
  activation_scheme "static"): one float32 per weight, [1] * ndim (stacked: [L, 1, ...]), by
  which `w8a8_product` quantizes the activations in place of each token's own amax."""

  input_scale: jax.Array | None = None


FORMATS = ("int8", "int4", "fp8")
_QTYPES = {"int8": jnp.int8, "int4": jnp.int4, "fp8": jnp.float8_e4m3fn}

# The projections quantized, by attribute name: attention's (GQA and MLA), the SwiGLU MLP's (the
# dense layers', the shared expert's and the routed experts' [E, ...] stacks).
PROJECTIONS = frozenset(
  ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wk_b", "wv_b", "w_gate", "w_up", "w_down")
)
# Leading axes that stack independent weights: each slice gets its own scales.
STACK_AXES = ("layers", "mtp_heads", "experts")


def contracted_axes(axes: tuple[str, ...]) -> tuple[int, ...]:
  """The dimensions of a projection (by its logical axes) that its matmul contracts: after the
  stacking axes, the first one, or W_O's two ([N, H, D] contracts heads and head_dim)."""
  first = next((i for i, a in enumerate(axes) if a not in STACK_AXES), len(axes))
  n = 2 if tuple(axes[first : first + 2]) == ("q_heads", "head_dim") else 1
  return tuple(range(first, first + n))


def _groups(
  shape, contracted: tuple[int, ...], group_size: int, name: str, field: str
) -> dict[int, int]:
  """qwix `tiled_axes` that cut the flattened contracted dims into runs of `group_size`."""
  n_in = math.prod(shape[a] for a in contracted)
  if group_size <= 0 or n_in % group_size:
    raise ValueError(
      f"{field}_group_size={group_size} must divide {name}'s input dim {n_in} "
      f"(shape {tuple(shape)}); pick a divisor of it"
    )
  tiles, g = {}, group_size
  for a in reversed(contracted):
    if g == 1:
      tiles[a] = 1  # groups already cut within a later axis: a scale per index here
    elif g % shape[a] == 0:
      tiles[a], g = 1.0, g // shape[a]  # the whole axis inside one group
    elif shape[a] % g == 0:
      tiles[a], g = g, 1
    else:
      raise ValueError(
        f"{field}_group_size={group_size}: groups of {name}'s input dims "
        f"{[shape[i] for i in contracted]} would straddle axis {a}; pick a divisor of {shape[a]}"
      )
  return tiles


def quantize_weight(
  w: Array,
  axes: tuple[str, ...],
  fmt: str,
  *,
  group_size: int = 128,
  name: str = "weight",
  field: str = "serve.quantization",
) -> QArray:
  """w as a symmetric QArray: scales per output channel (and per stacked slice), and for int4
  per `group_size` run of contracted inputs too. Scales are float32. `field`: the setting that
  asked for it, which errors name (serve.py's, or train.base_quantization)."""
  if fmt not in FORMATS:
    raise ValueError(f"{field}={fmt!r} is not one of {FORMATS}")
  contracted = contracted_axes(axes)
  channels = tuple(i for i in range(w.ndim) if i not in contracted)
  tiles = _groups(w.shape, contracted, group_size, name, field) if fmt == "int4" else {}
  return qwix.quantize(
    w.astype(jnp.float32), _QTYPES[fmt], channelwise_axes=channels, tiled_axes=tiles
  )


def is_quantized(w) -> bool:
  return isinstance(w, QArray)


def dequantized(w):
  """A float array: w itself, or a QArray's values times its scales (in the scales' dtype)."""
  return qwix.dequantize(w) if isinstance(w, QArray) else w


def quantized_product(x: Array, w: QArray, contract: int, *, w8a8: bool = False) -> Array:
  """x's last `contract` axes against quantized w's first, in x's dtype. Per-channel scales
  multiply the product (x @ values) * scale; group-wise ones dequantize w first (XLA fuses the
  scaling into the dot's operand where it can).

  Differentiable in x alone (a quantized weight is frozen: QLoRA trains adapters beside it). The
  backward pass multiplies by w dequantized afresh, so the forward pass saves nothing per weight:
  left to autodiff it would keep each layer's dequantized float copy as a residual, as much
  memory as the float weights the quantization was for.

  With `w8a8` and e4m3 codes whose scales tile the contracted axes in contiguous runs, the
  product is `w8a8_product`'s (FP8 activations and weights); its backward pass is the
  weight-only product's transpose."""
  return _quantized_product(x, w, contract, w8a8 and _w8a8_blocks(w, contract) is not None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _quantized_product(x: Array, w: QArray, contract: int, w8a8: bool) -> Array:
  return w8a8_product(x, w, contract) if w8a8 else _product(x, w, contract)


def _product_fwd(x, w, contract, w8a8):
  return _quantized_product(x, w, contract, w8a8), w  # the residual: the weight, already held


def _product_bwd(contract, w8a8, w, dy):
  # The product is linear in x: dx is its transpose applied to dy (x's shape from dy's and w's).
  n_out = w.ndim - contract
  x_like = jax.ShapeDtypeStruct((*dy.shape[: dy.ndim - n_out], *w.shape[:contract]), dy.dtype)
  (dx,) = jax.linear_transpose(lambda x: _product(x, w, contract), x_like)(dy)
  # No gradient for the weight: zeros (float0 for its integer values), which nothing reads.
  zero = lambda a: (
    jnp.zeros_like(a)
    if jnp.issubdtype(a.dtype, jnp.inexact)
    else np.zeros(a.shape, jax.dtypes.float0)
  )
  return dx, jax.tree.map(zero, w)


_quantized_product.defvjp(_product_fwd, _product_bwd)


def _product(x: Array, w: QArray, contract: int) -> Array:
  dtype = x.dtype
  out_shape = w.shape[contract:]
  C = math.prod(w.shape[:contract])
  x_MC = x.reshape(-1, C)
  if all(s == 1 for s in w.scale.shape[:contract]):
    y_MO = x_MC @ w.qvalue.astype(dtype).reshape(C, -1)
    y_MO = y_MO * _output_scales(w, contract, 1).astype(dtype)
  else:
    y_MO = x_MC @ qwix.dequantize(w).astype(dtype).reshape(C, -1)
  return y_MO.reshape(*x.shape[: x.ndim - contract], *out_shape)


E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448


def _w8a8_blocks(w: QArray, contract: int) -> int | None:
  """How many contiguous runs of the flattened contracted axes share one scale (1: a scale per
  output channel; DeepSeek's 128 x 128 blocks: in / 128), or None when w cannot run W8A8:
  codes not e4m3, or scales tiling a contracted axis that is not the last one cut (the runs
  would not be contiguous in the flattened axes)."""
  if w.qvalue.dtype != jnp.float8_e4m3fn or w.zero_point is not None:
    return None
  s_shape, v_shape = w.scale.shape[:contract], w.qvalue.shape[:contract]
  for a in range(contract - 1):  # every axis before the last cut one is per index or whole
    later_cut = any(s > 1 for s in s_shape[a + 1 :])
    if later_cut and s_shape[a] not in (v_shape[a],):
      return None
  return math.prod(s_shape)


def _output_scales(w: QArray, contract: int, nb: int) -> Array:
  """[nb, O]: the scales per run of the contracted axes and per output channel, the output axes'
  tiles (a scale shared by several channels, as FP8 checkpoints' blocks are) repeated out."""
  s = w.scale.reshape(nb, *w.scale.shape[contract:])
  for a, n in enumerate(w.shape[contract:]):
    if s.shape[1 + a] != n:
      s = jnp.repeat(s, n // s.shape[1 + a], axis=1 + a)
  return s.reshape(nb, -1)


def _e4m3_rows(x_MC: Array, w: QArray) -> tuple[Array, Array]:
  """(x's rows as e4m3 codes, f32[M, 1] their scales): each row by its own amax / 448, or, for a
  `StaticQArray`, every row by its static input scale (values past e4m3's range clipped)."""
  x_MC = x_MC.astype(jnp.float32)
  static = getattr(w, "input_scale", None)
  if static is not None:  # the checkpoint's scale: values past e4m3's range clipped to it
    xs_M1 = static.astype(jnp.float32).reshape(1, 1)
    return jnp.clip(x_MC / xs_M1, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn), xs_M1
  amax_M1 = jnp.max(jnp.abs(x_MC), axis=-1, keepdims=True)
  xs_M1 = jnp.where(amax_M1 > 0, amax_M1 / E4M3_MAX, 1.0)
  return (x_MC / xs_M1).astype(jnp.float8_e4m3fn), xs_M1


def w8a8_experts(w) -> bool:
  """Whether an expert stack w [E, C, O] can run `w8a8_grouped_product`: e4m3 codes, no zero
  point, and scales [E, nb, o] that cut C into nb contiguous runs and O into o."""
  if not isinstance(w, QArray) or w.qvalue.dtype != jnp.float8_e4m3fn or w.ndim != 3:
    return False
  if w.zero_point is not None or w.scale.ndim != 3:
    return False
  E, C, O = w.shape
  e, nb, o = w.scale.shape
  return e == E and C % nb == 0 and O % o == 0


def w8a8_grouped_product(x_aC: Array, w: QArray, sizes_E: Array, ids_a: Array) -> Array:
  """Rows grouped by expert against an e4m3 expert stack, as FP8 ragged matmuls (W8A8).

  x_aC: [a, C] rows sorted by expert, `sizes_E[e]` of expert e's in order (rows past the groups
  come out as zeros); ids_a: i32[a] each row's expert (E or more past the groups); w [E, C, O]
  with scales [E, nb, o] (`w8a8_experts`). Each row is quantized to e4m3 as `w8a8_product`'s
  are; for each of the nb runs of C that share a weight scale, one `jax.lax.ragged_dot` of the
  codes accumulates in float32 and is multiplied by the scales of each row's expert, the runs
  summed; then each row by its activation scale. In x's dtype."""
  if not w8a8_experts(w):
    raise ValueError(
      f"w8a8_grouped_product: expert stack {w.shape} with codes "
      f"{getattr(w.qvalue, 'dtype', None)} and scales {getattr(w.scale, 'shape', None)} "
      "cannot run W8A8 (e4m3 codes [E, C, O], scales [E, nb, o] dividing C and O)"
    )
  E, C, O = w.shape
  nb, o = w.scale.shape[1:]
  k = C // nb
  xq_aC, xs_a1 = _e4m3_rows(x_aC, w)
  scale_EbO = w.scale.astype(jnp.float32)

  def run(b, y_aO):
    part_aO = jax.lax.ragged_dot(
      jax.lax.dynamic_slice_in_dim(xq_aC, b * k, k, axis=1),
      jax.lax.dynamic_slice_in_dim(w.qvalue, b * k, k, axis=1),
      sizes_E,
      preferred_element_type=jnp.float32,
    )
    s_Eo = jax.lax.dynamic_index_in_dim(scale_EbO, b, axis=1, keepdims=False)
    s_ao = jnp.take(s_Eo, ids_a, axis=0, mode="fill", fill_value=0.0)
    return y_aO + part_aO * jnp.repeat(s_ao, O // o, axis=1)

  y_aO = jax.lax.fori_loop(0, nb, run, jnp.zeros((x_aC.shape[0], O), jnp.float32))
  return (y_aO * xs_a1).astype(x_aC.dtype)


def w8a8_product(x: Array, w: QArray, contract: int) -> Array:
  """x's last `contract` axes against e4m3 w's first as an FP8 matmul: each row (token) of x is
  quantized to e4m3 with its own scale, amax / 448 (dynamic activation scaling), or, for a
  `StaticQArray`, all rows with its static input scale (clipped to e4m3's range); the codes are
  multiplied with the weight's codes block by block of the contracted axis (one block per
  weight scale along it), accumulating in float32; each block's product is multiplied by its
  weight scales, the blocks summed, and the row scaled by its activation scale. In x's dtype.
  On a backend without FP8 matmuls XLA upcasts the codes: the same numbers, emulated."""
  dtype = x.dtype
  out_shape = w.shape[contract:]
  C = math.prod(w.shape[:contract])
  nb = _w8a8_blocks(w, contract)
  if nb is None:
    raise ValueError(
      f"w8a8_product: weight codes {w.qvalue.dtype} with scales {w.scale.shape} cannot run "
      "W8A8 (e4m3 codes, scales in contiguous runs of the contracted axes)"
    )
  xq_MC, xs_M1 = _e4m3_rows(x.reshape(-1, C), w)
  wq_bkO = w.qvalue.reshape(nb, C // nb, -1)
  y_bMO = jax.lax.dot_general(
    xq_MC.reshape(-1, nb, C // nb),
    wq_bkO,
    (((2,), (1,)), ((1,), (0,))),
    preferred_element_type=jnp.float32,
  )
  s_bO = _output_scales(w, contract, nb).astype(jnp.float32)
  y_MO = jnp.einsum("bMO,bO->MO", y_bMO, s_bO) * xs_M1
  return y_MO.astype(dtype).reshape(*x.shape[: x.ndim - contract], *out_shape)


def quantize_model(
  model: nnx.Module,
  fmt: str,
  *,
  group_size: int = 128,
  lm_head: bool = False,
  field: str = "serve.quantization",
):
  """Replaces `model`'s projections (`PROJECTIONS`; the untied LM head with `lm_head`) with
  QArrays, in place. Returns the names of the parameters quantized, as dotted paths."""
  if fmt not in FORMATS:
    raise ValueError(f"{field}={fmt!r} is not one of {FORMATS}")
  names = PROJECTIONS | ({"lm_head"} if lm_head else set())
  done = []
  for path, node in nnx.iter_graph(model):
    if not (isinstance(node, nnx.Param) and path and path[-1] in names):
      continue
    value = node.get_value()
    if isinstance(value, QArray):
      continue
    axes = node.get_metadata().get("logical_axes") or ()
    if len(axes) != value.ndim:
      raise ValueError(f"quantize_model: {'.'.join(map(str, path))} has no logical axes")
    label = ".".join(map(str, path))
    q = quantize_weight(value, axes, fmt, group_size=group_size, name=label, field=field)
    node.set_value(q)
    done.append(label)
  return done


def dequantize_model(model: nnx.Module) -> list[str]:
  """The reverse of `quantize_model`, in place: every QArray parameter replaced by its float
  value (the weights the quantized model computes with). Returns the dotted paths replaced."""
  done = []
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Param) and isinstance(node.get_value(), QArray):
      node.set_value(qwix.dequantize(node.get_value()))
      done.append(".".join(map(str, path)))
  return done
