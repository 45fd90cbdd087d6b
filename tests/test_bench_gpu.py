"""The one-shot GPU benchmark's smoke run: every section's code path on CPU, at toy sizes."""

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
  )
  out = result.stdout + result.stderr
  assert result.returncode == 0, out[-4000:]
  for table in ("## engine vs generate", "## batch-1 decode", "## transformers generate"):
    assert table in out, out[-4000:]
  assert "FAILED" not in out and "failed:" not in out
