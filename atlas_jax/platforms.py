"""What a backend needs its programs to spell out, decided in one place, once per model.

The model computes the same numbers on every backend; a few of its computations have a plain form
that one compiler runs badly and a spelled-out form that runs well everywhere else too but costs
a little. `model.layers.Ops` names them and `model_ops` picks them per backend when a model is
built (`Transformer(ops=None)`).
"""

from __future__ import annotations


def model_ops(platform: str) -> dict[str, bool]:
  """The `atlas_jax.model.layers.Ops` fields of a model built for `platform`.

  XLA's CPU backend runs a dot that contracts an operand's major axis (the plain form of a
  weight's gradient, x^T dy) with its own loops rather than its GEMM, and fuses RoPE's cos and
  sin into every rotation, evaluating them once per head of the broadcast: both are spelled out
  there. Other backends' GEMMs read transposed operands natively and their fusions keep the
  tables once, so the plain forms stand.
  """
  if platform == "cpu":
    return dict(copied_weight_grads=True, rope_tables_by_product=True)
  return {}


def has_fp8_matmuls(platform: str) -> bool:
  """Whether `platform`'s matmuls take FP8 operands natively (GPUs' tensor cores from Hopper/Ada
  on, TPUs from v5p/v6 on: jax lowers an e4m3 dot_general for both). Decided by the platform
  name, as the compiled program is: where the chip lacks them, XLA converts the operands."""
  return platform in ("cuda", "rocm", "gpu", "tpu")
