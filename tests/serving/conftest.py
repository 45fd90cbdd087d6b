"""A tiny model shared by the serving tests (random weights: logits far from ties)."""

import pytest
from flax import nnx

from atlas_jax.config import ModelConfig
from atlas_jax.model.transformer import Transformer


@pytest.fixture(scope="package")
def tiny_model():
  cfg = ModelConfig(
    vocab_size=40,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=64,
    max_seq_len=128,
    init_std=0.3,
  )
  return Transformer(cfg, rngs=nnx.Rngs(0))
