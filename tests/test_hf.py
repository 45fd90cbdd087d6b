"""Hugging Face parity: tiny random transformers models load with equal logits and generations."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from atlas_jax import hf  # noqa: E402
from atlas_jax.decoding.generate import SamplingParams, generate  # noqa: E402
from tests.hf_reference import TINY, build, hf_greedy, hf_logits  # noqa: E402

V = TINY["vocab_size"]
LLAMA3_ROPE = {
  "rope_type": "llama3",
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 16,
}


def build_hf(family: str, folder, *, std: float = 0.2, max_shard_size=None, **overrides):
  """A tiny random model of `family`, every weight (biases and norms too) drawn at random."""
  save = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  return build(family, folder, {**TINY, **overrides}, std=std, **save)


CASES = {
  "llama-gqa2": ("Llama", {}),
  "llama-mha": ("Llama", {"num_key_value_heads": 4}),
  "llama-gqa4-tied-rope3": (
    "Llama",
    {"num_attention_heads": 8, "tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE},
  ),
  "mistral": ("Mistral", {"sliding_window": None}),
  "qwen2-bias-tied": ("Qwen2", {"tie_word_embeddings": True}),
  "qwen2-mqa": ("Qwen2", {"num_key_value_heads": 1}),
  "qwen3-qknorm": ("Qwen3", {"head_dim": 32}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
  family, overrides = CASES[case]
  ref_model = build_hf(family, tmp_path, **overrides)
  ours = hf.load(tmp_path)
  assert ours.cfg.n_heads // ours.cfg.n_kv_heads == (
    overrides.get("num_attention_heads", 4) // overrides.get("num_key_value_heads", 2)
  )
  rng = np.random.RandomState(0)
  for T in (1, 7, 33, 70):
    toks = rng.randint(0, V, (2, T))
    got = np.asarray(ours(jnp.asarray(toks, jnp.int32)))
    want = hf_logits(ref_model, toks)
    assert np.abs(got - want).max() <= 1e-4, (case, T, np.abs(got - want).max())


@pytest.mark.parametrize("case", ["llama-gqa4-tied-rope3", "qwen2-bias-tied"])
def test_greedy_generation_matches_transformers(case, tmp_path):
  family, overrides = CASES[case]
  ref_model = build_hf(family, tmp_path, std=0.3, **overrides)
  ours = hf.load(tmp_path)
  prompts = [[5, 17, 3, 99, 42, 8, 1], [60, 2, 33]]
  got = generate(ours, prompts, SamplingParams(max_new_tokens=32))
  assert got == [hf_greedy(ref_model, prompt, 32) for prompt in prompts]


def test_sharded_checkpoint(tmp_path):
  ref_model = build_hf("Llama", tmp_path, max_shard_size="40KB")
  assert (tmp_path / "model.safetensors.index.json").is_file()
  assert len(list(tmp_path.glob("*.safetensors"))) > 1
  toks = np.arange(12)[None] % V
  got = np.asarray(hf.load(tmp_path)(jnp.asarray(toks, jnp.int32)))
  assert np.abs(got - hf_logits(ref_model, toks)).max() <= 1e-4


def test_bfloat16_load(tmp_path):
  ref_model = build_hf("Qwen2", tmp_path, std=0.05)
  ours = hf.load(tmp_path, dtype="bfloat16")
  assert ours.embed[...].dtype == jnp.bfloat16
  toks = np.arange(16)[None] % V
  got = np.asarray(ours(jnp.asarray(toks, jnp.int32)))
  np.testing.assert_allclose(got, hf_logits(ref_model, toks), atol=0.1)


def test_save_round_trips_through_transformers(tmp_path):
  build_hf("Qwen2", tmp_path / "a", tie_word_embeddings=True)
  ours = hf.load(tmp_path / "a")
  hf.save(ours, tmp_path / "b")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
  toks = np.arange(20)[None] % V
  want = np.asarray(ours(jnp.asarray(toks, jnp.int32)))
  assert np.abs(hf_logits(back, toks) - want).max() <= 1e-4
  assert np.abs(np.asarray(hf.load(tmp_path / "b")(jnp.asarray(toks, jnp.int32))) - want).max() == 0


def test_tokenizer_json_loads(tmp_path):
  from atlas_jax.data.tokenizer import HFTokenizer, train_bpe

  train_bpe(["def main():\n    return 0\n"] * 20, vocab_size=300).save(tmp_path / "tokenizer.json")
  tok = HFTokenizer(hf.load_tokenizer(tmp_path))
  assert tok.decode(tok.encode("def main():")) == "def main():"


# --- bad folders -------------------------------------------------------------------------------


def test_unsupported_architecture_is_named(tmp_path):
  (tmp_path / "config.json").write_text(
    json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
  )
  with pytest.raises(hf.HFLoadError, match="model_type='gpt2'.*supported model types: llama"):
    hf.load(tmp_path)


def test_missing_tensor_lists_what_was_expected(tmp_path):
  from safetensors.numpy import load_file, save_file

  build_hf("Llama", tmp_path)
  tensors = load_file(tmp_path / "model.safetensors")
  del tensors["model.layers.1.self_attn.k_proj.weight"]
  save_file(tensors, tmp_path / "model.safetensors")
  with pytest.raises(hf.HFLoadError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj"):
    hf.load(tmp_path)


def test_wrong_shape_is_named(tmp_path):
  build_hf("Llama", tmp_path)
  cfg = json.loads((tmp_path / "config.json").read_text())
  cfg["intermediate_size"] = 128
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  shapes = (
    r"tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape \(96, 64\) in the checkpoint, "
    r"but config\.json implies \(128, 64\) = \(intermediate_size, hidden_size\)"
  )
  with pytest.raises(hf.HFLoadError, match=shapes):
    hf.load(tmp_path)


def test_missing_folder_and_config(tmp_path):
  with pytest.raises(hf.HFLoadError, match="not a folder"):
    hf.load(tmp_path / "nope")
  with pytest.raises(hf.HFLoadError, match="no config.json"):
    hf.load(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
  with pytest.raises(hf.HFLoadError, match="lacks the field"):
    hf.load(tmp_path)
