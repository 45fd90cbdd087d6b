"""MTP self-speculation inside the engine: the model's own heads draft (no second model), greedy
outputs equal plain greedy decoding (preemption included), sampled ones equal what
`generate(draft="mtp")` draws."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import MLAConfig, ModelConfig, MTPConfig
from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.model import build
from atlas_jax.serving.engine import Engine

from .conftest import TINY
from .test_engine_speculative import ROOMY, TIGHT, greedy_workload, run


def mtp_model(kind, n_predict, mla):
  mla_cfg = MLAConfig(16, 8, 8, 8, 12) if mla else None
  cfg = ModelConfig(**TINY, n_kv_heads=2, init_std=0.3, mtp=MTPConfig(kind, n_predict), mla=mla_cfg)
  return build(cfg, rngs=nnx.Rngs(3))


@pytest.mark.parametrize(
  "kind, n_predict, k, mla",
  [
    pytest.param("parallel", 3, 3, False, marks=pytest.mark.slow),
    pytest.param("sequential", 2, 1, True, marks=pytest.mark.slow),
  ],
)
def test_mtp_self_speculation_in_the_engine(kind, n_predict, k, mla):
  """Greedy: the plain greedy tokens (preemption in the parallel case); sampled (all prefilled in
  the first step): the tokens `generate(draft="mtp")` draws."""
  model = mtp_model(kind, n_predict, mla)
  prompts, params = greedy_workload(6)
  want = generate(model, prompts, params, eos_id=3)
  config = dataclasses.replace(TIGHT if kind == "parallel" else ROOMY, num_speculative_tokens=k)
  got, engine = run(model, "mtp", config, prompts, params)
  assert got == want
  assert engine.n_spec_rounds > 0
  heads_pool = engine.pools[1][0]
  assert all(a.shape[0] == k for a in jax.tree.leaves(heads_pool))  # k of n_predict heads
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, 40, int(n)).tolist() for n in (6, 11, 4)]
  params = [SamplingParams(max_new_tokens=18, temperature=1.0, seed=s) for s in (5, 6, 7)]
  want = generate(model, prompts, params, eos_id=3, draft="mtp", num_speculative_tokens=k)
  got, engine = run(
    model, "mtp", dataclasses.replace(ROOMY, num_speculative_tokens=k), prompts, params
  )
  assert got == want and engine.n_accepted > 0


def test_mtp_drafting_needs_heads(tiny_model):
  with pytest.raises(ValueError, match="the model has no MTP heads"):
    Engine(tiny_model, ROOMY, draft="mtp")
  with pytest.raises(ValueError, match="num_speculative_tokens=3 with draft='mtp' must be <= 2"):
    Engine(mtp_model("parallel", 2, False), ROOMY, draft="mtp")
