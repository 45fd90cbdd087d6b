"""Hugging Face parity for dense DeepSeek-V3-family folders: MLA layers, YaRN, MTP modules (the
mixture-of-experts ones are in tests/test_hf_moe.py)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from atlas_jax import hf  # noqa: E402
from atlas_jax.model import Transformer  # noqa: E402

V = 101
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


def build_hf(folder, *, std: float = 0.2, **overrides):
  """A tiny dense DeepSeek-V3 with every weight (norms too) drawn at random, saved to `folder`."""
  torch.manual_seed(0)
  kw = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    first_k_dense_replace=2,  # every layer dense
    max_position_embeddings=64,
  )
  kw.update(overrides)
  model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kw)).eval()
  randomise(model, std)
  model.save_pretrained(folder)
  return model


def randomise(module, std):
  with torch.no_grad():
    for name, p in module.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      else:
        p.normal_(0.0, std)


def logits_of(model, tokens):
  call = jax.jit(lambda t: model(t))
  return np.asarray(call(jnp.asarray(tokens, jnp.int32)))


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
  with torch.no_grad():
    want = ref(torch.tensor(toks)).logits.numpy()
  np.testing.assert_allclose(logits_of(ours, toks), want, atol=1e-4, rtol=1e-4)


def test_cached_decode_matches_transformers(tmp_path):
  """Prefill then token-by-token decode over the latent cache (absorbed path) == HF logits."""
  ref = build_hf(tmp_path, rope_parameters=YARN)
  ours = hf.load(tmp_path)
  toks = np.random.RandomState(1).randint(0, V, (2, 24))
  with torch.no_grad():
    want = ref(torch.tensor(toks)).logits.numpy()
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
  tensors = load_file(str(tmp_path / "model.safetensors"))
  for j, layer in enumerate(layers):
    randomise(layer, 0.2)
    for name, p in layer.state_dict().items():
      name = name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
      tensors[f"model.layers.{L + j}.{name}"] = p.contiguous()
    # Checkpoints repeat the shared embedding and head in every MTP layer; they are not read.
    tensors[f"model.layers.{L + j}.embed_tokens.weight"] = (
      ref.model.embed_tokens.weight.data.clone()
    )
    tensors[f"model.layers.{L + j}.shared_head.head.weight"] = ref.lm_head.weight.data.clone()
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  config = json.loads((tmp_path / "config.json").read_text())
  config["num_nextn_predict_layers"] = J
  (tmp_path / "config.json").write_text(json.dumps(config))

  ours = hf.load(tmp_path)
  assert ours.cfg.mtp.kind == "sequential" and ours.cfg.mtp.n_predict == J
  T = 20
  toks = np.random.RandomState(2).randint(0, V, (2, T))
  main, mtp = jax.jit(lambda t: ours.forward_mtp(t))(jnp.asarray(toks, jnp.int32))

  with torch.no_grad():
    tt = torch.tensor(toks)
    h = ref.model(tt).last_hidden_state  # normalised: what MtpModel receives
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    for j, layer in enumerate(layers, start=1):
      emb = ref.model.embed_tokens(torch.roll(tt, -j, dims=1))
      pos = torch.arange(T)[None] + j
      h = layer(
        emb,
        h,
        position_embeddings=ref.model.rotary_emb(emb, pos),
        attention_mask=mask,
        position_ids=pos,
        cache=None,
      )
      want = ref.lm_head(h).numpy()
      np.testing.assert_allclose(np.asarray(mtp[j - 1]), want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(main), ref(tt).logits.numpy(), atol=1e-4, rtol=1e-4)


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
  with torch.no_grad():
    want = back(torch.tensor(toks)).logits.numpy()
  np.testing.assert_allclose(logits_of(model, toks), want, atol=1e-4, rtol=1e-4)
  again = hf.load(tmp_path)
  assert again.cfg == dataclasses.replace(cfg, init_std=again.cfg.init_std)
  t = jnp.asarray(toks, jnp.int32)
  np.testing.assert_array_equal(
    np.asarray(again.forward_mtp(t)[1]), np.asarray(model.forward_mtp(t)[1])
  )
