"""Hugging Face parity for the mixture-of-experts families: tiny random transformers models of
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2 and DeepSeek-V3 load with transformers' logits
(per-expert and fused expert layouts, float32 and bfloat16), and export back to transformers."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from atlas_jax import hf  # noqa: E402
from tests.hf_reference import (  # noqa: E402
  build,
  hf_greedy,
  hf_logits,
  jit_logits,
  mtp_logits,
  randomise,
  store_mtp_layers,
)

V = 97
COMMON = dict(
  vocab_size=V,
  hidden_size=32,
  intermediate_size=40,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=128,
)
MLA = dict(
  num_key_value_heads=4,
  kv_lora_rank=16,
  q_lora_rank=None,
  qk_rope_head_dim=8,
  qk_nope_head_dim=8,
  v_head_dim=8,
)
FAMILIES = {
  "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
  "qwen2_moe-shared-gated-dense-layer": (
    "Qwen2Moe",
    dict(
      num_experts=4,
      num_experts_per_tok=2,
      moe_intermediate_size=16,
      shared_expert_intermediate_size=24,
      mlp_only_layers=[1],
    ),
  ),
  "qwen3_moe-sparse-step-2": (
    "Qwen3Moe",
    dict(
      num_experts=6,
      num_experts_per_tok=2,
      moe_intermediate_size=16,
      norm_topk_prob=True,
      head_dim=16,
      decoder_sparse_step=2,
    ),
  ),
  "olmoe": ("Olmoe", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=16)),
  "deepseek_v2-group-limited": (
    "DeepseekV2",
    dict(
      **MLA,
      n_routed_experts=8,
      num_experts_per_tok=2,
      moe_intermediate_size=16,
      n_shared_experts=2,
      first_k_dense_replace=1,
      topk_method="group_limited_greedy",
      n_group=4,
      topk_group=2,
      routed_scaling_factor=2.0,
    ),
  ),
  "deepseek_v3-noaux-tc": (
    "DeepseekV3",
    dict(
      **MLA,
      n_routed_experts=8,
      num_experts_per_tok=2,
      moe_intermediate_size=16,
      n_shared_experts=1,
      first_k_dense_replace=1,
      n_group=4,
      topk_group=2,
      norm_topk_prob=True,
      routed_scaling_factor=2.5,
    ),
  ),
}


def build_hf(family, overrides, folder, *, std=0.2, fused=False):
  """A tiny random `family` model of COMMON updated by `overrides`, DeepSeek-V3's selection bias
  drawn too; `fused`: the experts saved as transformers v5 holds them (gate_up_proj, down_proj)."""
  config = {**COMMON, **overrides}
  return build(family, folder, config, std=std, save_original_format=not fused)


TOKENS = np.random.RandomState(0).randint(0, V, (2, 19))


@pytest.mark.parametrize("case", list(FAMILIES))
def test_logits_match_transformers_and_export_round_trips(case, tmp_path):
  family, overrides = FAMILIES[case]
  ref = build_hf(family, overrides, tmp_path / "a")
  model = hf.load(tmp_path / "a")
  assert model.cfg.moe is not None and any(model.cfg.sparse_layers())
  got = jit_logits(model, TOKENS)
  np.testing.assert_allclose(got, hf_logits(ref, TOKENS), atol=1e-4, rtol=1e-4)
  # Export: transformers loads our folder to the same logits; we load it back exactly.
  hf.save(model, tmp_path / "b")
  stored = load_file(str(tmp_path / "b" / "model.safetensors"))
  assert set(stored) == set(load_file(str(tmp_path / "a" / "model.safetensors")))
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
  np.testing.assert_allclose(hf_logits(back, TOKENS), got, atol=1e-4, rtol=1e-4)
  assert np.abs(jit_logits(hf.load(tmp_path / "b"), TOKENS) - got).max() == 0


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe-sparse-step-2", "deepseek_v3-noaux-tc"])
def test_fused_expert_layout_loads(case, tmp_path):
  """transformers v5 saves `mlp.experts.gate_up_proj` [E, 2F, D] and `down_proj` [E, D, F]."""
  family, overrides = FAMILIES[case]
  ref = build_hf(family, overrides, tmp_path, fused=True)
  names = set(load_file(str(tmp_path / "model.safetensors")))
  assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
  np.testing.assert_allclose(
    jit_logits(hf.load(tmp_path), TOKENS), hf_logits(ref, TOKENS), atol=1e-4, rtol=1e-4
  )


@pytest.mark.parametrize("case", ["mixtral", "deepseek_v3-noaux-tc"])
def test_bfloat16_load(case, tmp_path):
  """bf16 weights and compute against transformers in float32; the routers stay float32."""
  family, overrides = FAMILIES[case]
  ref = build_hf(family, overrides, tmp_path, std=0.05)
  model = hf.load(tmp_path, dtype="bfloat16")
  state = model.blocks.mlp
  assert state.w_gate[...].dtype == jnp.bfloat16 and state.router[...].dtype == jnp.float32
  want = hf_logits(ref, TOKENS)
  assert np.abs(want).max() > 0.5  # logits well above the tolerance
  np.testing.assert_allclose(jit_logits(model, TOKENS), want, atol=0.03)


def test_deepseek_v3_moe_mtp_layer_matches_transformers_mtp_layer(tmp_path):
  """The MTP module stored as layer L is an MoE decoder layer (as transformers' MtpLayer with
  layer_idx = L builds it): it loads into the sequential head; logits == HF's MtpLayer."""
  from transformers.modeling_layers import MtpLayer
  from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

  family, overrides = FAMILIES["deepseek_v3-noaux-tc"]
  ref = build_hf(family, overrides, tmp_path)
  L = ref.config.num_hidden_layers
  layer = MtpLayer(ref.config, ds.DeepseekV3DecoderLayer, ds.DeepseekV3RMSNorm, L).eval()
  torch.manual_seed(1)
  randomise(layer, 0.2)
  # transformers saves the experts per expert; the MtpLayer's state dict holds them fused.
  store_mtp_layers(tmp_path, ref, [layer])

  model = hf.load(tmp_path)
  assert model.cfg.mtp.n_predict == 1 and model.mtp.heads.block.mlp.score_bias is not None
  T = 12
  main, mtp = jax.jit(lambda t: model.forward_mtp(t))(jnp.asarray(TOKENS[:, :T], jnp.int32))
  (want,) = mtp_logits(ref, [layer], TOKENS[:, :T])
  np.testing.assert_allclose(np.asarray(mtp[0]), want, atol=1e-4)
  np.testing.assert_allclose(np.asarray(main), hf_logits(ref, TOKENS[:, :T]), atol=1e-4)
  # Export keeps the module: a trained MTP head round-trips.
  hf.save(model, tmp_path / "b")
  again = hf.load(tmp_path / "b")
  _, mtp_again = jax.jit(lambda t: again.forward_mtp(t))(jnp.asarray(TOKENS[:, :T], jnp.int32))
  assert np.abs(np.asarray(mtp_again) - np.asarray(mtp)).max() == 0


def test_greedy_generation_matches_transformers(tmp_path):
  from atlas_jax.decoding.generate import SamplingParams, generate

  family, overrides = FAMILIES["deepseek_v2-group-limited"]
  ref = build_hf(family, overrides, tmp_path, std=0.3)
  model = hf.load(tmp_path)
  prompts = [[5, 17, 3, 90, 42, 8, 1], [60, 2, 33]]
  got = generate(model, prompts, SamplingParams(max_new_tokens=12))
  assert got == [hf_greedy(ref, prompt, 12) for prompt in prompts]


@pytest.mark.parametrize(
  "change, match",
  [
    ({"topk_method": "noaux_tc"}, r"deepseek_v2 with topk_method='noaux_tc' is not supported"),
    ({"norm_topk_prob": True}, r"deepseek_v2 with norm_topk_prob=True is not supported"),
    ({"moe_layer_freq": 2}, r"moe_layer_freq=2 is not supported"),
    ({"n_group": 3}, r"model\.moe\.n_group=3 is not allowed: must divide model\.moe\.n_experts=8"),
    ({"num_experts_per_tok": "2"}, r"field 'num_experts_per_tok'='2' .* must be an integer"),
  ],
)
def test_moe_config_errors_name_the_field(tmp_path, change, match):
  family, overrides = FAMILIES["deepseek_v2-group-limited"]
  build_hf(family, overrides, tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  config.update(change)
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(hf.HFLoadError, match=match):
    hf.load(tmp_path)


def test_missing_expert_is_named(tmp_path):
  family, overrides = FAMILIES["mixtral"]
  build_hf(family, overrides, tmp_path)
  tensors = load_file(str(tmp_path / "model.safetensors"))
  del tensors["model.layers.2.block_sparse_moe.experts.3.w2.weight"]
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(
    hf.HFLoadError, match=r"missing tensors: .*layers\.2\.block_sparse_moe\.experts\.3\.w2"
  ):
    hf.load(tmp_path)
