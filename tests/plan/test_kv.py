"""KV accounting: known model sizes, and utilisation / hit rate from exact allocator counts."""

import pytest

from atlas_jax.cache.allocator import BlockAllocator
from atlas_jax.config import ModelConfig
from atlas_jax.plan.kv import (
  config_kv_bytes_per_token,
  kv_bytes,
  kv_bytes_per_token,
  mla_kv_bytes_per_token,
  paged_pool_bytes,
  preallocated_utilisation,
  prefix_hit_rate,
  utilisation,
)


def test_bytes_per_token_for_known_shapes():
  # Llama-3-8B: 32 layers, 8 kv heads of 128, bf16 -> 128 KiB per token.
  assert kv_bytes_per_token(32, 8, 128, 2) == 128 * 1024
  # Its MHA equivalent (32 kv heads) costs 4x, MQA 1/8.
  assert kv_bytes_per_token(32, 32, 128, 2) == 4 * 128 * 1024
  assert kv_bytes_per_token(32, 1, 128, 2) == 16 * 1024
  # DeepSeek-V3 MLA: 61 layers of a 512 latent + 64 rope dims, bf16.
  assert mla_kv_bytes_per_token(61, 512, 64, 2) == 61 * 576 * 2
  assert kv_bytes(128 * 1024, 8192, batch=4) == 4 * 2**30
  assert paged_pool_bytes(100, n_blocks=3, block_size=16) == 4800


def test_bytes_per_token_for_a_model_config():
  model = ModelConfig(d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, dtype="bfloat16")
  # head_dim defaults to d_model / n_heads = 32.
  assert config_kv_bytes_per_token(model) == 2 * 4 * 2 * 32 * 2
  assert config_kv_bytes_per_token(model, dtype_bytes=1) == 2 * 4 * 2 * 32


@pytest.mark.parametrize(
  "call,match",
  [
    (lambda: kv_bytes_per_token(0, 8, 128, 2), "n_layers"),
    (lambda: kv_bytes_per_token(32, 8, 128, 2.0), "dtype_bytes"),
    (lambda: mla_kv_bytes_per_token(61, 512, -1, 2), "rope_dim"),
    (lambda: kv_bytes(10, -1), "n_tokens"),
  ],
)
def test_bad_numbers_raise(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_utilisation_and_hit_rate_from_allocator_counters():
  alloc = BlockAllocator(16, 4)
  assert utilisation(alloc.stats()) == 1.0 and prefix_hit_rate(alloc.stats()) == 0.0
  alloc.add_sequence("a", range(10))  # 3 blocks, 10 slots filled
  assert utilisation(alloc.stats()) == 10 / 12
  alloc.add_sequence("b", list(range(8)) + [50])  # shares 2 full blocks, 1 new with 1 token
  stats = alloc.stats()
  # Physical slots: the shared blocks count once.
  assert (stats.filled_slots, stats.n_used) == (10 + 1, 4)
  assert utilisation(stats) == 11 / 16
  assert prefix_hit_rate(stats) == 8 / (10 + 9)
  alloc.fork("b", "c")
  assert utilisation(alloc.stats()) == 11 / 16  # forking allocates nothing


def test_preallocated_utilisation():
  assert preallocated_utilisation([100, 300], max_length=1000) == 0.2
  assert preallocated_utilisation([], max_length=10) == 1.0
