"""bench/moe.py's expert-parallel comparison at a small shape: its all-to-all peer computes what
one device does, and the compiled programs' collectives move what `atlas_jax.model.moe` says they
do (dropless, the all-gather moves less than the all-to-all; with capacity the all-to-all less)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import moe  # noqa: E402


def test_dispatch_schemes_agree_and_rank_as_the_library_says():
  costs = moe.dispatch_costs(512, 8, 2, D=32, F=32, capacity_factor=2.0)
  (gather, dropless, capped) = costs.values()
  for coll, _, _, err in costs.values():
    assert err < 1e-5 and sum(coll.values()) > 0
  total = lambda c: sum(c[0].values())
  assert set(gather[0]) == {"all-gather", "reduce-scatter"} and set(dropless[0]) == {"all-to-all"}
  assert total(capped) < total(gather) < total(dropless)
