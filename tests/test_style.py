"""One linter and one formatter for the whole tree: ruff, configured in pyproject.toml."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def ruff(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(["ruff", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed by the test extra")
def test_ruff_check_is_clean():
  result = ruff("check", ".")
  assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed by the test extra")
def test_ruff_format_is_clean():
  result = ruff("format", "--check", ".")
  assert result.returncode == 0, result.stdout + result.stderr
