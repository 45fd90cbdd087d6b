"""bench/scaling.py and bench/mtp_training.py: the fit recovers a known law, the ladder runs
train.py end to end and reuses what it cached, equal-compute budgets are equal."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import mtp_training  # noqa: E402
import scaling  # noqa: E402


@pytest.mark.parametrize("noise", [0.0, 0.003])
def test_the_fit_recovers_a_known_law(noise):
  true = scaling.Fit(E=1.9, A=40.0, B=900.0, alpha=0.35, beta=0.45, rms_log_error=0.0)
  N, D = np.meshgrid(np.geomspace(2e4, 2e6, 5), np.geomspace(2e5, 4e6, 4))
  N, D = N.ravel(), D.ravel()
  L = true.loss(N, D) * np.exp(np.random.default_rng(1).normal(0, noise, N.size))
  f = scaling.fit(N, D, L)
  assert f.rms_log_error <= max(2 * noise, 1e-6)
  if noise == 0:
    for name in ("E", "A", "B", "alpha", "beta"):
      assert getattr(f, name) == pytest.approx(getattr(true, name), rel=1e-3), name
  else:  # the exponents and the loss surface, to what the noise allows
    assert f.alpha == pytest.approx(true.alpha, abs=0.1)
    assert f.beta == pytest.approx(true.beta, abs=0.1)
  grid = np.geomspace(1e4, 1e7, 7)
  np.testing.assert_allclose(f.loss(grid, grid * 5), true.loss(grid, grid * 5), rtol=2e-2)


def test_the_optimum_spends_compute_as_the_closed_form_says():
  f = scaling.Fit(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28, rms_log_error=0.0)
  C = 5.76e23  # Chinchilla's training compute
  N, D = f.optimal(C)
  assert 6 * N * D == pytest.approx(C)
  # No other split of the same compute does better.
  for scale in (0.5, 0.9, 1.1, 2.0):
    assert f.loss(N, D) < f.loss(N * scale, D / scale)
  # N_opt grows as C^(beta / (alpha + beta)).
  N10, _ = f.optimal(10 * C)
  assert np.log10(N10 / N) == pytest.approx(f.beta / (f.alpha + f.beta))


@pytest.mark.slow  # trains a ladder of runs; the fit and the cached results are checked above
def test_the_ladder_smoke_run_trains_and_reuses_its_cache(tmp_path, capsys):
  results = tmp_path / "scaling.json"
  args = ["--smoke", "--results", str(results), "--data-cache", str(tmp_path / "data")]
  scaling.main(args)
  runs = json.loads(results.read_text())["runs"]
  assert sorted(runs) == [f"{s.name}-{scaling.SMOKE_TOKENS[0]}" for s in scaling.SMOKE_SIZES]
  for key, r in runs.items():
    assert np.isfinite(r["eval_loss"]) and r["eval_loss"] < np.log(1024) + 0.5, key
    assert len(r["curve"]) == 8 and r["curve"][-1][0] == r["tokens"]
    assert r["command"].startswith("python train.py --config configs/tiny.yaml")
    assert str(tmp_path) not in r["command"]
  assert runs["s1-16384"]["non_embedding_params"] < runs["s2-16384"]["non_embedding_params"]
  before = results.read_text()
  scaling.main(args)  # every point cached: nothing trains, nothing changes
  assert results.read_text() == before


def test_the_mtp_arm_gets_the_same_training_flops():
  arms = mtp_training.arms()
  (base_sets, base_tokens), (mtp_sets, mtp_tokens) = arms.values()
  base = base_tokens * scaling.flops_per_token(mtp_training.SIZE, base_sets)
  with_mtp = mtp_tokens * scaling.flops_per_token(mtp_training.SIZE, mtp_sets)
  assert mtp_tokens < base_tokens
  # Equal to within one step's tokens (budgets are whole steps).
  step = scaling.BATCH * scaling.SEQ
  assert abs(with_mtp - base) <= step * scaling.flops_per_token(mtp_training.SIZE, mtp_sets)
