"""Executes the notebooks in place, saving their outputs and plots (what is committed).

    python notebooks/run.py                       # every notebook
    python notebooks/run.py 01_kv_cache_and_gqa   # some of them

Each runs from this folder on CPU at its default sizes; the tests execute them the same way
(`tests/test_notebooks.py`) without saving.
"""

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def execute(path: Path, *, timeout: int = 600) -> nbformat.NotebookNode:
  """Runs every cell of the notebook at `path` (cwd: this folder) and returns it with outputs."""
  nb = nbformat.read(path, as_version=4)
  NotebookClient(
    nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}
  ).execute()
  return nb


def main(names: list[str]) -> None:
  # Eight fake CPU devices, for the sharding cells; set before any kernel imports jax.
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  paths = sorted(HERE.glob("*.ipynb"))
  if names:
    paths = [p for p in paths if p.stem in names]
  for path in paths:
    start = time.perf_counter()
    nb = execute(path)
    nbformat.write(nb, path)
    print(f"{path.name}: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  main(sys.argv[1:])
