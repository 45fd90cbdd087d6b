"""A model whose every layer attends within a window of W positions (or chunks of W: a query
reads from its chunk's start, within its last W positions) holds at most the blocks of
its last W positions per sequence: the blocks before return to the pool as the sequence advances
(exact counts), and the tokens stay those of plain decoding. A model mixing windowed and
full-attention layers keeps the windowed layers' blocks in a pool of their own, bounded alike,
the others' growing with the sequence (`HybridAllocator`, `HybridPool`)."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from atlas_jax.cache.allocator import DROPPED, BlockAllocator, HybridAllocator, OutOfBlocksError
from atlas_jax.config import ModelConfig
from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.model import build
from atlas_jax.serving.engine import Engine, EngineConfig, window_bound
from atlas_jax.serving.scheduler import burst_capacity

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


# The bounded kinds: a sliding window of W, chunks of W (Llama 4's local layers).
KINDS = {"sliding": dict(sliding_window=W), "chunked": dict(attention_chunk_size=W)}


def windowed_model(seed: int, kind: str = "sliding"):
  cfg = ModelConfig(**SHAPE, max_seq_len=128, init_std=0.3, **KINDS[kind])
  return build(cfg, rngs=nnx.Rngs(seed))


def held(n: int) -> int:
  """Blocks a sequence of n computed tokens holds: its last, partial or not, down to the one
  holding position n - W + 1."""
  return -(-n // Z) - max(0, n - W + 1) // Z


@pytest.mark.parametrize(
  ("burst", "kind"), [(1, "sliding"), (8, "sliding"), (1, "chunked"), (8, "chunked")]
)
def test_a_windowed_sequence_holds_its_windows_blocks_and_decodes_as_generate(burst, kind):
  model = windowed_model(0, kind)
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


def test_window_bound_needs_every_layer_windowed_and_no_drafter():
  cfg = ModelConfig(**SHAPE, sliding_window=W, layer_types=("sliding_attention", "full_attention"))
  assert window_bound(cfg, None) is None
  # The same layers all sliding are bounded; any drafter reading the history lifts the bound.
  assert window_bound(dataclasses.replace(cfg, layer_types=None), None) == W
  assert window_bound(dataclasses.replace(cfg, layer_types=None), object()) is None


@pytest.mark.parametrize("kind", ["sliding", "chunked"])
def test_windowed_serving_under_preemption_and_prefix_sharing_equals_generate(kind):
  """A tight pool (preemption, recompute), prompts sharing a prefix (cached blocks taken, then
  dropped behind the window), sampled and greedy rows, decode bursts: every request's tokens
  are plain decoding's."""
  model = windowed_model(1, kind)
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


def test_a_windowed_prefix_hit_needs_only_the_windows_blocks():
  """With a window, a hit of n tokens needs the cached blocks from position n - W + 1 on, and
  the sequence takes only those: earlier ones, evicted or not, are never read."""
  alloc = BlockAllocator(6, Z, window=W)
  prompt = list(range(17))  # 4 full blocks before the last token
  alloc.add_sequence("a", prompt)
  alloc.drop_before("a", 9)  # blocks 0 and 1 cached first: the least recently used
  alloc.free("a")  # blocks 2 and 3 cached, the partial one freed
  assert alloc.cached_prefix_length(prompt + [99]) == 16
  alloc.add_sequence("b", [50] * 13)  # 4 blocks: the 2 free ones, and blocks 0 and 1 evicted
  assert alloc.stats().n_evictions == 2
  alloc.free("b")
  # Without a window the chain breaks at its first block; with one the hit stands: the token
  # at 16 reads positions 9.. (blocks 2 and 3), both still cached.
  assert BlockAllocator(6, Z).cached_prefix_length(prompt) == 0
  assert alloc.cached_prefix_length(prompt + [99]) == 16
  assert alloc.add_sequence("c", prompt + [99]) == 16
  assert alloc.blocks("c")[:2] == [DROPPED, DROPPED]
  # A hit of 8 tokens would need blocks 0 and 1 (its next token reads positions 1..8).
  assert alloc.cached_prefix_length(prompt + [99], limit=9) == 0


def test_hybrid_allocator_serves_the_hit_both_groups_hold_and_checks_both_first():
  alloc = HybridAllocator(12, 6, Z, W)
  prompt = list(range(17))
  assert alloc.add_sequence("a", prompt) == 0
  assert len(alloc.blocks("a")) == len(alloc.window_blocks("a")) == 5
  alloc.drop_before("a", 17 - W + 1)  # the sliding group lets go of blocks 0 and 1
  assert alloc.window_blocks("a")[:2] == [DROPPED, DROPPED] and DROPPED not in alloc.blocks("a")
  assert alloc.sliding.stats().n_used == 3 and alloc.full.stats().n_used == 5
  # The sliding group's pool (6 blocks) is the scarcer, 3 left: a reservation of 4 more blocks
  # fails on it with nothing changed in either group.
  assert alloc.n_available == 3 and not alloc.can_reserve(["a"], 16)
  before = (alloc.full.stats(), alloc.sliding.stats())
  with pytest.raises(OutOfBlocksError, match="sliding"):
    alloc.reserve("a", 16)
  assert (alloc.full.stats(), alloc.sliding.stats()) == before
  # Forked children share both groups' blocks; a copy-on-write in the sliding group comes
  # back offset by the full group's size.
  alloc.fork("a", "b")
  copies = alloc.truncate("b", 15)
  assert copies == [(alloc.blocks("a")[3], alloc.blocks("b")[3])] + [
    (alloc.window_blocks("a")[3] + 12, alloc.window_blocks("b")[3] + 12)
  ]
  alloc.free("a")
  alloc.free("b")
  # A new sequence with the prefix: the full group holds blocks 0..3 cached, the sliding group
  # those the window of position 16 reads; the hit is both's.
  assert alloc.cached_prefix_length(prompt + [1]) == 16
  assert alloc.add_sequence("c", prompt + [1]) == 16
  assert alloc.window_blocks("c")[:2] == [DROPPED, DROPPED]


SLIDING_FULL = ("sliding_attention", "full_attention", "sliding_attention")


def hybrid_model(seed: int, kind: str = "sliding"):
  cfg = ModelConfig(
    **{**SHAPE, "n_layers": 3},
    max_seq_len=128,
    layer_types=tuple(t.replace("sliding", kind) for t in SLIDING_FULL),
    init_std=0.3,
    **KINDS[kind],
  )
  return build(cfg, rngs=nnx.Rngs(seed))


@pytest.mark.parametrize(("burst", "kind"), [(1, "sliding"), (8, "sliding"), (8, "chunked")])
def test_a_hybrid_models_windowed_layers_hold_their_windows_blocks(burst, kind):
  """Two of three layers slide (or attend within chunks): their pool holds each sequence's
  window, the full-attention layer's every block; the pools' bytes are those of the one pool
  they replace."""
  model = hybrid_model(0, kind)
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
  alloc = engine.allocator
  assert isinstance(alloc, HybridAllocator) and engine.scheduler.window == W
  # 2 seats of a window's blocks each (the window, a chunk or burst ahead, a partial block
  # either side) for the two windowed layers; the rest of 32 blocks x 3 layers for the full one.
  n_window = 2 * (-(-(W - 1 + max(8, burst_capacity(engine.config))) // Z) + 2)
  assert engine.runner.n_window_blocks == alloc.sliding.n_blocks == n_window
  assert alloc.full.n_blocks == 32 + (32 - n_window) * 2
  assert alloc.full.n_blocks + 2 * n_window == 32 * 3
  full, sliding = engine.pools[0].full, engine.pools[0].sliding
  assert full.k.shape[:2] == (1, alloc.full.n_blocks) and sliding.k.shape[:2] == (2, n_window)
  engine.add_request("r", prompt, params)
  got = []
  while "r" in engine.scheduler.requests:
    for out in engine.step():
      got += out.new_token_ids
    req = engine.scheduler.requests.get("r")
    if req is not None:
      ahead = len(alloc.blocks("r")) - -(-req.n_computed // Z)
      assert alloc.full.stats().n_used == -(-req.n_computed // Z) + ahead
      assert alloc.sliding.stats().n_used == held(req.n_computed) + ahead, req.n_computed
  assert got == list(want)
  assert alloc.full.stats().n_used == alloc.sliding.stats().n_used == 0


@pytest.mark.parametrize(
  ("runner", "kind"),
  [
    # The CPU runner's cases under -m slow: test_hf_patterns serves Gemma 3's sliding and full
    # layers (two pools) on it, and the ragged cases take the preemption and the shared prefixes.
    ("ragged", "sliding"),
    pytest.param("cpu", "sliding", marks=pytest.mark.slow),
    ("ragged", "chunked"),
    pytest.param("cpu", "chunked", marks=pytest.mark.slow),
  ],
)
def test_hybrid_serving_under_preemption_and_prefix_sharing_equals_generate(runner, kind):
  """The workload of the all-windowed test on the hybrid model: a tight pool, shared prefixes
  (hits that both groups hold), sampled and greedy rows, bursts; on either runner."""
  model = hybrid_model(1, kind)
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
    runner=runner,
    n_blocks=12,
    block_size=Z,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    prefill_chunk=8,
    decode_burst=4,
    offline_burst=4,
  )
  engine = Engine(model, config)
  assert engine.generate(prompts, params) == want
  s = engine.kv_stats()
  assert engine.n_preemptions > 0 and s.prefix_hit_tokens > 0 and s.n_used == 0
  assert engine.allocator.sliding.stats().n_used == 0


def test_hybrid_pools_hold_8bit_pages_and_serve_the_one_pools_tokens():
  """An int8 pool, split or not (`disable_hybrid_kv_cache_manager`, vLLM's flag): the same
  entries read through either layout, the same tokens; disabled, one pool and one allocator."""
  model = hybrid_model(2)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 48, int(n)).tolist() for n in (25, 7, 16)]
  params = [SamplingParams(max_new_tokens=20, temperature=float(i % 2), seed=i) for i in range(3)]
  config = EngineConfig(
    runner="ragged",
    n_blocks=24,
    block_size=Z,
    max_num_seqs=3,
    prefill_chunk=8,
    decode_burst=4,
    kv_cache_dtype="int8",
  )
  hybrid = Engine(model, config)
  one = Engine(model, dataclasses.replace(config, disable_hybrid_kv_cache_manager=True))
  assert isinstance(hybrid.allocator, HybridAllocator) and hybrid.pools[0].sliding.k_scale.ndim == 4
  assert isinstance(one.allocator, BlockAllocator) and one.runner.n_window_blocks is None
  assert hybrid.generate(prompts, params) == one.generate(prompts, params)
