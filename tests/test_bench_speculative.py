"""The speculative-decoding benchmark's smoke run: toy models trained by train.py for two steps,
then every table, on CPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_speculative_benchmark_smoke_trains_and_prints_every_table():
  result = subprocess.run(
    [sys.executable, str(ROOT / "bench" / "speculative.py"), "--smoke"],
    capture_output=True,
    text=True,
    timeout=600,
    env={**os.environ, "PYTHONPATH": str(ROOT)},  # this checkout's package, not an installed one
  )
  out = result.stdout + result.stderr
  assert result.returncode == 0, out[-4000:]
  assert out.count("# training: ") == 3, out[-4000:]
  for table in ("## batch 2, greedy", "## batch 2, sampled"):
    assert table in out, out[-4000:]
  # Each speculative row: the draft model, MTP and n-gram lookup at k = 1 and 2, in both tables.
  drafts = ("| draft model |", "| mtp |", "| ngram |")
  rows = [line for line in out.splitlines() if line.startswith(drafts)]
  assert len(rows) == 12, out[-4000:]
  assert sum(line.startswith("| ngram |") for line in rows) == 4, out[-4000:]
  for row in rows:
    accept, passes = (float(x) for x in row.split("|")[3:5])
    k = int(row.split("|")[2])
    # Each pass emits between 1 and k + 1 tokens of a row.
    assert 1.0 <= accept <= k + 1 and 1 / (k + 1) - 0.01 <= passes <= 1.0, row
