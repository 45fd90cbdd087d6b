"""Tiny models shared by the serving tests (random weights: logits far from ties).

`tiny_model` is Llama-style (GQA); `mla_model` is DeepSeek-style MLA with and without the query
bottleneck (q_lora), so every engine test can run on both cache kinds.
"""

import pytest
from flax import nnx

from atlas_jax.config import MLAConfig, ModelConfig
from atlas_jax.model import build

TINY = dict(vocab_size=40, d_model=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=128)


@pytest.fixture(scope="package")
def tiny_model():
  cfg = ModelConfig(**TINY, n_kv_heads=2, init_std=0.3)
  return build(cfg, rngs=nnx.Rngs(0))


def mla_config(q_lora_rank: int | None) -> ModelConfig:
  mla = MLAConfig(
    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, q_lora_rank=q_lora_rank
  )
  return ModelConfig(**TINY, n_kv_heads=4, mla=mla, init_std=0.3)


@pytest.fixture(scope="package", params=[None, 12], ids=["mla", "mla_qlora"])
def mla_model(request):
  return build(mla_config(request.param), rngs=nnx.Rngs(1))


@pytest.fixture(scope="package", params=["gqa", "mla"])
def any_model(request, tiny_model):
  """Both cache kinds: the GQA model (KV pool) and the MLA model with q_lora (latent pool)."""
  if request.param == "gqa":
    return tiny_model
  return build(mla_config(12), rngs=nnx.Rngs(1))
