"""GLM-4.5 MoE (glm4_moe) against transformers: q/k/v biases, per-head QK-norm, half of each head
rotated, a dense first layer, then sigmoid-routed experts with a selection bias over expert groups
and a shared expert; logits, greedy generation, the fused expert layout, the stored MTP module
(against transformers' MtpLayer) and export back."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from atlas_jax import hf  # noqa: E402
from atlas_jax.decoding.generate import SamplingParams, generate  # noqa: E402
from tests.hf_reference import (  # noqa: E402
  TINY,
  build,
  check_engine_greedy,
  check_fine_tuning,
  hf_greedy,
  hf_logits,
  jit_logits,
  mtp_logits,
  randomise,
  store_mtp_layers,
)

V = TINY["vocab_size"]
GLM = dict(
  TINY,
  num_hidden_layers=4,
  head_dim=32,  # partial_rotary_factor 0.5: 16 dims of each head rotate
  partial_rotary_factor=0.5,
  attention_bias=True,
  use_qk_norm=True,
  first_k_dense_replace=1,
  n_routed_experts=8,
  num_experts_per_tok=2,
  moe_intermediate_size=24,
  n_shared_experts=1,
  n_group=4,  # 2 experts per group; a token picks from the 2 best groups
  topk_group=2,
  norm_topk_prob=True,
  routed_scaling_factor=2.5,
  pad_token_id=0,
)
TOKENS = np.random.RandomState(0).randint(0, V, (2, 21))


def build_hf(folder, *, std=0.2, fused=False, **overrides):
  """A tiny random GLM, its selection bias drawn too; `fused`: the experts saved as transformers
  v5 holds them (gate_up_proj, down_proj)."""
  return build("Glm4Moe", folder, {**GLM, **overrides}, std=std, save_original_format=not fused)


def test_config_fields(tmp_path):
  build_hf(tmp_path)
  cfg = hf.load_config(tmp_path)
  assert (cfg.head_dim, cfg.rotary_dim, cfg.qkv_bias, cfg.qk_norm) == (32, 16, True, True)
  m = cfg.moe
  assert (m.scoring, m.topk_method, m.n_group, m.topk_group) == ("sigmoid", "noaux_tc", 4, 2)
  assert (m.shared_ffn_dim, m.routed_scaling_factor, m.norm_topk_prob) == (24, 2.5, True)
  assert cfg.sparse_layers() == (False, True, True, True) and cfg.mtp is None


@pytest.mark.parametrize(
  "fused", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["per-expert", "fused"]
)
def test_logits_match_transformers(fused, tmp_path):
  """Both stored layouts of the experts (transformers v5 writes either)."""
  ref = build_hf(tmp_path, fused=fused)
  names = set(load_file(str(tmp_path / "model.safetensors")))
  assert ("model.layers.1.mlp.experts.gate_up_proj" in names) == fused
  model = hf.load(tmp_path)
  # The selection bias reaches the router (layer 1 is the first MoE layer: blocks[0]).
  bias = ref.model.layers[1].mlp.gate.e_score_correction_bias.numpy()
  np.testing.assert_array_equal(np.asarray(model.blocks.mlp.score_bias[...])[0], bias)
  for T in (1, 9, 21):
    got = jit_logits(model, TOKENS[:, :T])
    np.testing.assert_allclose(got, hf_logits(ref, TOKENS[:, :T]), atol=2e-4, rtol=1e-4)


def test_greedy_generation_matches_transformers(tmp_path):
  ref = build_hf(tmp_path, std=0.3)
  model = hf.load(tmp_path)
  prompts = [[5, 17, 3, 90, 42, 8, 1], [60, 2, 33]]
  got = generate(model, prompts, SamplingParams(max_new_tokens=12))
  assert got == [hf_greedy(ref, prompt, 12) for prompt in prompts]


# Under -m slow: `generate` covers GLM's cache in the default run, test_serve_moe the engine's
# paged pool under MoE models, and test_mesh experts split over the tensor axis.
@pytest.mark.slow
@pytest.mark.parametrize("tensor", [1, 2])
def test_the_engine_serves_transformers_greedy_tokens(tensor, tmp_path):
  """The paged pool and ragged steps (chunked prefill), on one device and with the heads and the
  experts' hidden dims split over two."""
  ref = build_hf(tmp_path, std=0.3)
  model = hf.load(tmp_path)
  rng = np.random.RandomState(1)
  prompts = [rng.randint(3, V, n).tolist() for n in (19, 5, 11)]
  check_engine_greedy(model, ref, prompts, 10, tensor_parallel_size=tensor)


def test_save_round_trips_through_transformers(tmp_path):
  build_hf(tmp_path / "a")
  model = hf.load(tmp_path / "a")
  hf.save(model, tmp_path / "b")
  written = json.loads((tmp_path / "b" / "config.json").read_text())
  assert written["model_type"] == "glm4_moe"
  stored = load_file(str(tmp_path / "b" / "model.safetensors"))
  assert set(stored) == set(load_file(str(tmp_path / "a" / "model.safetensors")))
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
  assert isinstance(back, transformers.Glm4MoeForCausalLM)
  got = jit_logits(model, TOKENS)
  np.testing.assert_allclose(hf_logits(back, TOKENS), got, atol=2e-4, rtol=1e-4)
  again = hf.load(tmp_path / "b")
  assert again.cfg == model.cfg
  assert np.abs(jit_logits(again, TOKENS) - got).max() == 0


@pytest.mark.slow
def test_fine_tuning_with_lora_under_an_expert_mesh_exports_to_transformers(tmp_path):
  """train.init_from a GLM folder, LoRA on q/v/o by their Hugging Face names, fsdp 2 x expert 2
  x tensor 2: the step-0 model gives the folder's logits, the loss falls, and the merged model
  saves as glm4_moe that transformers reads to our logits."""
  from flax import nnx

  from atlas_jax.model.lora import merged_params

  build_hf(tmp_path / "a")
  lora = "train.lora={rank: 4, targets: [q_proj, v_proj, o_proj]}"
  mesh = ("mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2")
  trainer, state, toks, want = check_fine_tuning(tmp_path / "a", lora, *mesh, seq_len=16, steps=3)
  tuned = nnx.merge(trainer.graphdef, state.params)
  merged = hf.build_model(trainer.cfg.model, jax.device_get(merged_params(tuned)))
  hf.save(merged, tmp_path / "b")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
  tuned_logits = np.asarray(tuned(toks[:2, :16]))
  assert np.abs(tuned_logits - want).max() > 1e-2  # the adapters moved the model
  np.testing.assert_allclose(hf_logits(back, toks[:2, :16]), tuned_logits, atol=2e-4, rtol=2e-4)


def test_whole_head_rotary_exports_its_factor(tmp_path):
  """partial_rotary_factor 1 is written out: left out, Glm4MoeConfig would read 0.5."""
  build_hf(tmp_path / "a", partial_rotary_factor=1.0, use_qk_norm=False, attention_bias=False)
  model = hf.load(tmp_path / "a")
  assert model.cfg.rotary_dim == 32
  hf.save(model, tmp_path / "b")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
  np.testing.assert_allclose(
    hf_logits(back, TOKENS), jit_logits(model, TOKENS), atol=2e-4, rtol=1e-4
  )


def with_mtp_module(tmp_path):
  """A checkpoint as GLM-4.5 releases it: its MTP module stored as layer L (an MoE layer, as
  transformers' MtpLayer builds it). Returns (the main model, the MtpLayer)."""
  from transformers.modeling_layers import MtpLayer
  from transformers.models.glm4_moe import modeling_glm4_moe as glm

  ref = build_hf(tmp_path)
  assert ref.config.num_nextn_predict_layers == 1  # Glm4MoeConfig's default
  L = ref.config.num_hidden_layers
  layer = MtpLayer(ref.config, glm.Glm4MoeDecoderLayer, glm.Glm4MoeRMSNorm, L).eval()
  torch.manual_seed(1)
  randomise(layer, 0.2)
  store_mtp_layers(tmp_path, ref, [layer])
  return ref, layer


def test_mtp_module_loads_and_matches_transformers_mtp_layer(tmp_path):
  """Glm4MoeForCausalLM skips the stored MTP module; we load it into the sequential head (its
  logits equal MtpLayer's), and export keeps it."""
  ref, layer = with_mtp_module(tmp_path)
  model = hf.load(tmp_path)
  assert model.cfg.mtp.kind == "sequential" and model.cfg.mtp.n_predict == 1
  T = 12
  toks = jnp.asarray(TOKENS[:, :T], jnp.int32)
  main, mtp = jax.jit(lambda t: model.forward_mtp(t))(toks)
  (want,) = mtp_logits(ref, [layer], TOKENS[:, :T])
  np.testing.assert_allclose(np.asarray(mtp[0]), want, atol=2e-4)
  np.testing.assert_allclose(np.asarray(main), hf_logits(ref, TOKENS[:, :T]), atol=2e-4)
  # Export writes the module back.
  hf.save(model, tmp_path / "b")
  written = json.loads((tmp_path / "b" / "config.json").read_text())
  assert written["num_nextn_predict_layers"] == 1
  again = hf.load(tmp_path / "b")
  assert np.abs(np.asarray(jax.jit(lambda t: again.forward_mtp(t))(toks)[1]) - mtp).max() == 0


@pytest.mark.slow
def test_self_speculation_with_the_stored_mtp_module(tmp_path):
  """Drafting with the loaded head gives the greedy tokens of plain decoding."""
  with_mtp_module(tmp_path)
  model = hf.load(tmp_path)
  prompts = [[5, 17, 3, 90, 42], [60, 2, 33]]
  params = SamplingParams(max_new_tokens=8)
  want = generate(model, prompts, params)
  assert generate(model, prompts, params, draft="mtp", num_speculative_tokens=1) == want


def config_json(tmp_path, **changes):
  build_hf(tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  for key, value in changes.items():
    if value is None:
      config.pop(key, None)
    else:
      config[key] = value
  return config


def test_partial_rotary_factor_as_transformers_reads_it(tmp_path):
  """The rope dict's factor wins over the top-level one; with neither, Glm4MoeConfig's 0.5."""
  config = config_json(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
  config.pop("partial_rotary_factor", None)
  assert hf.config_from_hf(config).partial_rotary_factor == 0.5
  config["partial_rotary_factor"] = 0.25
  assert hf.config_from_hf(config).partial_rotary_factor == 0.25
  config["rope_parameters"]["partial_rotary_factor"] = 1.0
  assert hf.config_from_hf(config).partial_rotary_factor == 1.0


@pytest.mark.parametrize(
  "changes, match",
  [
    ({"n_group": 3}, r"model\.moe\.n_group=3 .*must divide model\.moe\.n_experts=8"),
    ({"first_k_dense_replace": -1}, r"'first_k_dense_replace'=-1 must be >= 0"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"n_routed_experts": None}, r"lacks the field 'n_routed_experts'"),
  ],
)
def test_bad_config_is_refused_naming_the_field(changes, match, tmp_path):
  with pytest.raises(hf.HFLoadError, match=match):
    hf.config_from_hf(config_json(tmp_path, **changes))


# zai-org/GLM-4.5-Air's config.json (the fields the import reads).
GLM45_AIR = {
  "architectures": ["Glm4MoeForCausalLM"],
  "model_type": "glm4_moe",
  "attention_bias": True,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "partial_rotary_factor": 0.5,
  "intermediate_size": 10944,
  "max_position_embeddings": 131072,
  "moe_intermediate_size": 1408,
  "norm_topk_prob": True,
  "num_attention_heads": 96,
  "n_group": 1,
  "topk_group": 1,
  "n_routed_experts": 128,
  "n_shared_experts": 1,
  "routed_scaling_factor": 1.0,
  "num_experts_per_tok": 8,
  "first_k_dense_replace": 1,
  "num_hidden_layers": 46,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_scaling": None,
  "rope_theta": 1000000,
  "num_nextn_predict_layers": 1,
  "tie_word_embeddings": False,
  "use_qk_norm": False,
  "vocab_size": 151552,
}


def test_glm45_air_config_is_the_planner_preset():
  """The released config.json, with its MTP layer (46) stored, maps onto the planner's
  `glm-4.5-air`; every stored tensor's shape follows (transformers' names, 46 + 1 layers)."""
  import dataclasses

  from atlas_jax.plan.models import REFERENCE_MODELS

  names = {"model.layers.46.enorm.weight"}
  cfg = hf.config_from_hf(GLM45_AIR, dtype="bfloat16", names=names)
  preset = REFERENCE_MODELS["glm-4.5-air"].model
  assert cfg == dataclasses.replace(preset, init_std=cfg.init_std)
  shapes = hf.tensor_shapes(GLM45_AIR, names)
  assert shapes["model.layers.0.mlp.gate_proj.weight"] == (10944, 4096)
  assert shapes["model.layers.1.self_attn.q_proj.bias"] == (96 * 128,)
  assert shapes["model.layers.46.mlp.experts.127.down_proj.weight"] == (4096, 1408)
  assert shapes["model.layers.46.mlp.gate.e_score_correction_bias"] == (128,)
  # Export writes the released fields back, a training run's expert capacity aside.
  trained = dataclasses.replace(preset, moe=dataclasses.replace(preset.moe, capacity_factor=1.25))
  written = hf.config_to_hf(trained)
  assert {k: written[k] for k in GLM45_AIR} == GLM45_AIR
