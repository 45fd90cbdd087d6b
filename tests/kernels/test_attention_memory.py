"""FlashAttention's memory, read off the compiled forward + backward (bytes, not times): the
reference's temporaries grow as T^2, the Pallas kernel's as T."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

from attention_memory import table  # noqa: E402


def test_reference_memory_is_quadratic_and_flash_memory_linear():
  rows = table([256, 512, 1024], heads=2, head_dim=32)
  for small, big in zip(rows, rows[1:], strict=False):
    assert big["xla"] / small["xla"] > 3.5  # doubling T: 4x the [N, T, S] temporaries
    assert 1.5 < big["pallas"] / small["pallas"] < 2.5  # doubling T: 2x
  assert all(r["xla"] >= r["probabilities"] for r in rows)  # the probabilities are among them
  # Past the point where [N, T, S] outgrows the blocks and O(T) buffers, the kernel holds less.
  assert rows[-1]["pallas"] < rows[-1]["probabilities"] < rows[-1]["xla"] / 6
