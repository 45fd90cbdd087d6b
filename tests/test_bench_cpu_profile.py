"""bench/cpu_profile.py's bookkeeping: PyTorch ops to op classes, busy time to wall time."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import cpu_profile  # noqa: E402


@pytest.mark.parametrize(
  "name,cls",
  [
    ("aten::mm", "matmul"),
    ("aten::addmm", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::_fused_adamw_", "optimizer"),
    ("aten::_log_softmax_backward_data", "loss"),
    ("aten::silu_backward", "elementwise"),
    ("aten::mul", "elementwise"),
    ("aten::cat", "data movement"),
    ("aten::embedding_dense_backward", "data movement"),
    ("aten::argmax", "sampling"),
    ("aten::linalg_vector_norm", "reduction"),
    ("autograd::engine::evaluate_function: MmBackward0", "other"),
  ],
)
def test_torch_ops_go_to_their_class(name, cls):
  assert cpu_profile.torch_class(name) == cls


def test_control_flow_thunks_are_not_counted_twice():
  for op in ("while", "while.77", "conditional.3", "call.1"):
    assert cpu_profile._CONTROL_FLOW.match(op)
  for op in ("ynn_fusion.3", "dynamic-slice_bitcast_fusion", "while_body_fusion"):
    assert not cpu_profile._CONTROL_FLOW.match(op)


def test_table_scales_each_class_by_its_share_of_busy_time():
  """Busy time on two threads overlaps: a class's wall ms is its share of the busy time times
  the measured step."""
  ours = {"matmul": 3.0, "attention": 1.0}  # busy seconds over the traced steps
  theirs = {"matmul": 1.0, "attention": 1.0}
  text = cpu_profile.table(ours, 0.040, theirs, 0.020, "decode")
  rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
  assert rows["matmul"] == "| matmul | 30.00 | 10.00 | 3.00 |"
  assert rows["attention"] == "| attention | 10.00 | 10.00 | 1.00 |"
  assert rows["step (wall)"] == "| step (wall) | 40.00 | 20.00 | 2.00 |"
  assert "elementwise" not in rows  # neither side spent anything there
