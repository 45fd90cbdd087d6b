"""Hugging Face folders that are wrong in every way a user meets: each error names what is wrong."""

import json

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from atlas_jax import hf
from atlas_jax.config import ModelConfig
from atlas_jax.model.transformer import Transformer

# head_dim * n_heads (128) != d_model (64): a transposed projection still reshapes.
CFG = ModelConfig(
  vocab_size=50, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  path = tmp_path_factory.mktemp("hf")
  hf.save(Transformer(CFG, rngs=nnx.Rngs(0)), path)
  return path


def copy(folder, tmp_path, *, tensors=None, config=None):
  """A copy of the fixture folder with some tensors or config.json fields replaced."""
  stored = load_file(folder / "model.safetensors")
  stored.update({k: np.ascontiguousarray(v) for k, v in (tensors or {}).items()})
  save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
  cfg = json.loads((folder / "config.json").read_text())
  cfg.update(config or {})
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  return tmp_path


def test_the_fixture_loads(folder):
  assert hf.load(folder).cfg == CFG


@pytest.mark.parametrize(
  "name, change, match",
  [
    # Transposed, yet the element count would reshape: wrong logits without the check.
    (
      "model.layers.1.self_attn.o_proj.weight",
      lambda w: w.T,
      r"tensor model\.layers\.1\.self_attn\.o_proj\.weight has shape \(128, 64\) in the "
      r"checkpoint, but config\.json implies \(64, 128\) = \(hidden_size, num_attention_heads "
      r"\* head_dim\) \(stored transposed\?\)",
    ),
    (
      "model.layers.0.self_attn.q_proj.weight",
      lambda w: w.T,
      r"q_proj\.weight has shape \(64, 128\).*implies \(128, 64\).*transposed",
    ),
    (
      "model.layers.0.self_attn.k_proj.weight",
      lambda w: w[:-1],
      r"k_proj\.weight has shape \(63, 64\).*\(64, 64\) = \(num_key_value_heads \* head_dim",
    ),
    ("model.layers.1.input_layernorm.weight", lambda w: w[:-1], r"input_layernorm.*\(63,\)"),
    ("lm_head.weight", lambda w: w[:, :-2], r"lm_head\.weight has shape \(50, 62\)"),
  ],
)
def test_every_tensor_shape_is_checked_before_reshaping(folder, tmp_path, name, change, match):
  w = load_file(folder / "model.safetensors")[name]
  with pytest.raises(hf.HFLoadError, match=match):
    hf.load(copy(folder, tmp_path, tensors={name: change(w)}))


@pytest.mark.parametrize(
  "config, match",
  [
    (
      {"hidden_size": "64"},
      r"config\.json field 'hidden_size'='64' is not allowed: must be an int",
    ),
    ({"rms_norm_eps": "1e-5"}, r"field 'rms_norm_eps'='1e-5' .* must be a number"),
    ({"tie_word_embeddings": "no"}, r"field 'tie_word_embeddings'='no' .* true or false"),
    ({"num_key_value_heads": 2.0}, r"field 'num_key_value_heads'=2\.0 .* must be an integer"),
    ({"vocab_size": None}, r"config\.json lacks the field 'vocab_size'"),
    ({"rope_parameters": "linear"}, r"field 'rope_parameters'='linear' .* must be an object"),
    ({"rope_parameters": {"rope_type": "linear"}}, r"lacks the field 'rope_parameters\.factor'"),
    (  # transformers v4 configs: rope_scaling, and no rope_parameters
      {"rope_parameters": None, "rope_scaling": {"type": "linear"}},
      r"lacks the field 'rope_scaling\.factor'",
    ),
    (
      {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": "1"}},
      r"field 'rope_parameters\.low_freq_factor'='1'",
    ),
    ({"hidden_act": 3}, r"field 'hidden_act'=3 .* must be a string"),
    ({"num_attention_heads": 0}, r"'num_attention_heads'=0 must be > 0"),
  ],
)
def test_config_fields_are_named(folder, tmp_path, config, match):
  with pytest.raises(hf.HFLoadError, match=match):
    hf.load(copy(folder, tmp_path, config=config))


def test_config_that_is_not_an_object(tmp_path):
  (tmp_path / "config.json").write_text("[1, 2]")
  with pytest.raises(hf.HFLoadError, match=r"config\.json: expected a JSON object, got list"):
    hf.load(tmp_path)


def test_truncated_or_foreign_safetensors_name_the_file(folder, tmp_path):
  path = copy(folder, tmp_path)
  data = (path / "model.safetensors").read_bytes()
  for damaged in (data[: len(data) // 2], data[:5], b"\x00" * 64, b""):
    (path / "model.safetensors").write_bytes(damaged)
    with pytest.raises(hf.HFLoadError, match=r"model\.safetensors: not a readable safetensors"):
      hf.load(path)


def test_index_that_maps_nothing(folder, tmp_path):
  path = copy(folder, tmp_path)
  (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a"]}))
  with pytest.raises(hf.HFLoadError, match="'weight_map' must map tensor names to file names"):
    hf.load(path)


def test_broken_tokenizer_json_is_named(folder, tmp_path):
  path = copy(folder, tmp_path)
  (path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
  with pytest.raises(hf.HFLoadError, match=r"tokenizer\.json: not a readable tokenizer"):
    hf.load_tokenizer(path)


DEEPSEEK = {
  "model_type": "deepseek_v3",
  "vocab_size": 50,
  "hidden_size": 32,
  "intermediate_size": 48,
  "num_hidden_layers": 2,
  "num_attention_heads": 2,
  "kv_lora_rank": 16,
  "q_lora_rank": 24,
  "qk_rope_head_dim": 8,
  "qk_nope_head_dim": 12,
  "v_head_dim": 10,
  "max_position_embeddings": 64,
}


def deepseek_folder(path, *, transpose=None, **config):
  """A deepseek_v3 folder holding a tensor of the right shape under every expected name."""
  hf_config = {**DEEPSEEK, **config}
  rng = np.random.default_rng(0)
  tensors = {
    n: rng.normal(0, 0.1, shape).astype(np.float32)
    for n, shape in hf.tensor_shapes(hf_config).items()
  }
  if transpose:
    tensors[transpose] = np.ascontiguousarray(tensors[transpose].T)
  save_file(tensors, path / "model.safetensors")
  (path / "config.json").write_text(json.dumps(hf_config))
  return path


def test_deepseek_shapes_and_fields_are_checked(tmp_path):
  assert hf.load(deepseek_folder(tmp_path)).cfg.mla.kv_lora_rank == 16
  # kv_b_proj [N * (Hn + Hv), C] = (44, 16): transposed it still reshapes to [N, Hn + Hv, C].
  name = "model.layers.1.self_attn.kv_b_proj.weight"
  with pytest.raises(hf.HFLoadError, match=rf"tensor {name} has shape \(16, 44\).*transposed"):
    hf.load(deepseek_folder(tmp_path, transpose=name))
  with pytest.raises(hf.HFLoadError, match=r"field 'kv_lora_rank'='16' .* must be an integer"):
    hf.load(deepseek_folder(tmp_path, kv_lora_rank="16"))
  # YaRN's original context defaults to max_position_embeddings, as transformers reads it.
  yarn = {"rope_type": "yarn", "factor": 4.0}
  scaling = hf.load(deepseek_folder(tmp_path, rope_scaling=yarn)).cfg.rope_scaling
  assert (scaling.factor, scaling.original_max_position_embeddings) == (4.0, 64)
  with pytest.raises(hf.HFLoadError, match=r"'rope_scaling\.rope_type'='longrope' is not"):
    hf.load(deepseek_folder(tmp_path, rope_scaling={**yarn, "rope_type": "longrope"}))
