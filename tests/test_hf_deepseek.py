"""Hugging Face parity for dense DeepSeek-V3-family folders: MLA layers, YaRN, MTP modules (the
mixture-of-experts ones are in tests/test_hf_moe.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from atlas_jax import hf  # noqa: E402
from atlas_jax.model import Transformer  # noqa: E402
from tests.hf_reference import (  # noqa: E402
  TINY,
  build,
  hf_logits,
  jit_logits,
  mtp_logits,
  randomise,
  store_mtp_layers,
)

V = TINY["vocab_size"]
YARN = {
  "rope_type": "yarn",
  "rope_theta": 10000.0,
  "factor": 4.0,
  "original_max_position_embeddings": 16,
  "beta_fast": 32,
  "beta_slow": 1,
  "mscale": 0.707,  # != mscale_all_dim: the cos/sin attention factor is not 1
  "mscale_all_dim": 1.0,
}


DENSE = dict(
  TINY,
  num_key_value_heads=4,
  kv_lora_rank=16,
  q_lora_rank=24,
  qk_rope_head_dim=8,
  qk_nope_head_dim=12,
  v_head_dim=10,
  first_k_dense_replace=2,  # every layer dense
  max_position_embeddings=64,
)


def build_hf(folder, *, std: float = 0.2, **overrides):
  """A tiny dense DeepSeek-V3 with every weight (norms too) drawn at random, saved to `folder`."""
  return build("DeepseekV3", folder, {**DENSE, **overrides}, std=std)


CASES = {
  "qlora-default-rope": {},
  "qlora-yarn": {"rope_parameters": YARN},
  "full-q-yarn": {"q_lora_rank": None, "rope_parameters": YARN},
  "full-q-not-interleaved": {"q_lora_rank": None, "rope_interleave": False},
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
  ref = build_hf(tmp_path, **CASES[case])
  ours = hf.load(tmp_path)
  assert isinstance(ours, Transformer) and ours.cfg.mla is not None and ours.mtp is None
  toks = np.random.RandomState(0).randint(0, V, (2, 40))  # past original_max_position_embeddings
  want = hf_logits(ref, toks)
  np.testing.assert_allclose(jit_logits(ours, toks), want, atol=1e-4, rtol=1e-4)


def test_cached_decode_matches_transformers(tmp_path):
  """Prefill then token-by-token decode over the latent cache (absorbed path) == HF logits."""
  ref = build_hf(tmp_path, rope_parameters=YARN)
  ours = hf.load(tmp_path)
  toks = np.random.RandomState(1).randint(0, V, (2, 24))
  want = hf_logits(ref, toks)
  step = jax.jit(lambda t, c: ours(t, cache=c))
  cache = ours.init_cache(2, 32)
  out, cache = step(jnp.asarray(toks[:, :20]), cache)
  outs = [np.asarray(out)]
  for t in range(20, 24):
    out, cache = step(jnp.asarray(toks[:, t : t + 1]), cache)
    outs.append(np.asarray(out))
  np.testing.assert_allclose(np.concatenate(outs, 1), want, atol=1e-4, rtol=1e-4)


def test_mtp_modules_load_and_match_transformers_mtp_layer(tmp_path):
  """MTP layers stored as model.layers.{L + j} load into sequential heads; logits == HF MtpLayer."""
  from transformers.modeling_layers import MtpLayer
  from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

  J, L = 2, 2
  # Dense MTP blocks too: their layer indices L + j < first_k_dense_replace (MoE ones are in
  # tests/test_hf_moe.py).
  ref = build_hf(tmp_path, rope_parameters=YARN, first_k_dense_replace=L + J)
  cfg = ref.config
  layers = [MtpLayer(cfg, ds.DeepseekV3DecoderLayer, ds.DeepseekV3RMSNorm, L + j) for j in range(J)]
  for layer in layers:
    randomise(layer, 0.2)
  store_mtp_layers(tmp_path, ref, layers)

  ours = hf.load(tmp_path)
  assert ours.cfg.mtp.kind == "sequential" and ours.cfg.mtp.n_predict == J
  T = 20
  toks = np.random.RandomState(2).randint(0, V, (2, T))
  main, mtp = jax.jit(lambda t: ours.forward_mtp(t))(jnp.asarray(toks, jnp.int32))

  for j, want in enumerate(mtp_logits(ref, layers, toks)):
    np.testing.assert_allclose(np.asarray(mtp[j]), want, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(np.asarray(main), hf_logits(ref, toks), atol=1e-4, rtol=1e-4)


def test_dense_mla_model_with_mtp_exports_to_transformers(tmp_path):
  """A deepseek-tiny-shaped model (dense MLA layers, one MTP module) saves as deepseek_v3:
  transformers reads the trunk to our logits; we read the MTP module back too."""
  from flax import nnx

  from atlas_jax.config import MLAConfig, ModelConfig, MTPConfig
  from atlas_jax.model import build

  cfg = ModelConfig(
    vocab_size=V,
    d_model=32,
    n_layers=2,
    n_heads=2,
    n_kv_heads=2,
    ffn_dim=48,
    init_std=0.1,
    mla=MLAConfig(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    mtp=MTPConfig(n_predict=1),
  )
  model = build(cfg, rngs=nnx.Rngs(0))
  hf.save(model, tmp_path)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  toks = np.random.RandomState(3).randint(0, V, (2, 16))
  want = hf_logits(back, toks)
  np.testing.assert_allclose(jit_logits(model, toks), want, atol=1e-4, rtol=1e-4)
  again = hf.load(tmp_path)
  assert again.cfg == dataclasses.replace(cfg, init_std=again.cfg.init_std)
  t = jnp.asarray(toks, jnp.int32)
  np.testing.assert_array_equal(
    np.asarray(again.forward_mtp(t)[1]), np.asarray(model.forward_mtp(t)[1])
  )
