"""bench/pipeline.py: one row of its table, every measured figure beside the planner's."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import pipeline as bench_pipeline  # noqa: E402


def test_a_row_measures_what_the_planner_says():
  r = bench_pipeline.row(stages=2, microbatches=2, repeats=2, devices=8)
  assert r["iterations"] == r["iterations_formula"] == 5
  assert r["bubble"] == pytest.approx(r["bubble_formula"]) == pytest.approx(1 / 5)
  assert r["param_bytes"] == r["param_bytes_plan"]
  assert r["ppermute_bytes"] == r["ppermute_bytes_plan"]
  # To 0.5%, with the schedule's own indices and flags (not in the planner's figure).
  slack = 200 * r["iterations"] + 5e-3 * r["activation_bytes"]
  assert abs(r["activation_bytes"] - r["activation_bytes_plan"]) <= slack
