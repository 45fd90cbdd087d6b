"""An FP8 folder served as it ships: the engine over the kept e4m3 weights gives the tokens of
the engine over the dequantized load (weight-only, both runners), and with W8A8 forced the
engine's step programs lowered for cuda multiply f8E4M3FN operands, where the CPU default's hold
no f8 dot."""

import dataclasses

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from atlas_jax import hf  # noqa: E402
from atlas_jax.decoding import SamplingParams  # noqa: E402
from atlas_jax.serving.engine import Engine  # noqa: E402

from ..test_hf import build_hf  # noqa: E402
from ..test_hf_fp8 import DEEPSEEK_FP8, qarrays, write_fp8  # noqa: E402
from .test_ragged_step import CONFIG, _lowered  # noqa: E402

PROMPTS = [[5, 9, 2, 30, 11], [1] * 7, [40, 3, 17, 22, 8, 8, 6, 1, 0, 13]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  path = tmp_path_factory.mktemp("fp8")
  model = build_hf("Llama", path, std=0.05, hidden_size=256, intermediate_size=384)
  write_fp8(path, model, DEEPSEEK_FP8)
  return path


def served(model, runner):
  engine = Engine(model, dataclasses.replace(CONFIG, runner=runner), eos_id=None)
  return engine.generate(PROMPTS, GREEDY)


# The ragged runner under -m slow: it serves the kept weights in the tensor-2 tests below, and
# test_hf_fp8 checks the kept model's logits against the dequantized load's.
@pytest.mark.parametrize("runner", [pytest.param("ragged", marks=pytest.mark.slow), "cpu"])
def test_kept_fp8_weights_serve_the_dequantized_tokens(folder, runner):
  kept = hf.load(folder)
  assert len(qarrays(kept)) == 7
  assert served(kept, runner) == served(hf.load(folder, fp8_weights="dequantize"), runner)


def _f8_dots(text):
  return [ln for ln in text.splitlines() if "dot_general" in ln and "f8E4M3FN" in ln]


def test_w8a8_step_lowers_to_f8_dots_for_cuda_only(folder):
  engine = Engine(hf.load(folder, fp8_activations="dynamic"), CONFIG, eos_id=None)
  for name, text in _lowered(engine, "cuda").items():
    assert len(_f8_dots(text)) >= 7, name  # q, k, v, o, gate, up, down: per block of 128 inputs
  engine = Engine(hf.load(folder), CONFIG, eos_id=None)  # the CPU default: weight-only
  for name, text in _lowered(engine, "cpu").items():
    assert not _f8_dots(text), name


def test_kept_fp8_weights_under_tensor_2_equal_one_device(folder):
  """The codes and their tile scales split over the tensor axis as the float weights are."""
  kept = hf.load(folder)
  one = served(kept, "ragged")
  config = dataclasses.replace(CONFIG, runner="ragged", tensor_parallel_size=2)
  assert Engine(kept, config, eos_id=None).generate(PROMPTS, GREEDY) == one


def test_w8a8_under_tensor_2_equals_one_device(folder):
  """Each token's activation scale is its amax over the whole contracted axis, also where that
  axis is split over the tensor axis (W_O's and W_down's inputs)."""
  w8a8 = hf.load(folder, fp8_activations="dynamic")
  one = served(w8a8, "ragged")
  config = dataclasses.replace(CONFIG, runner="ragged", tensor_parallel_size=2)
  assert Engine(w8a8, config, eos_id=None).generate(PROMPTS, GREEDY) == one


@pytest.mark.slow
def test_static_input_scales_under_tensor_2_equal_one_device(tmp_path):
  """Kept weights carrying a static input scale (`StaticQArray`) shard as the others (the scale
  replicated) and serve W8A8 with it: tensor 2 generates one device's tokens."""
  import torch

  model = build_hf("Llama", tmp_path, std=0.05, hidden_size=256, intermediate_size=384)
  extra = {
    n.removesuffix(".weight") + ".input_scale": torch.tensor(0.01)
    for n in model.state_dict()
    if n.endswith("_proj.weight")
  }
  write_fp8(tmp_path, model, {**DEEPSEEK_FP8, "activation_scheme": "static"}, extra=extra)
  static = hf.load(tmp_path, fp8_activations="static")
  assert all(abs(float(q.input_scale.max()) - 0.01) < 1e-9 for q in qarrays(static).values())
  one = served(static, "ragged")
  config = dataclasses.replace(CONFIG, runner="ragged", tensor_parallel_size=2)
  assert Engine(static, config, eos_id=None).generate(PROMPTS, GREEDY) == one
