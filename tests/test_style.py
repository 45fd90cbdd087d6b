"""One linter and formatter for the whole tree: ruff, configured in pyproject.toml."""

import shutil
import subprocess
from pathlib import Path

import pytest


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed by the test extra")
def test_ruff_is_clean():
  root = Path(__file__).parent.parent
  result = subprocess.run(["ruff", "check", "."], cwd=root, capture_output=True, text=True)
  assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed by the test extra")
def test_ruff_format_is_clean():
  root = Path(__file__).parent.parent
  result = subprocess.run(
    ["ruff", "format", "--check", "."], cwd=root, capture_output=True, text=True
  )
  assert result.returncode == 0, result.stdout + result.stderr
