"""FP8 matmuls for training (train.fp8): a projection's product and both of its gradients'
multiply 8-bit float operands, the work FP8 tensor cores (H100, H200, B200) run at twice bf16's
rate.

Forward, x and W are quantized to e4m3 (3 mantissa bits, range +-448), x with a scale per row and
W per output column; backward, the incoming gradient dy is quantized to e5m2 (2 mantissa bits,
range +-57344: gradients span more decades than activations) for both dx = dy W^T and
dW = x^T dy. Each scale is the operand's current absmax over what it scales, computed in the step
itself ("current" scaling, as Transformer Engine's and qwix's default), so no amax history is
carried between steps. The dots take the 8-bit operands and float32 accumulation; the per-row
and per-column scales multiply their outputs, which XLA fuses into the GEMM's epilogue.

qwix's quantized-training `dot_general` (what its `QtProvider`, MaxText's `quantization: fp8`,
installs by intercepting a module's calls) does the numerics and the custom gradient; it is
called here directly because the blocks' projections are one function (`layers.dense`), which
interception inside the layer scan would not see (see `atlas_jax.quant`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from qwix._src.core import dot_general_qt

Array = jax.Array

# train.fp8 -> the qwix configuration of a projection's dot.
CONFIGS = {
  "current": dot_general_qt.DotGeneralQtConfig(
    lhs_qtype=jnp.float8_e4m3fn,
    rhs_qtype=jnp.float8_e4m3fn,
    dlhs_grad_qtype=jnp.float8_e5m2,
    drhs_grad_qtype=jnp.float8_e5m2,
  ),
}


def fp8_dense(x: Array, w: Array, contract: int, scaling: str) -> Array:
  """x's last `contract` axes against w's first, as one 2-D FP8 matmul (see the module doc),
  in x's dtype."""
  if scaling not in CONFIGS:
    raise ValueError(f"train.fp8={scaling!r} is not one of {tuple(CONFIGS)}")
  C = math.prod(w.shape[:contract])
  x_MC, w_CO = x.reshape(-1, C), w.reshape(C, -1)
  dims = (((1,), (0,)), ((), ()))
  y_MO = dot_general_qt.dot_general_qt(x_MC, w_CO, dims, CONFIGS[scaling])
  return y_MO.astype(x.dtype).reshape(*x.shape[: x.ndim - contract], *w.shape[contract:])
