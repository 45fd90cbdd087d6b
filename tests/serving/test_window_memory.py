"""A model whose every layer attends within a window of W positions holds at most the blocks of
its last W positions per sequence: the blocks before return to the pool as the sequence advances
(exact counts), and the tokens stay those of plain decoding."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from atlas_jax.cache.allocator import DROPPED, BlockAllocator
from atlas_jax.config import ModelConfig
from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.model import build
from atlas_jax.serving.engine import Engine, EngineConfig, window_bound

W, Z = 8, 4


def test_drop_before_releases_whole_blocks_and_keeps_the_rest_working():
  alloc = BlockAllocator(8, Z)
  alloc.add_sequence("a", list(range(11)))  # blocks 0, 1, 2 (3 tokens in the last)
  assert alloc.drop_before("a", 3) == 0  # no block lies wholly before position 3
  assert alloc.drop_before("a", 9) == 2  # positions 0..7
  assert alloc.blocks("a") == [DROPPED, DROPPED, 2]
  table, lengths = alloc.block_table(["a"], 4, pad=0)
  assert table.tolist() == [[0, 0, 2, 0]] and lengths.tolist() == [11]
  # The dropped full blocks are cached (hashed), the partial one is still used.
  s = alloc.stats()
  assert (s.n_used, s.n_cached, s.n_free) == (1, 2, 5)
  alloc.fork("a", "b")
  assert alloc.ref_count(2) == 2
  with pytest.raises(ValueError, match="dropped blocks"):
    alloc.truncate("b", 5)
  assert alloc.truncate("b", 10) == [(2, 3)]  # its shared last block copied, as before
  alloc.append("a", [11])
  alloc.free("a")
  alloc.free("b")
  assert alloc.stats().n_used == 0
  alloc.add_sequence("c", [1, 2])
  with pytest.raises(ValueError, match="past sequence"):
    alloc.drop_before("c", 3)


# Every layer slides over W positions.
SHAPE = dict(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def windowed_model(seed: int):
  cfg = ModelConfig(**SHAPE, max_seq_len=128, sliding_window=W, init_std=0.3)
  return build(cfg, rngs=nnx.Rngs(seed))


def held(n: int) -> int:
  """Blocks a sequence of n computed tokens holds: its last, partial or not, down to the one
  holding position n - W + 1."""
  return -(-n // Z) - max(0, n - W + 1) // Z


@pytest.mark.parametrize("burst", [1, 8])
def test_a_windowed_sequence_holds_its_windows_blocks_and_decodes_as_generate(burst):
  model = windowed_model(0)
  prompt, n_new = list(range(3, 22)), 40
  params = SamplingParams(max_new_tokens=n_new)
  (want,) = generate(model, [prompt], params)
  config = EngineConfig(
    runner="ragged",
    n_blocks=32,
    block_size=Z,
    max_num_seqs=2,
    prefill_chunk=8,
    decode_burst=burst,
    enable_prefix_caching=False,
  )
  engine = Engine(model, config)
  assert engine.scheduler.window == W
  engine.add_request("r", prompt, params)
  got, most = [], 0
  while "r" in engine.scheduler.requests:
    for out in engine.step():
      got += out.new_token_ids
    req = engine.scheduler.requests.get("r")
    if req is not None:
      used = engine.kv_stats().n_used
      # Blocks for tokens not computed yet (a burst's reservation) come on top.
      ahead = len(engine.allocator.blocks("r")) - -(-req.n_computed // Z)
      assert used == held(req.n_computed) + ahead, (req.n_computed, used)
      most = max(most, used)
  assert got == list(want)
  assert most <= held(W + Z) + -(-burst // Z) + 1 < -(-(len(prompt) + n_new) // Z)
  assert engine.kv_stats().n_used == 0


def test_a_model_with_global_layers_keeps_every_block():
  cfg = ModelConfig(**SHAPE, sliding_window=W, layer_types=("sliding_attention", "full_attention"))
  engine = Engine(
    build(cfg, rngs=nnx.Rngs(0)), EngineConfig(runner="ragged", n_blocks=16, block_size=Z)
  )
  assert engine.scheduler.window is None
  # The same layers all sliding are bounded; any drafter reading the history lifts the bound.
  assert window_bound(dataclasses.replace(cfg, layer_types=None), None) == W
  assert window_bound(dataclasses.replace(cfg, layer_types=None), object()) is None


def test_windowed_serving_under_preemption_and_prefix_sharing_equals_generate():
  """A tight pool (preemption, recompute), prompts sharing a prefix (cached blocks taken, then
  dropped behind the window), sampled and greedy rows, decode bursts: every request's tokens
  are plain decoding's."""
  model = windowed_model(1)
  rng = np.random.default_rng(0)
  shared = rng.integers(0, 48, 14).tolist()
  prompts = [shared + rng.integers(0, 48, int(n)).tolist() for n in (3, 9, 1, 6)]
  prompts += [rng.integers(0, 48, int(n)).tolist() for n in (20, 5)]
  params = [
    SamplingParams(max_new_tokens=int(rng.integers(12, 30)), temperature=float(i % 2), seed=i)
    for i in range(len(prompts))
  ]
  want = generate(model, prompts, params)
  config = EngineConfig(
    runner="ragged",
    n_blocks=9,
    block_size=Z,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    prefill_chunk=8,
    decode_burst=4,
    offline_burst=4,
  )
  engine = Engine(model, config)
  # 12 blocks (46 tokens) for the longest request; the window bounds what it holds to 6.
  assert engine.intake.window_blocks == 6 < 12
  assert engine.generate(prompts, params) == want
  s = engine.kv_stats()
  assert engine.n_preemptions > 0 and s.prefix_hit_tokens > 0 and s.n_used == 0
