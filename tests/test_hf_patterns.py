"""Families with per-layer attention patterns and Gemma's block layout against transformers:
Gemma 2 (alternating windows, soft-capping), Gemma 3 (a 5:1 local/global pattern, two RoPE bases,
QK-norm), OLMo 2 (norms after the sublayers) and SmolLM3 (layers without RoPE). Logits for prompts
longer than the window, greedy generation through the cache, and export back."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from atlas_jax import hf  # noqa: E402
from atlas_jax.decoding.generate import SamplingParams, generate  # noqa: E402

V = 101
W = 8  # the sliding window: the prompts below are several windows long


def build_hf(family: str, folder, **overrides):
  """A tiny random model of `family` (every weight drawn, norms around their identity)."""
  torch.manual_seed(0)
  kw = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
  )
  kw.update(overrides)
  config_class = {"Gemma3Text": transformers.Gemma3TextConfig}.get(family)
  config_class = config_class or getattr(transformers, f"{family}Config")
  model_class = {"Gemma3Text": transformers.Gemma3ForCausalLM}.get(family)
  model_class = model_class or getattr(transformers, f"{family}ForCausalLM")
  model = model_class(config_class(**kw)).eval()
  gemma = family.startswith("Gemma")
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):  # Gemma's norms multiply by 1 + w
        p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.2)
  model.save_pretrained(folder)
  return model


CASES = {
  "gemma2": (
    "Gemma2",
    dict(
      head_dim=16,
      sliding_window=W,
      attn_logit_softcapping=5.0,
      final_logit_softcapping=3.0,
      query_pre_attn_scalar=24,
    ),
  ),
  "gemma3": (
    "Gemma3Text",
    dict(
      num_hidden_layers=7,
      head_dim=16,
      sliding_window=W,
      query_pre_attn_scalar=24,
      rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
      },
    ),
  ),
  "olmo2": ("Olmo2", {}),
  "smollm3": ("SmolLM3", dict(no_rope_layers=[1, 0, 1, 0])),
  "smollm3-window": (
    "SmolLM3",
    dict(no_rope_layers=[1, 1, 0, 1], use_sliding_window=True, sliding_window=W),
  ),
}


def hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_generation_and_export_match_transformers(case, tmp_path):
  family, overrides = CASES[case]
  ref = build_hf(family, tmp_path / "hf", **overrides)
  ours = hf.load(tmp_path / "hf")
  rng = np.random.RandomState(0)
  toks = rng.randint(0, V, (2, 3 * W + 5))
  np.testing.assert_allclose(np.asarray(ours(toks)), hf_logits(ref, toks), atol=2e-4, rtol=2e-4)

  # Greedy through the cache, past the window, against transformers' own generate.
  prompt = rng.randint(0, V, 2 * W + 3).tolist()
  n = W + 4
  with torch.no_grad():
    want = ref.generate(
      torch.tensor([prompt]),
      attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
      max_new_tokens=n,
      do_sample=False,
      eos_token_id=None,
      pad_token_id=0,
    ).numpy()[0, len(prompt) :]
  (got,) = generate(ours, [prompt], SamplingParams(max_new_tokens=n))
  assert list(got) == want.tolist()

  hf.save(ours, tmp_path / "out")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  np.testing.assert_allclose(hf_logits(back, toks), hf_logits(ref, toks), atol=2e-4, rtol=2e-4)


def test_layer_kinds_follow_the_config():
  cfg = hf.config_from_hf(
    transformers.Gemma3TextConfig(num_hidden_layers=7, sliding_window=W).to_dict()
  )
  kinds, index = cfg.attention_kinds()
  assert [kinds[i].sliding_window for i in index] == [W] * 5 + [None] + [W]
  assert {kinds[i].rope_theta for i in index} == {10000.0, 1000000.0}


@pytest.mark.parametrize(
  "tensor, runner", [pytest.param(1, "ragged", marks=pytest.mark.slow), (2, "ragged"), (1, "cpu")]
)
def test_the_engine_serves_transformers_greedy_tokens_past_the_window(tensor, runner, tmp_path):
  """Gemma 3's local and global layers over the paged pool (ragged steps, chunked prefill), on
  one device and with the heads split over two; and by the CPU runner, whose unrolled layers
  each call their own window's kernel."""
  from atlas_jax.config import CPUConfig
  from atlas_jax.serving.engine import Engine, EngineConfig

  family, overrides = CASES["gemma3"]
  # Three layers, local, global and local again, hold both kinds and the switch back to the
  # local RoPE base (the 5:1 pattern itself: the logits test). The CPU runner unrolls its
  # layers into each step program, so each layer fewer is less to compile.
  layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
  overrides = {**overrides, "num_hidden_layers": 3, "layer_types": layer_types}
  ref = build_hf(family, tmp_path, **overrides)
  ours = hf.load(tmp_path)
  kinds, index = ours.cfg.attention_kinds()
  assert [kinds[i].sliding_window for i in index] == [W, None, W]
  rng = np.random.RandomState(1)
  prompts = [rng.randint(3, V, n).tolist() for n in (2 * W + 3, 5, 3 * W)]
  n = W + 4
  config = EngineConfig(
    runner=runner,
    n_blocks=32,
    block_size=4,
    max_num_seqs=2,
    prefill_chunk=8,
    tensor_parallel_size=tensor,
    # The CPU runner's layers one array each, each layer's kernel chosen when it is traced.
    **({"cpu": CPUConfig(weight_layout="in_major", matmul="ynnpack")} if runner == "cpu" else {}),
  )
  engine = Engine(ours, config)
  if runner == "cpu":
    assert not engine.runner.stacked
  got = engine.generate(prompts, [SamplingParams(max_new_tokens=n)] * 3)
  for prompt, tokens in zip(prompts, got):
    with torch.no_grad():
      want = ref.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
      ).numpy()[0, len(prompt) :]
    assert list(tokens) == want.tolist()


def test_fine_tuning_a_gemma2_folder_with_lora_under_a_mesh(tmp_path):
  """train.init_from a Gemma 2 folder, LoRA on its q/v projections by their Hugging Face names,
  fsdp 4 x tensor 2: the step-0 model gives the folder's logits; the loss falls."""
  import jax
  from flax import nnx

  from atlas_jax import sources
  from atlas_jax.hf import init_from
  from atlas_jax.training.step import make_train_step, make_trainer

  family, overrides = CASES["gemma2"]
  build_hf(family, tmp_path, **overrides)
  sets = [
    f"train.init_from={tmp_path}",
    "train.seq_len=24",
    "train.batch_size=8",
    "train.learning_rate=3e-3",
    "train.warmup_steps=1",
    "train.lora={rank: 4, targets: [q_proj, v_proj]}",
    "mesh.fsdp=4",
    "mesh.tensor=2",
  ]
  cfg = sources.load_config(None, sets)
  trainer = make_trainer(cfg)
  state = trainer.init(jax.random.key(0), init_from.base_params(tmp_path, trainer))
  toks = np.random.RandomState(0).randint(0, V, (8, 25))
  got = nnx.merge(trainer.graphdef, state.params)(toks[:2, :24])
  want = hf.load(tmp_path)(toks[:2, :24])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=2e-4)
  step = make_train_step(trainer)
  batch = {"tokens": toks}
  losses = []
  for _ in range(4):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0]
