"""The engine serves mixture-of-experts models, MLA and GQA, with everything it has: a
DeepSeek-V2-Lite-shaped Hugging Face folder over HTTP gives transformers' and `generate`'s greedy
tokens; paged pools under preemption, prefix caching, MTP self-speculation and guided decoding
give what they give on dense models."""

import dataclasses

import httpx
import numpy as np
import pytest
from flax import nnx

from atlas_jax import hf
from atlas_jax.config import MLAConfig, ModelConfig, MTPConfig
from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.model import build
from atlas_jax.serving.engine import Engine, EngineConfig

from .conftest import MOE, TINY, serving
from .test_engine import CONFIGS, serve, workload
from .test_engine_speculative import ROOMY, greedy_workload, run
from .test_serve_mla import word_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# DeepSeek-V2-Lite's layout at a tiny size: no query bottleneck, the first layer dense, then
# MoE layers of routed experts (softmax, greedy top-k, not renormalised) and 2 shared experts.
V2_LITE = dict(
  n_routed_experts=8,
  num_experts_per_tok=2,
  moe_intermediate_size=16,
  n_shared_experts=2,
  first_k_dense_replace=1,
  topk_method="greedy",
)


@pytest.fixture(scope="module")
def v2_lite(tmp_path_factory):
  """(the transformers model, our model loaded from its folder, a word tokenizer)."""
  from tests.test_hf_moe import MLA, V, build_hf

  folder = tmp_path_factory.mktemp("v2-lite")
  ref = build_hf("DeepseekV2", {**MLA, **V2_LITE}, folder, std=0.3)
  tok = word_tokenizer(V)
  tok.save(str(folder / "tokenizer.json"))
  return ref, hf.load(folder), tok


def test_deepseek_v2_lite_shaped_folder_over_http_matches_transformers_and_generate(v2_lite):
  from atlas_jax.data.tokenizer import HFTokenizer

  ref, model, tok = v2_lite
  V = model.cfg.vocab_size
  assert model.cfg.moe is not None and model.runs[0][0] == "dense_blocks"
  prompts = [[5, 17, 3, 91, 42, 8, 8, 60], [7, 1, 2], [(13 * i) % V for i in range(1, 24)]]
  want = []
  for p in prompts:
    with torch.no_grad():
      out = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    want.append(out[0, len(p) :].tolist())
  assert generate(model, prompts, SamplingParams(max_new_tokens=8)) == want
  text = HFTokenizer(tok)
  config = EngineConfig(
    runner="ragged", n_blocks=32, block_size=8, max_num_seqs=4, max_num_batched_tokens=64
  )
  with serving(model, text, config, model_name="m") as (url, _, _):
    for p, w in zip(prompts, want):
      body = {
        "model": "m",
        "prompt": " ".join(f"w{t}" for t in p),
        "max_tokens": 8,
        "temperature": 0,
      }
      r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
      assert r.status_code == 200, r.text
      assert r.json()["choices"][0]["text"] == " ".join(f"w{t}" for t in w)


def moe_config(*, mla: bool, mtp: MTPConfig | None = None) -> ModelConfig:
  """A tiny MoE model over the engine tests' vocabulary: DeepSeek-V3-like (MLA, sigmoid
  noaux_tc router, a dense first layer, a shared expert) or Mixtral-like (GQA, softmax top-2)."""
  if mla:
    return ModelConfig(
      **TINY, n_kv_heads=4, init_std=0.3, mla=MLAConfig(16, 8, 8, 8, 12), moe=MOE["mla"], mtp=mtp
    )
  return ModelConfig(**TINY, n_kv_heads=2, init_std=0.3, moe=MOE["gqa"], mtp=mtp)


@pytest.fixture(scope="module", params=["mla", pytest.param("gqa", marks=pytest.mark.slow)])
def moe_model(request):
  model = build(moe_config(mla=request.param == "mla"), rngs=nnx.Rngs(2))
  if model.cfg.mla is not None:  # a selection bias that changes choices
    bias = model.blocks.mlp.score_bias
    bias[...] = 0.2 * np.random.default_rng(0).standard_normal(bias.shape).astype(np.float32)
  return model


def test_engine_equals_generate_under_preemption(moe_model):
  prompts, params = workload(3, n=8)
  want = generate(moe_model, prompts, params)
  got, _ = serve(moe_model, CONFIGS["tight"], prompts, params, "staggered")
  assert got == want


@pytest.mark.slow  # the experts do not touch the pool: test_mesh's MoE model shares prefixes
def test_prefix_cache_reuses_blocks_and_keeps_outputs(moe_model):
  prompt = list(np.random.default_rng(1).integers(0, 40, 30))
  engine = Engine(moe_model, CONFIGS["roomy"])
  first = engine.generate([prompt], SamplingParams(max_new_tokens=5))
  again = engine.generate([prompt, prompt[:21] + [3]], SamplingParams(max_new_tokens=5))
  assert again[0] == first[0]
  assert again[1] == generate(moe_model, [prompt[:21] + [3]], SamplingParams(max_new_tokens=5))[0]
  assert engine.allocator.stats().prefix_hit_tokens == 4 * (7 + 5)


@pytest.mark.slow  # speculation through experts; dense and MLA speculation run in the fast suite
def test_speculation_keeps_the_greedy_tokens():
  """MTP self-speculation (DeepSeek-V3's layout: the MTP head's block is an MoE layer too), and
  the model as its own draft, whose greedy drafts are all accepted: the target verifies several
  tokens a round through its experts."""
  model = build(moe_config(mla=True, mtp=MTPConfig("sequential", 1)), rngs=nnx.Rngs(4))
  assert model.mtp.heads.block.mlp.__class__.__name__ == "MoE"
  prompts, params = greedy_workload(5)
  want = generate(model, prompts, params, eos_id=3)
  for draft, k in (("mtp", 1), (model, 3)):
    config = dataclasses.replace(ROOMY, num_speculative_tokens=k)
    got, engine = run(model, draft, config, prompts, params)
    assert got == want and engine.n_spec_rounds > 0
  assert engine.n_accepted == engine.n_drafted > 0


def test_guided_decoding_on_an_moe_model():
  from atlas_jax.data.tokenizer import train_bpe
  from atlas_jax.decoding.guided import GrammarCompiler, spec_from_request

  choices = ["yes", "no", "nope", "maybe"]
  tok = train_bpe(["yes no nope maybe " * 20, "def f(x):\n  return x\n" * 20], 300)
  cfg = dataclasses.replace(moe_config(mla=True), vocab_size=tok.vocab_size)
  model = build(cfg, rngs=nnx.Rngs(6))
  grammar = GrammarCompiler(tok, vocab_size=cfg.vocab_size).compile(
    spec_from_request(guided_choice=choices)
  )
  config = EngineConfig(
    runner="ragged", n_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=64
  )
  engine = Engine(model, config, eos_id=tok.eos_id, detokenize=tok.decode)
  for seed in range(4):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed, guided=grammar)
    engine.add_request(seed, tok.encode(f"answer {seed}: "), params)
  got = {i: [] for i in range(4)}
  while engine.has_unfinished():
    for out in engine.step():
      got[out.request_id].extend(out.new_token_ids)
  for tokens in got.values():
    assert tok.decode([t for t in tokens if t != tok.eos_id]) in choices


@pytest.mark.slow  # expert-parallel training is tested fast in tests/training/test_moe_training.py
def test_deepseek_v2_lite_tiny_trains_expert_parallel_and_serves(tmp_path):
  """train.py on the deepseek-v2-lite-tiny preset with its experts split 4 ways over the 8
  devices, then serve.py on the run: the tokens `generate` gives."""
  import json
  import sys
  from pathlib import Path

  from atlas_jax.training import checkpoint

  root = Path(__file__).parents[2]
  sys.path.insert(0, str(root))
  import serve
  import train

  data = tmp_path / "data.jsonl"
  data.write_text(
    "".join(json.dumps({"text": f"def g{i}(y): return y + {i}\n"}) + "\n" for i in range(60))
  )
  sets = {
    "data.source": data,
    "data.eval_fraction": 0.1,
    "mesh.expert": 4,
    "train.steps": 2,
    "train.seq_len": 32,
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.checkpoint_dir": tmp_path / "ckpt",
  }
  argv = ["--config", str(root / "configs" / "deepseek-v2-lite-tiny.yaml"), "--sample-prompt", ""]
  for key, value in sets.items():
    argv += ["--set", f"{key}={value}"]
  assert train.main(argv) == 0
  records = [
    json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()
  ]
  assert {"moe_balance_loss", "moe_load_max", "moe_tokens_per_expert"} <= set(records[-1])

  prompts = ["def g1", "return"]
  out = tmp_path / "out.jsonl"
  argv = ["--checkpoint", str(tmp_path / "ckpt"), "--max-new-tokens", "8", "--output", str(out)]
  assert serve.main(argv + [a for p in prompts for a in ("--prompt", p)]) == 0
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  model, cfg, tok = checkpoint.load_model(tmp_path / "ckpt")
  assert cfg.model.moe is not None and cfg.mesh.expert == 4
  ids = generate(
    model, [tok.encode(p) for p in prompts], SamplingParams(max_new_tokens=8), eos_id=tok.eos_id
  )
  assert [r["completion"] for r in rows] == [tok.decode(i) for i in ids]
