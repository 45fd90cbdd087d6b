"""MLA: the expanded and absorbed paths agree, the latent cache holds C + R per token, KV bytes."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import ConfigError, MLAConfig, ModelConfig, RopeScaling
from atlas_jax.model import Transformer
from atlas_jax.plan.kv import config_kv_bytes_per_token, format_kv_report, kv_report

YARN = RopeScaling(
  type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=0.707, mscale_all_dim=1.0
)


def tiny(**mla):
  kw = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10)
  kw.update(mla)
  return ModelConfig(
    vocab_size=53,
    d_model=48,
    n_layers=2,
    n_heads=3,
    ffn_dim=64,
    rope_scaling=YARN,
    mla=MLAConfig(**kw),
  )


def test_cached_decode_equals_full_forward():
  """Prefill (expanded path over the cache) + absorbed decode steps == one uncached forward."""
  cfg = tiny(q_lora_rank=20, v_head_dim=24)  # Hv > Hn + R: q and k get padded
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  model.blocks.attn.absorb_max_tokens = 2  # so the 6-token prefill takes the expanded path
  toks = jax.random.randint(jax.random.key(1), (2, 10), 0, cfg.vocab_size)
  full = jax.jit(lambda t: model(t))(toks)
  step = jax.jit(lambda t, c: model(t, cache=c))
  cache = model.init_cache(2, 16)
  outs = []
  for lo, hi in ((0, 6), (6, 7), (7, 9), (9, 10)):  # 6 expanded, then 1, 2, 1 absorbed
    out, cache = step(toks[:, lo:hi], cache)
    outs.append(out)
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=1e-5, rtol=1e-5)
  assert cache.c.shape == (2, 2, 16, 16 + 8) and list(cache.lengths) == [10, 10]


def test_latent_cache_bytes_are_c_plus_r():
  cfg = dataclasses.replace(tiny(), dtype="bfloat16")
  cache = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))).init_cache(3, 32)
  per_token = cache.c.nbytes // (3 * 32)
  assert per_token == cfg.n_layers * (16 + 8) * 2 == config_kv_bytes_per_token(cfg)


def deepseek(L, N, *, C=512, R=64, Hn=128, Hv=128, q=1536):
  return ModelConfig(
    vocab_size=129280,
    d_model=7168,
    n_layers=L,
    n_heads=N,
    n_kv_heads=N,
    ffn_dim=18432,
    mla=MLAConfig(
      kv_lora_rank=C, qk_rope_head_dim=R, qk_nope_head_dim=Hn, v_head_dim=Hv, q_lora_rank=q
    ),
  )


def llama(L, N, K, H=128):
  return ModelConfig(d_model=N * H, n_layers=L, n_heads=N, n_kv_heads=K, ffn_dim=14336)


def test_kv_report_against_hand_computed_bytes():
  rows = kv_report(
    {
      "deepseek-v3": deepseek(61, 128),
      "deepseek-v2": deepseek(60, 128),
      "deepseek-v2-lite": deepseek(27, 16, q=None),
      "llama-3-8b": llama(32, 32, 8),
      "llama-3-70b": llama(80, 64, 8),
      "llama-2-7b": llama(32, 32, 32),
      "mqa-32x32": llama(32, 32, 1),
    },
    dtype_bytes=2,
  )
  got = {r.name: (r.kind, r.bytes_per_token, r.mha_bytes_per_token) for r in rows}
  # MLA: L * (C + R) * 2 bytes; its MHA counterpart caches N keys of Hn + R and N values of Hv.
  assert got["deepseek-v3"] == ("MLA", 61 * 576 * 2, 61 * 128 * (192 + 128) * 2)
  assert got["deepseek-v2"] == ("MLA", 60 * 576 * 2, 60 * 128 * 320 * 2)
  assert got["deepseek-v2-lite"] == ("MLA", 27 * 576 * 2, 27 * 16 * 320 * 2)
  # Dense: 2 * L * K * H * 2 bytes.
  assert got["llama-3-8b"] == ("GQA", 2 * 32 * 8 * 128 * 2, 2 * 32 * 32 * 128 * 2)
  assert got["llama-3-70b"] == ("GQA", 2 * 80 * 8 * 128 * 2, 2 * 80 * 64 * 128 * 2)
  assert got["llama-2-7b"] == ("MHA", 2 * 32 * 32 * 128 * 2, 2 * 32 * 32 * 128 * 2)
  assert got["mqa-32x32"][:2] == ("MQA", 2 * 32 * 1 * 128 * 2)
  ratio = {r.name: r.reduction for r in rows}
  assert ratio["deepseek-v3"] == pytest.approx(71.11, abs=0.01)  # 320 * 128 / 576
  assert ratio["deepseek-v2-lite"] == pytest.approx(8.89, abs=0.01)  # 320 * 16 / 576
  assert ratio["llama-3-70b"] == 8.0 and ratio["llama-2-7b"] == 1.0
  # Against a GQA model rather than MHA the gap is what the seed's 5-13x describes.
  v3_vs_70b = got["llama-3-70b"][1] / got["deepseek-v3"][1]
  assert v3_vs_70b == pytest.approx(4.66, abs=0.01)
  table = format_kv_report(rows)
  assert "| deepseek-v3 | MLA | 70,272 | 4,997,120 | 71.11x |" in table


def test_config_errors_name_the_field():
  with pytest.raises(ConfigError, match="model.mla.qk_rope_head_dim=7"):
    MLAConfig(qk_rope_head_dim=7)
  with pytest.raises(ConfigError, match="model.partial_rotary_factor=0.5 .* with model.mla"):
    ModelConfig(partial_rotary_factor=0.5, mla=MLAConfig())
  with pytest.raises(ConfigError, match="model.qk_norm"):
    ModelConfig(qk_norm=True, mla=MLAConfig())


def test_deepseek_v3_shaped_dense_model_eval_shape():
  """A DeepSeek-V3-shaped dense MLA model builds abstractly; its cache is 70,272 B/token in bf16."""
  cfg = dataclasses.replace(deepseek(61, 128), dtype="bfloat16", param_dtype="bfloat16")
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  attn = model.blocks.attn
  assert attn.wq_a.shape == (61, 7168, 1536) and attn.wq_b.shape == (61, 1536, 128, 192)
  assert attn.wkv_a.shape == (61, 7168, 576) and attn.wk_b.shape == (61, 512, 128, 128)
  cache = jax.eval_shape(lambda: model.init_cache(1, 4096))
  assert cache.c.shape == (61, 1, 4096, 576)
  assert cache.c.size * 2 // 4096 == 70272
