"""The one-shot GPU benchmark's smoke run: every section's code path on CPU, at toy sizes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def smoke(*sections: str) -> str:
  """bench/gpu.py --smoke (only `sections`, when given); its output, after checking it passed."""
  only = [arg for name in sections for arg in ("--only", name)]
  result = subprocess.run(
    [sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", *only],
    capture_output=True,
    text=True,
    timeout=600,
    # The sections run with -P: the checkout's own package must come first on the path.
    env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])),
  )
  out = result.stdout + result.stderr
  assert result.returncode == 0, out[-4000:]
  assert "FAILED" not in out and "failed:" not in out and "MISMATCH" not in out
  return out


KERNEL_TABLES = (
  "## correctness: kernels against their pure-jnp references",
  "## decode: cache bytes held / step time",
  "## attention: TFLOP/s",
  "## mgpu: the Mosaic GPU FlashAttention (experimental)",
  "## profile: one train step of llama3-1b",
)


@pytest.mark.slow
def test_gpu_benchmark_kernel_sections_smoke():
  """The kernel sections and the profile; the serving and training ones, which run PyTorch
  peers, are in the slow run below."""
  out = smoke("correctness", "decode", "attention", "mgpu", "profile")
  for table in KERNEL_TABLES:
    assert table in out, out[-4000:]
  # Every kernel's correctness row ran against its reference.
  for kernel in ("flash_attention fwd", "flash_attention bwd", "paged_attention", "mla_decode"):
    assert f"| {kernel} |" in out, out[-4000:]


@pytest.mark.slow
def test_gpu_benchmark_smoke_runs_every_section():
  out = smoke()
  tables = KERNEL_TABLES + (
    "## engine vs generate",
    "## batch-1 decode",
    "## transformers generate",
    "## training: atlas_jax vs PyTorch",
  )
  for table in tables:
    assert table in out, out[-4000:]
  # Both presets, both stacks, a ratio on every row; no MFU on a CPU (its peak is unknown).
  rows = [r for r in out.splitlines() if r.startswith(("| small |", "| llama3-1b |"))]
  assert len(rows) == 4, out[-4000:]
  assert all(r.split("|")[5].strip() == "-" and r.split("|")[7].strip() != "-" for r in rows)


def test_correctness_section_fails_on_a_mismatch(monkeypatch):
  """A kernel off its reference (here: FlashAttention returning zeros) fails the section."""
  import jax.numpy as jnp

  sys.path.insert(0, str(ROOT / "bench"))
  import gpu_kernels

  monkeypatch.setattr(gpu_kernels, "flash_attention", lambda q, k, v, **kw: jnp.zeros_like(q))
  with pytest.raises(SystemExit) as info:
    gpu_kernels.correctness(smoke=True)
  assert info.value.code == 1
