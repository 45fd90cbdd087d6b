"""The one-shot GPU benchmark's smoke run: every section's code path on CPU, at toy sizes."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_gpu_benchmark_smoke_runs_every_section():
  result = subprocess.run(
    [sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke"],
    capture_output=True,
    text=True,
    timeout=600,
    # The sections run with -P: the checkout's own package must come first on the path.
    env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])),
  )
  out = result.stdout + result.stderr
  assert result.returncode == 0, out[-4000:]
  tables = ("## engine vs generate", "## batch-1 decode", "## transformers generate")
  for table in (*tables, "## training: atlas_jax vs PyTorch"):
    assert table in out, out[-4000:]
  assert "FAILED" not in out and "failed:" not in out
  # Both presets, both stacks, a ratio on every row; no MFU on a CPU (its peak is unknown).
  rows = [r for r in out.splitlines() if r.startswith(("| small |", "| llama3-1b |"))]
  assert len(rows) == 4, out[-4000:]
  assert all(r.split("|")[5].strip() == "-" and r.split("|")[7].strip() != "-" for r in rows)
