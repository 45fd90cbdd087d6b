"""The notebooks run end to end at their default sizes, so they cannot rot; the committed copies
carry their outputs and plots, so they read on GitHub without running.

The kernel inherits this process's environment (8 fake CPU devices, CPU only: see conftest.py).
`python notebooks/run.py` re-executes them and saves the outputs.
"""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = [
  "01_kv_cache_and_gqa",
  "02_flash_attention",
  "03_paged_kv_cache",
  "04_mla",
  "05_speculative_decoding",
  "06_training_memory",
  "07_scaling_laws",
]


def images(nb) -> int:
  return sum(
    "image/png" in out.get("data", {})
    for cell in nb.cells
    if cell.cell_type == "code"
    for out in cell.outputs
  )


def test_the_notebooks_are_there():
  assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_with_outputs_and_plots(path):
  nb = nbformat.read(path, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  # Executed top to bottom in one run, nothing failed.
  assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
  assert not [o for c in code for o in c.outputs if o.output_type == "error"]
  assert images(nb) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path):
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
    nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK_DIR)}}
  )
  client.execute()  # raises CellExecutionError naming the cell on any failure
  assert images(nb) >= 1
