"""gpt-oss against transformers: attention sinks, q/k/v/o biases, alternating sliding and full
layers, YaRN (truncate false), a biased router (softmax over the top k) and biased experts with
the clamped SwiGLU. Logits for prompts several windows long, greedy generation through the cache,
export back, and the engine's paged serving."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from atlas_jax import hf  # noqa: E402
from atlas_jax.config import ConfigError, ModelConfig, MoEConfig  # noqa: E402
from atlas_jax.hf.common import HFLoadError  # noqa: E402
from tests.hf_reference import (  # noqa: E402
  TINY,
  build,
  check_engine_greedy,
  check_fine_tuning,
  check_past_the_window,
  hf_logits,
)

V = TINY["vocab_size"]
W = 8  # the sliding window: the prompts below are several windows long
GPT_OSS = dict(
  TINY,
  intermediate_size=48,
  num_hidden_layers=4,
  head_dim=16,
  num_local_experts=4,
  num_experts_per_tok=2,
  sliding_window=W,
  swiglu_limit=1.5,  # low enough that the clamps act on these activations
  rope_parameters={
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
  },
  pad_token_id=0,
  bos_token_id=1,
  eos_token_id=2,
)


def build_hf(folder, **overrides):
  """A tiny random gpt-oss, every weight drawn (sinks and biases too), norms around 1."""
  return build("GptOss", folder, {**GPT_OSS, **overrides}, attention="eager")


def test_logits_generation_and_export_match_transformers(tmp_path):
  ref = build_hf(tmp_path / "hf")
  ours = hf.load(tmp_path / "hf")
  cfg = ours.cfg
  assert cfg.attention_sinks and cfg.attn_out_bias and cfg.qkv_bias
  assert cfg.moe.router_bias and cfg.moe.expert_bias and cfg.moe.swiglu_limit == 1.5
  assert cfg.rope_scaling.type == "yarn" and not cfg.rope_scaling.truncate
  kinds, index = cfg.attention_kinds()
  assert [kinds[i].sliding_window for i in index] == [W, None, W, None]
  check_past_the_window(ref, ours, tmp_path / "out", W)


def test_an_mxfp4_folder_loads_as_transformers_dequantizes_it(tmp_path):
  """The released layout: experts as u8 `*_blocks` [E, out, in / 32, 16] and `*_scales`
  [E, out, in / 32], dequantized at load; the reference is transformers' float model holding
  transformers' own dequantization of the same bytes."""
  import json

  from safetensors.numpy import load_file, save_file
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors

  F, D, E = 64, 64, 4  # in / 32 whole for both projections
  ref = build_hf(tmp_path / "hf", intermediate_size=F, num_hidden_layers=2)
  rng = np.random.RandomState(3)
  stored = {}
  for i, layer in enumerate(ref.model.layers):
    for proj, (out, inp) in (("gate_up_proj", (2 * F, D)), ("down_proj", (D, F))):
      blocks = rng.randint(0, 256, (E, out, inp // 32, 16)).astype(np.uint8)
      scales = rng.randint(122, 126, (E, out, inp // 32)).astype(np.uint8)
      name = f"model.layers.{i}.mlp.experts.{proj}"
      stored[name + "_blocks"], stored[name + "_scales"] = blocks, scales
      w = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
      )
      with torch.no_grad():
        getattr(layer.mlp.experts, proj).copy_(w)
  folder = tmp_path / "mxfp4"
  ref.save_pretrained(folder)
  (file,) = folder.glob("*.safetensors")
  tensors = load_file(file)
  for name in stored:
    tensors.pop(name.rsplit("_", 1)[0], None)
  save_file({**tensors, **stored}, file, metadata={"format": "pt"})
  config = json.loads((folder / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "mxfp4"}
  (folder / "config.json").write_text(json.dumps(config))

  ours = hf.load(folder)
  toks = np.random.RandomState(0).randint(0, V, (2, 2 * W + 5))
  want = hf_logits(ref, toks)
  np.testing.assert_allclose(np.asarray(ours(toks)), want, atol=2e-4 * np.abs(want).max())

  config["quantization_config"] = {"quant_method": "bitsandbytes"}
  with pytest.raises(HFLoadError, match="quant_method='bitsandbytes'"):
    hf.config_from_hf(config)


def test_bad_fields_name_themselves():
  with pytest.raises(ConfigError, match="model.moe.swiglu_limit=0.0"):
    MoEConfig(swiglu_limit=0.0)
  with pytest.raises(ConfigError, match="model.moe.swiglu_alpha=-1.0"):
    MoEConfig(swiglu_alpha=-1.0)
  from atlas_jax.config import MLAConfig

  with pytest.raises(ConfigError, match="model.attention_sinks=True"):
    ModelConfig(mla=MLAConfig(), attention_sinks=True)


@pytest.mark.parametrize(
  "runner, tensor",
  # One device under -m slow: the tensor-2 case runs the same pools, sinks and experts.
  [
    pytest.param("ragged", 1, marks=pytest.mark.slow),
    ("ragged", 2),
    pytest.param("cpu", 1, marks=pytest.mark.slow),
  ],
)
def test_the_engine_serves_transformers_greedy_tokens_past_the_window(runner, tensor, tmp_path):
  """The paged pool (ragged steps, chunked prefill) with sinks in the kernel, sliding and full
  layers, biased experts; on one device, and with the heads (and their sinks) and the experts'
  width split over two."""
  ref = build_hf(tmp_path, num_hidden_layers=2)
  ours = hf.load(tmp_path)
  rng = np.random.RandomState(1)
  prompts = [rng.randint(3, V, n).tolist() for n in (2 * W + 3, 5, 3 * W)]
  check_engine_greedy(ours, ref, prompts, W + 4, runner=runner, tensor_parallel_size=tensor)


def test_the_planner_holds_every_gpt_oss_parameter_with_its_axes():
  """gpt-oss-20b at full size (`jax.eval_shape`, nothing allocated): the planner's inventory has
  the real modules' shapes and logical axes, sinks and biases included; the experts' biases count
  among the routed experts (k / E of them active)."""
  import jax
  from flax import nnx

  from atlas_jax import measure
  from atlas_jax.plan import params
  from atlas_jax.plan.models import REFERENCE_MODELS
  from atlas_jax.training import sharding as shd

  cfg = REFERENCE_MODELS["gpt-oss-20b"].model
  planned = sorted((p.shape, p.axes) for p in params.inventory(cfg))
  state = nnx.state(measure.abstract_model(cfg))
  leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert planned == sorted((tuple(v.shape), shd.logical_axes_of(v)) for v in leaves)
  pc = params.counts(cfg)
  E, F, D, L = 32, 2880, 2880, 24
  assert pc.experts == L * E * (3 * D * F + 2 * F + D)


# openai/gpt-oss-20b's released config.json (the fields its loader reads, and a few it ignores).
RELEASED_20B = {
  "architectures": ["GptOssForCausalLM"],
  "attention_bias": True,
  "eos_token_id": 200002,
  "experts_per_token": 4,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2880,
  "initial_context_length": 4096,
  "intermediate_size": 2880,
  "layer_types": ["sliding_attention", "full_attention"] * 12,
  "max_position_embeddings": 131072,
  "model_type": "gpt_oss",
  "num_attention_heads": 64,
  "num_experts_per_tok": 4,
  "num_hidden_layers": 24,
  "num_key_value_heads": 8,
  "num_local_experts": 32,
  "pad_token_id": 199999,
  "quantization_config": {
    "modules_to_not_convert": [
      "model.layers.*.self_attn",
      "model.layers.*.mlp.router",
      "model.embed_tokens",
      "lm_head",
    ],
    "quant_method": "mxfp4",
  },
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "rope_type": "yarn",
    "truncate": False,
  },
  "rope_theta": 150000,
  "sliding_window": 128,
  "swiglu_limit": 7.0,
  "tie_word_embeddings": False,
  "torch_dtype": "bfloat16",
  "vocab_size": 201088,
}


def test_the_released_20b_config_is_the_planners_preset():
  import dataclasses

  from atlas_jax.plan.models import REFERENCE_MODELS

  cfg = hf.config_from_hf(RELEASED_20B, dtype="bfloat16")
  assert cfg == dataclasses.replace(REFERENCE_MODELS["gpt-oss-20b"].model, dtype="bfloat16")


@pytest.mark.slow
def test_training_a_gpt_oss_folder_under_a_mesh(tmp_path):
  """train.init_from a gpt-oss folder under fsdp 2 x expert 2 x tensor 2 (sinks split with the
  heads, the experts' biases with the experts and their width): the step-0 model gives the
  folder's logits; the loss falls."""
  build_hf(tmp_path, num_hidden_layers=2)
  check_fine_tuning(tmp_path, "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2", seq_len=24, steps=4)
