"""Speculative rounds inside the engine: the same tokens as plain decoding (greedy) and as
`generate`'s speculative loop (sampled), blocks of rejected drafts given back, the batch
threshold, and the counters `/metrics` reports."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import ModelConfig
from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.model import build
from atlas_jax.serving.engine import Engine, EngineConfig

from .conftest import TINY
from .test_engine import workload

ROOMY = EngineConfig(
  runner="ragged",
  n_blocks=128,
  block_size=4,
  max_num_seqs=8,
  max_num_batched_tokens=64,
  prefill_chunk=32,
  num_speculative_tokens=3,
  speculative_max_batch=8,
  min_batch_bucket=8,  # one compiled shape per program, whatever the batch: a faster suite
)
# 16 blocks of 4 for 4 sequences of up to 58 tokens: preemption, and rounds that find no room.
TIGHT = dataclasses.replace(
  ROOMY, n_blocks=16, max_num_seqs=4, max_num_batched_tokens=24, prefill_chunk=8, min_batch_bucket=4
)


@pytest.fixture(scope="module")
def draft():
  """A much smaller model with the target's vocabulary: a poor draft."""
  shape = dict(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, init_std=0.3)
  return build(ModelConfig(**{**TINY, **shape}), rngs=nnx.Rngs(7))


def run(model, draft, config, prompts, params):
  engine = Engine(model, config, draft=draft, eos_id=3)
  for i, (p, sp) in enumerate(zip(prompts, params)):
    engine.add_request(i, p, sp)
  got = {i: [] for i in range(len(prompts))}
  while engine.has_unfinished():
    for out in engine.step():
      assert out.error is None
      got[out.request_id].extend(out.new_token_ids)
  s = engine.allocator.stats()
  assert s.n_used == 0 and s.n_free + s.n_cached == s.n_blocks  # nothing leaked by rollbacks
  return [got[i] for i in range(len(prompts))], engine


def greedy_workload(seed):
  prompts, params = workload(seed)
  return prompts, [dataclasses.replace(p, temperature=0.0, top_k=0) for p in params]


# GQA in the roomy pool under -m slow: its tight pool takes the same rounds, then preemption.
@pytest.mark.parametrize(
  "any_model, config",
  [
    pytest.param("gqa", ROOMY, id="gqa-roomy", marks=pytest.mark.slow),
    pytest.param("gqa", TIGHT, id="gqa-tight"),
    pytest.param("mla", ROOMY, id="mla-roomy"),
    pytest.param("mla", TIGHT, id="mla-tight"),
  ],
  indirect=["any_model"],
)
def test_greedy_speculation_in_the_engine_equals_plain_greedy(any_model, draft, config):
  if config is TIGHT and any_model.cfg.mla is not None:
    pytest.skip("preemption under speculation is covered by the GQA model and by MTP on MLA")
  prompts, params = greedy_workload(1)
  want = generate(any_model, prompts, params, eos_id=3)
  got, engine = run(any_model, draft, config, prompts, params)
  assert got == want
  assert engine.n_spec_rounds > 0 and engine.n_drafted > engine.n_accepted
  if config is TIGHT:
    assert engine.n_preemptions > 0


@pytest.mark.slow
def test_the_target_as_its_own_draft_accepts_every_token(tiny_model):
  prompts, params = greedy_workload(2)
  want = generate(tiny_model, prompts, params, eos_id=3)
  got, engine = run(tiny_model, tiny_model, ROOMY, prompts, params)
  assert got == want
  assert engine.n_accepted == engine.n_drafted > 0
  # every round emits k + 1 tokens unless a stop cuts it: far fewer target passes than tokens
  assert engine.mean_acceptance_length > 2.5


def test_sampled_rounds_draw_what_generates_speculative_loop_draws(tiny_model, draft):
  """All requests prefill in the first step, so every later step is a round for every row, with
  the keys `generate`'s speculative loop uses: the same tokens, not only the same law."""
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, 40, int(n)).tolist() for n in (5, 9, 12, 3)]
  params = [
    SamplingParams(max_new_tokens=int(m), temperature=t, top_p=p, seed=s)
    for m, t, p, s in ((20, 1.0, 1.0, 1), (14, 0.7, 0.9, 2), (25, 1.3, 1.0, 3), (9, 1.0, 0.8, 4))
  ]
  want = generate(tiny_model, prompts, params, eos_id=3, draft=draft, num_speculative_tokens=3)
  got, engine = run(tiny_model, draft, ROOMY, prompts, params)
  assert got == [w[: len(g)] for g, w in zip(got, want)] and got == want
  assert engine.n_spec_rounds > 0 and engine.n_bursts == 0


def test_batches_past_the_threshold_burst_instead(tiny_model, draft):
  prompts, params = greedy_workload(4)
  params[0] = dataclasses.replace(params[0], max_new_tokens=60, ignore_eos=True)  # runs on alone
  config = dataclasses.replace(ROOMY, speculative_max_batch=2)
  want = generate(tiny_model, prompts, params, eos_id=3)
  got, engine = run(tiny_model, draft, config, prompts, params)
  assert got == want
  assert engine.n_bursts > 0  # 8 running: plain bursts (the draft keeps up inside them)
  assert engine.n_spec_rounds > 0  # the last few requests speculate once the batch shrinks


def test_bad_drafts_are_named(tiny_model, draft):
  other = build(ModelConfig(**{**TINY, "vocab_size": 41}), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="draft vocab_size=41"):
    Engine(tiny_model, ROOMY, draft=other)
  with pytest.raises(ValueError, match="draft max_seq_len=128 is shorter"):
    Engine(tiny_model, dataclasses.replace(ROOMY, max_model_len=256), draft=draft)
  with pytest.raises(ValueError, match="num_speculative_tokens=0"):
    dataclasses.replace(ROOMY, num_speculative_tokens=0)


def test_metrics_report_drafted_and_accepted_tokens(tiny_model, draft):
  from atlas_jax.serving.metrics import ServingMetrics
  from atlas_jax.serving.server import EngineRunner

  prompts, params = greedy_workload(5)
  _, engine = run(tiny_model, draft, ROOMY, prompts[:3], params[:3])
  runner = EngineRunner(engine)
  try:
    text = ServingMetrics().render(**runner.gauges())
  finally:
    runner.shutdown()
  assert f"atlas_spec_decode_num_draft_tokens_total {engine.n_drafted}" in text
  assert f"atlas_spec_decode_num_accepted_tokens_total {engine.n_accepted}" in text
  length = engine.n_spec_emitted / engine.n_spec_row_rounds
  assert f"atlas_spec_decode_mean_acceptance_length {length:.6f}" in text
