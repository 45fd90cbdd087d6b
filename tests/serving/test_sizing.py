"""The pool sized from device memory, per device from a block's per-shard bytes, and the batch
from the pool: the arithmetic checked against the arrays the engine allocates."""

import dataclasses
import logging

import jax
import pytest
from flax import nnx

from atlas_jax.config import ConfigError, ModelConfig
from atlas_jax.model import build
from atlas_jax.serving import sizing
from atlas_jax.serving.engine import Engine, EngineConfig

SHAPE = dict(vocab_size=48, d_model=32, n_layers=2, n_heads=8, ffn_dim=64, max_seq_len=128)
CONFIG = EngineConfig(runner="ragged", block_size=4, prefill_chunk=16, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def model():
  return build(ModelConfig(**SHAPE, n_kv_heads=4), rngs=nnx.Rngs(0))


def device_pool_bytes(engine) -> int:
  """The pool bytes device 0 holds, read off the arrays' shards."""
  device = jax.devices()[0]
  return sum(
    s.data.nbytes
    for a in jax.tree.leaves(engine.pools)
    for s in a.addressable_shards
    if s.device == device
  )


def test_bytes_per_device_count_a_block_per_shard(model):
  """The same bytes per device hold tensor-size times the blocks when kv heads split (sized
  with the unsharded head count they would hold a quarter)."""
  L, Z, K, H = 2, 4, 4, 4
  block = 2 * L * Z * K * H * 4  # k and v, float32
  budget = 40 * block + 100
  one = Engine(model, dataclasses.replace(CONFIG, kv_cache_memory=budget))
  four = Engine(model, dataclasses.replace(CONFIG, kv_cache_memory=budget, tensor_parallel_size=4))
  assert one.runner.block_bytes() == block and four.runner.block_bytes() == block // 4
  assert one.config.n_blocks == 40 and four.config.n_blocks == 160
  for engine in (one, four):
    held = device_pool_bytes(engine)
    assert held == engine.config.n_blocks * engine.runner.block_bytes() == engine.runner.pool_bytes
    assert held <= budget < held + engine.runner.block_bytes()
  # The batch is what the pool holds at the context (128 tokens here, under the typical length).
  assert (one.config.max_num_seqs, four.config.max_num_seqs) == (40 * Z // 128, 160 * Z // 128)


@pytest.mark.parametrize("field", ["gpu_memory_utilization", "kv_cache_memory"])
def test_a_fraction_of_device_memory(model, monkeypatch, field):
  """Device memory less weights and the largest step's activations (from its compiled program),
  at vLLM's utilisation or as a fraction of what is left."""
  limit = 1 << 26
  monkeypatch.setattr(sizing, "device_memory", lambda device: (limit, 0))
  config = dataclasses.replace(CONFIG, **{field: 0.5})
  engine = Engine(model, dataclasses.replace(config, data_parallel_size=2, tensor_parallel_size=2))
  size, runner = engine.pool_size, engine.runner
  assert size.used == runner.weight_bytes > 0
  assert 0 < size.activations < limit // 4
  left = limit - size.used - size.activations
  pool = int(0.5 * limit) - size.used - size.activations if field.startswith("gpu") else left // 2
  assert engine.config.n_blocks == pool // runner.block_bytes()
  assert device_pool_bytes(engine) == engine.config.n_blocks * runner.block_bytes() <= pool
  # A larger step budget compiles a larger largest step: the activations are measured.
  bigger = Engine(model, dataclasses.replace(config, max_num_batched_tokens=128, prefill_chunk=64))
  assert bigger.pool_size.activations > engine.pool_size.activations
  assert engine.config.max_num_seqs == min(32, engine.config.n_blocks * 4 // 128)
  assert Engine(model, dataclasses.replace(CONFIG, n_blocks=100)).config.max_num_seqs == 3


def test_sizing_without_device_memory_and_its_errors(model, caplog):
  with caplog.at_level(logging.INFO, logger="atlas_jax.serving"):
    engine = Engine(model, CONFIG)  # CPU devices report no memory: 8 full contexts
  assert engine.config.n_blocks == sizing.FULL_CONTEXTS_WITHOUT_MEMORY * 128 // 4
  assert engine.config.max_num_seqs == 8 and engine.config.max_num_batched_tokens == 32
  assert (
    Engine(model, EngineConfig(runner="ragged", block_size=4)).config.max_num_batched_tokens == 512
  )
  text = " ".join(r.getMessage() for r in caplog.records)
  assert "pool: 256 blocks of 4 tokens per replica (1024 tokens" in text
  assert "per device: weights" in text and "largest batch 8 sequences" in text
  with pytest.raises(ConfigError, match=r"kv_cache_memory=0.5 is not allowed: a fraction"):
    Engine(model, dataclasses.replace(CONFIG, kv_cache_memory=0.5))
  with pytest.raises(ConfigError, match=r"gives a pool of 0 blocks"):
    Engine(model, dataclasses.replace(CONFIG, kv_cache_memory=100))
  with pytest.raises(ConfigError, match=r"max_model_len=256 is not allowed: the model's context"):
    Engine(model, dataclasses.replace(CONFIG, max_model_len=256))


def test_a_hybrid_pool_splits_the_same_memory_by_what_requests_hold():
  """Gemma-3-1B's 22 windowed and 4 global layers, 2,048 blocks of 16 tokens of every layer, a
  request holding 50 blocks at most in the windowed pool: unset, the batch is the requests of
  2,048 tokens the memory holds (4 x 128 + 22 x 50 layer-blocks each: 33), their windows the
  windowed pool; the rest of the bytes go to the global layers' pool. A batch given is what the
  windowed pool holds; never more blocks than the one pool had."""
  kw = dict(n_layers=26, n_windowed=22, request_blocks=50, block_size=16, max_model_len=4096)
  full, window = sizing.split_window_pool(2048, max_num_seqs=None, **kw)
  assert window == 33 * 50 and 2048 * 26 // (4 * 128 + 22 * 50) == 33
  assert full == 2048 + (2048 - window) * 22 // 4
  assert 4 * full + 22 * window <= 26 * 2048
  assert sizing.split_window_pool(2048, max_num_seqs=8, **kw) == (
    2048 + (2048 - 400) * 22 // 4,
    400,
  )
  assert sizing.split_window_pool(2048, max_num_seqs=64, **kw) == (2048, 2048)
