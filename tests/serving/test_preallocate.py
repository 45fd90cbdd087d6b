"""serve.engine.preallocate: every request reserves a whole context, so the pool seats exactly
pool / max_model_len requests, none is preempted, and the tokens are the paged engine's."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import ConfigError, ModelConfig
from atlas_jax.decoding.sampling import SamplingParams
from atlas_jax.model import build
from atlas_jax.serving.engine import Engine, EngineConfig

SHAPE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
# 64-token contexts of 4 blocks each; 14 blocks seat 3 pre-allocated requests (2 blocks spare).
CONFIG = EngineConfig(
  runner="ragged",
  n_blocks=14,
  block_size=16,
  max_model_len=64,
  max_num_seqs=8,
  prefill_chunk=16,
  decode_burst=4,
)


@pytest.fixture(scope="module")
def model():
  return build(ModelConfig(**SHAPE, max_seq_len=64), rngs=nnx.Rngs(0))


def workload(n=8, seed=0):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, 64, int(rng.integers(3, 12))).tolist() for _ in range(n)]
  params = [
    SamplingParams(max_new_tokens=int(rng.integers(4, 20)), ignore_eos=True, temperature=t, seed=i)
    for i, t in enumerate([0.0, 0.8] * (n // 2))
  ]
  return prompts, params


def serve(engine, prompts, params):
  """The tokens of each request, and the most requests that ran at once."""
  for i, (p, sp) in enumerate(zip(prompts, params)):
    engine.add_request(i, p, sp)
  got, most = {i: [] for i in range(len(prompts))}, 0
  while engine.has_unfinished():
    for out in engine.step():
      got[out.request_id].extend(out.new_token_ids)
    most = max(most, engine.n_running)
  return [got[i] for i in range(len(prompts))], most


def test_seats_are_whole_contexts_and_tokens_are_the_paged_engines(model):
  prompts, params = workload()
  paged, most_paged = serve(Engine(model, CONFIG), prompts, params)
  engine = Engine(model, dataclasses.replace(CONFIG, preallocate=True))
  assert engine.config.max_num_seqs == 14 // (64 // 16) == 3
  assert not engine.config.enable_prefix_caching
  pre, most_pre = serve(engine, prompts, params)
  assert pre == paged
  assert most_pre == 3 < most_paged  # exactly pool / max_model_len at once; paging fits more
  assert engine.n_preemptions == 0


def test_a_pool_smaller_than_one_context_is_named(model):
  with pytest.raises(ConfigError, match=r"serve\.engine\.preallocate=True reserves 64 tokens"):
    Engine(model, dataclasses.replace(CONFIG, n_blocks=3, preallocate=True))
