"""Serving quantized weights (`serve.quantization`): both runners' greedy tokens equal the
engine's over the float model holding the dequantized weights, tensor 2 (fake CPU devices) equals
one device with the values and scales split as the float weights are, and serve.py's flags
quantize the loaded model."""

import dataclasses

import jax
import pytest
from flax import nnx

from atlas_jax import quant
from atlas_jax.config import ModelConfig, MoEConfig
from atlas_jax.decoding import SamplingParams
from atlas_jax.model import build
from atlas_jax.serving.engine import Engine, EngineConfig

SHAPE = dict(vocab_size=48, d_model=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=128)
CONFIG = EngineConfig(
  n_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk=8
)
PROMPTS = [[5, 9, 2, 30, 11], [1] * 7, [40, 3, 17, 22, 8, 8, 6, 1, 0, 13]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
SLOW = pytest.mark.slow


def model_of(fmt=None, moe=False):
  extra = dict(moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=32)) if moe else {}
  model = build(ModelConfig(**SHAPE, n_kv_heads=2, init_std=0.3, **extra), rngs=nnx.Rngs(0))
  if fmt is not None:
    quant.quantize_model(model, fmt, group_size=16)
  return model


def served(model, **kw):
  engine = Engine(model, dataclasses.replace(CONFIG, **kw), eos_id=None)
  return engine.generate(PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def dequantized_tokens():
  """fmt -> the engine's tokens over the float model with the fmt-dequantized weights."""
  cache = {}

  def get(fmt, moe=False):
    if (fmt, moe) not in cache:
      model = model_of(fmt, moe)
      assert quant.dequantize_model(model)
      cache[fmt, moe] = served(model, runner="ragged")
    return cache[fmt, moe]

  return get


@pytest.mark.parametrize(
  "fmt,runner",
  [
    # The CPU runner for int8, the ragged one for the other formats; the rest under -m slow
    # (test_tensor_2_equals_one_device serves int8 on the ragged runner).
    pytest.param(fmt, runner, marks=() if (runner == "cpu") == (fmt == "int8") else SLOW)
    for fmt in quant.FORMATS
    for runner in ("ragged", "cpu")
  ],
)
def test_served_tokens_equal_the_dequantized_model(fmt, runner, dequantized_tokens):
  assert served(model_of(fmt), runner=runner) == dequantized_tokens(fmt)


def test_quantized_experts_serve(dequantized_tokens):
  assert served(model_of("int8", moe=True), runner="ragged") == dequantized_tokens("int8", True)


@pytest.mark.parametrize("fmt", ["int8", pytest.param("int4", marks=pytest.mark.slow)])
def test_tensor_2_equals_one_device(fmt):
  model = model_of(fmt)
  one = served(model, runner="ragged")
  engine = Engine(
    model, dataclasses.replace(CONFIG, runner="ragged", tensor_parallel_size=2), eos_id=None
  )
  assert engine.generate(PROMPTS, GREEDY) == one
  # The values and the scales lie split over the tensor axis where the float weight would be.
  wq = {
    jax.tree_util.keystr(path): leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(engine.runner.states[0])
    if "'wq'" in jax.tree_util.keystr(path)
  }
  assert sorted(k.rsplit(".", 1)[-1] for k in wq) == ["qvalue", "scale"]
  for leaf in wq.values():  # [L, D, N, H] and [L, 1, N, H]: the heads split in two
    assert len(leaf.sharding.device_set) == 2
    assert leaf.addressable_shards[0].data.shape[2] == leaf.shape[2] // 2


def test_serve_flags_set_the_fields(tmp_path):
  import serve

  def config(*flags):
    args = serve.parse_args(["--checkpoint", str(tmp_path), *flags])
    serve.fill_defaults(args)
    return serve.serve_config(args)

  got = config("--quantization", "int4", "--quantization-group-size", "16")
  assert (got.quantization, got.quantization_group_size) == ("int4", 16)
  assert not got.quantize_lm_head
  assert config("-q", "fp8", "--quantize-lm-head", "true").quantize_lm_head
  assert config().quantization is None
  with pytest.raises(ValueError, match="serve.quantization='int2' is not allowed"):
    config("-q", "int2")
