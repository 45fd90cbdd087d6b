"""Families with per-layer attention patterns and Gemma's block layout against transformers:
Gemma 2 (alternating windows, soft-capping), Gemma 3 (a 5:1 local/global pattern, two RoPE bases,
QK-norm), OLMo 2 (norms after the sublayers) and SmolLM3 (layers without RoPE). Logits for prompts
longer than the window, greedy generation through the cache, and export back."""

import numpy as np
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from atlas_jax import hf  # noqa: E402
from tests.hf_reference import (  # noqa: E402
  TINY,
  build,
  check_engine_greedy,
  check_fine_tuning,
  check_past_the_window,
)

V = TINY["vocab_size"]
W = 8  # the sliding window: the prompts below are several windows long
SMALL = dict(
  TINY,
  num_hidden_layers=4,
  pad_token_id=0,
  bos_token_id=1,
  eos_token_id=2,
)


def build_hf(family: str, folder, **overrides):
  """A tiny random model of `family` (every weight drawn, norms around their identity: Gemma's
  norms multiply by 1 + w)."""
  norm_mean = 0.0 if family.startswith("Gemma") else 1.0
  return build(family, folder, {**SMALL, **overrides}, norm_mean=norm_mean)


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


@pytest.mark.parametrize("case", list(CASES))
def test_logits_generation_and_export_match_transformers(case, tmp_path):
  family, overrides = CASES[case]
  ref = build_hf(family, tmp_path / "hf", **overrides)
  check_past_the_window(ref, hf.load(tmp_path / "hf"), tmp_path / "out", W)


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
  # The CPU runner's layers one array each, each layer's kernel chosen when it is traced.
  cpu = {"cpu": CPUConfig(weight_layout="in_major", matmul="ynnpack")} if runner == "cpu" else {}
  engine = check_engine_greedy(
    ours, ref, prompts, W + 4, runner=runner, tensor_parallel_size=tensor, **cpu
  )
  if runner == "cpu":
    assert not engine.runner.stacked


def test_fine_tuning_a_gemma2_folder_with_lora_under_a_mesh(tmp_path):
  """train.init_from a Gemma 2 folder, LoRA on its q/v projections by their Hugging Face names,
  fsdp 4 x tensor 2: the step-0 model gives the folder's logits; the loss falls."""
  family, overrides = CASES["gemma2"]
  build_hf(family, tmp_path, **overrides)
  lora = "train.lora={rank: 4, targets: [q_proj, v_proj]}"
  check_fine_tuning(tmp_path, lora, "mesh.fsdp=4", "mesh.tensor=2", seq_len=24, steps=4)
