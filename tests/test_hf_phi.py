"""Phi-3 / Phi-4 and long-context RoPE on the GQA families against transformers: LongRoPE (short
and long factors), partial rotary dims, YaRN on Qwen3, both config.json forms of the rope fields;
logits for prompts inside and past the original context, greedy generations, export back."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from atlas_jax import hf  # noqa: E402
from atlas_jax.decoding.generate import SamplingParams, generate  # noqa: E402
from tests.hf_reference import hf_greedy, hf_logits  # noqa: E402
from tests.test_hf import V, build_hf  # noqa: E402

ORIGINAL = 16  # the original context; max_position_embeddings is 64
# Phi-3's head is hidden_size / heads = 16 dims; with partial_rotary_factor 0.75, 12 rotate: 6
# pairs, one short and one long factor each.
LONGROPE = {
  "rope_type": "longrope",
  "short_factor": [1.0, 1.1, 1.3, 1.7, 2.5, 4.0],
  "long_factor": [1.0, 1.5, 2.5, 4.0, 8.0, 16.0],
}
PHI = dict(
  max_position_embeddings=64,
  original_max_position_embeddings=ORIGINAL,
  pad_token_id=0,
  bos_token_id=1,
  eos_token_id=2,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}

CASES = {
  # Phi-4-mini's shape of rope: LongRoPE on 3/4 of each head (transformers v4's rope_scaling).
  "phi4-longrope-partial": (
    "Phi3",
    {**PHI, "rope_scaling": LONGROPE, "partial_rotary_factor": 0.75},
  ),
  # Phi-3-mini-128k: LongRoPE on whole heads, the early name "su", a factor of its own.
  "phi3-su-factor": (
    "Phi3",
    {
      **PHI,
      "rope_scaling": {
        **LONGROPE,
        "rope_type": "su",
        "short_factor": LONGROPE["short_factor"] + [5.0, 6.0],
        "long_factor": LONGROPE["long_factor"] + [24.0, 32.0],
        "factor": 8.0,
      },
    },
  ),
  # Phi-3-mini-4k: plain RoPE, one window on every layer.
  "phi3-window": ("Phi3", {**PHI, "sliding_window": 8}),
  "qwen3-yarn": ("Qwen3", {"head_dim": 32, "max_position_embeddings": 64, "rope_scaling": YARN}),
  # transformers v5's rope_parameters on a Llama, LongRoPE outside Phi, and an explicit YaRN
  # attention factor and beta on v4's `type` key.
  "llama-longrope-v5": (
    "Llama",
    {
      "max_position_embeddings": 64,
      "rope_parameters": {
        **LONGROPE,
        "short_factor": LONGROPE["short_factor"] + [5.0, 6.0],
        "long_factor": LONGROPE["long_factor"] + [24.0, 32.0],
        "original_max_position_embeddings": ORIGINAL,
        "rope_theta": 5000.0,
      },
    },
  ),
  "mistral-yarn-v4-type": (
    "Mistral",
    {
      "max_position_embeddings": 64,
      "sliding_window": None,
      "rope_scaling": {
        "type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": ORIGINAL,
        "attention_factor": 1.2,
        "beta_fast": 16.0,
      },
    },
  ),
}


def load_pair(case, folder, *, std=0.2):
  family, overrides = CASES[case]
  ref = build_hf(family, folder, std=std, **overrides)
  return ref, hf.load(folder)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_inside_and_past_the_original_context(case, tmp_path):
  """T <= 16 runs LongRoPE's short factors, T > 16 its long ones (one compiled model: the choice
  is traced); YaRN's and partial RoPE's frequencies hold at every length."""
  ref, ours = load_pair(case, tmp_path)
  rng = np.random.RandomState(0)
  for T in (7, ORIGINAL, ORIGINAL + 1, 40):
    toks = rng.randint(0, V, (2, T))
    got = np.asarray(ours(jnp.asarray(toks, jnp.int32)))
    err = np.abs(got - hf_logits(ref, toks)).max()
    assert err <= 1e-4, (case, T, err)


def test_phi4_config_fields(tmp_path):
  _, ours = load_pair("phi4-longrope-partial", tmp_path)
  cfg = ours.cfg
  assert (cfg.head_dim, cfg.rotary_dim, cfg.partial_rotary_factor) == (16, 12, 0.75)
  s = cfg.rope_scaling
  assert (s.type, s.original_max_position_embeddings, s.factor) == ("longrope", ORIGINAL, 4.0)
  assert s.long_factor == tuple(LONGROPE["long_factor"])
  assert hf.load_config(tmp_path) == cfg


@pytest.mark.parametrize(
  "case, prompt_len, new",
  [
    ("phi4-longrope-partial", 5, 10),  # every call inside the original context: short factors
    ("phi4-longrope-partial", 20, 12),  # every call past it: long factors
    ("qwen3-yarn", 9, 24),
  ],
)
def test_greedy_generation_matches_transformers(case, prompt_len, new, tmp_path):
  ref, ours = load_pair(case, tmp_path, std=0.3)
  rng = np.random.RandomState(1)
  prompts = [rng.randint(3, V, prompt_len).tolist(), rng.randint(3, V, prompt_len - 2).tolist()]
  got = generate(ours, prompts, SamplingParams(max_new_tokens=new))
  assert got == [hf_greedy(ref, prompt, new) for prompt in prompts], case


@pytest.mark.parametrize(
  "case, model_type", [("phi4-longrope-partial", "phi3"), ("qwen3-yarn", "qwen3")]
)
def test_save_round_trips_through_transformers(case, model_type, tmp_path):
  _, ours = load_pair(case, tmp_path / "a")
  hf.save(ours, tmp_path / "b")
  written = json.loads((tmp_path / "b" / "config.json").read_text())
  assert written["model_type"] == model_type
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
  toks = np.arange(3, 43)[None] % V  # past the original context
  for T in (ORIGINAL, 40):
    want = np.asarray(ours(jnp.asarray(toks[:, :T], jnp.int32)))
    assert np.abs(hf_logits(back, toks[:, :T]) - want).max() <= 1e-4, T
  assert hf.load(tmp_path / "b").cfg == ours.cfg


def test_phi3_fused_tensors_split_at_load_and_fuse_at_export(tmp_path):
  from safetensors.numpy import load_file

  ref, ours = load_pair("phi4-longrope-partial", tmp_path / "a")
  hf.save(ours, tmp_path / "b")
  a, b = (
    load_file(tmp_path / "a" / "model.safetensors"),
    load_file(tmp_path / "b" / "model.safetensors"),
  )
  assert set(a) == set(b) and "model.layers.1.self_attn.qkv_proj.weight" in b
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  # The key heads sit after the N * H query rows of qkv_proj.
  wk = ref.model.layers[0].self_attn.qkv_proj.weight.detach().numpy()[64:96]
  np.testing.assert_array_equal(
    np.asarray(ours.blocks.attn.wk[...])[0], wk.reshape(2, 16, 64).transpose(2, 0, 1)
  )


def write_config(folder, **changes):
  build_hf("Phi3", folder, **{**PHI, "rope_scaling": LONGROPE, "partial_rotary_factor": 0.75})
  path = folder / "config.json"
  config = json.loads(path.read_text())
  for key, value in changes.items():
    if value is None:
      config.pop(key, None)
    else:
      config[key] = value
  path.write_text(json.dumps(config))
  return folder


@pytest.mark.parametrize(
  "changes, match",
  [
    (
      {"rope_parameters": {**LONGROPE, "rope_type": "dynamic", "factor": 2.0}},
      r"'rope_parameters\.rope_type'='dynamic' is not supported for phi3; supported: default, "
      r"longrope",
    ),
    (
      {"rope_parameters": {**LONGROPE, "short_factor": [1.0, 2.0]}},
      r"model\.rope_scaling\.short_factor=\[1\.0, 2\.0\] .* one entry per rotated dimension "
      r"pair: 6",
    ),
    (
      {"rope_parameters": {**LONGROPE, "long_factor": [1.0, "2"]}},
      r"'rope_parameters\.long_factor'=\[1\.0, '2'\] is not allowed: must be a list of numbers",
    ),
    (
      {"rope_parameters": {**LONGROPE, "partial_rotary_factor": 0.1}},
      r"model\.partial_rotary_factor=0\.1 .* even number of dims > 0",
    ),
  ],
)
def test_bad_rope_fields_are_named(changes, match, tmp_path):
  with pytest.raises(hf.HFLoadError, match=match):
    hf.load(write_config(tmp_path, **changes))


def test_llama_with_partial_rotary_is_refused(tmp_path):
  build_hf("Llama", tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  config["partial_rotary_factor"] = 0.5
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(hf.HFLoadError, match=r"llama with partial_rotary_factor=0\.5 is not"):
    hf.load(tmp_path)


@pytest.mark.parametrize("runner", ["ragged", pytest.param("cpu", marks=pytest.mark.slow)])
def test_engine_serves_transformers_greedy_tokens_past_the_original_context(runner, tmp_path):
  """The paged engine (both runners) on prompts past the original context, each prefilled in one
  step: its padded token axis (positions -1) leaves LongRoPE on the long factors, as
  transformers' generate is."""
  ref, ours = load_pair("phi4-longrope-partial", tmp_path, std=0.3)
  rng = np.random.RandomState(2)
  prompts = [rng.randint(3, V, n).tolist() for n in (20, 18)]
  got = _serve(ours, prompts, 10, runner=runner)
  assert got == [hf_greedy(ref, prompt, 10) for prompt in prompts], runner


def _serve(model, prompts, new, **config):
  from atlas_jax.serving.engine import Engine, EngineConfig

  engine = Engine(
    model,
    EngineConfig(
      n_blocks=64,
      block_size=4,
      max_num_seqs=4,
      max_num_batched_tokens=64,
      prefill_chunk=32,
      **config,
    ),
  )
  for i, prompt in enumerate(prompts):
    engine.add_request(i, prompt, SamplingParams(max_new_tokens=new))
  got = {i: [] for i in range(len(prompts))}
  while engine.has_unfinished():
    for out in engine.step():
      got[out.request_id].extend(out.new_token_ids)
  return [got[i] for i in range(len(prompts))]


def test_engine_fixes_one_longrope_set_so_a_sequence_never_depends_on_its_batch(tmp_path):
  """Served, LongRoPE's set is fixed from max_model_len (vLLM's rule), not chosen per call from
  the largest position of the flat batch: a short sequence's tokens are the same alone and
  batched with one past the original context. Past it (max_model_len 64) the long set is
  transformers' for a prompt past the original context; inside it (max_model_len 16) the short
  set is transformers' for a short prompt."""
  ref, ours = load_pair("phi4-longrope-partial", tmp_path, std=0.3)
  rng = np.random.RandomState(3)
  short, long = rng.randint(3, V, 6).tolist(), rng.randint(3, V, 30).tolist()
  together = _serve(ours, [short, long], 8)
  assert together[0] == _serve(ours, [short], 8)[0]
  assert together[1] == hf_greedy(ref, long, 8)
  assert _serve(ours, [short], 8, max_model_len=ORIGINAL)[0] == hf_greedy(ref, short, 8)
  # The caller's model keeps transformers' per-call rule (training, `generate`).
  assert ours.cfg.rope_scaling.longrope_frequencies == "dynamic"


def test_partial_rotary_is_never_exported_as_a_family_rotating_whole_heads():
  import dataclasses

  from atlas_jax.config import ModelConfig, MoEConfig
  from atlas_jax.hf import llama, mixtral, olmoe, qwen_moe

  moe = MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=32)
  cfg = ModelConfig(d_model=64, n_heads=4, n_kv_heads=2, partial_rotary_factor=0.5, moe=moe)
  assert [m.model_type(cfg) for m in (llama, mixtral, olmoe, qwen_moe)] == [None] * 4
  assert mixtral.model_type(dataclasses.replace(cfg, partial_rotary_factor=1.0)) == "mixtral"
  dense = dataclasses.replace(cfg, moe=None)
  assert llama.model_type(dense) is None and hf.config_to_hf(dense)["model_type"] == "phi3"
