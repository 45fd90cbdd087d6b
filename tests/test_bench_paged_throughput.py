"""bench/paged_throughput.py: its workload fits the context, shares the system prompt it says,
and keeps kv_sim's length distribution at the smaller context."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import paged_throughput  # noqa: E402


@pytest.mark.parametrize("shared", [False, True])
def test_the_workload_fits_the_context(shared):
  L = 512
  prompts, params = paged_throughput.workload(200, L, 1024, shared=shared, seed=1)
  assert all(len(p) + sp.max_new_tokens <= L and sp.ignore_eos for p, sp in zip(prompts, params))
  prefix = L // 8 if shared else 0
  assert all(p[:prefix] == prompts[0][:prefix] for p in prompts)
  if not shared:  # kv_sim's means (~160 prompt, ~340 output at 2048 tokens), scaled by a quarter
    assert 25 < np.mean([len(p) for p in prompts]) < 60
    assert 50 < np.mean([sp.max_new_tokens for sp in params]) < 110
