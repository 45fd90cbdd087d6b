"""SamplingParams takes only what the jitted steps hold (i32, finite f32), naming the field."""

import math

import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import ModelConfig
from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.decoding.sampling import INT32_MAX
from atlas_jax.model.transformer import Transformer


@pytest.mark.parametrize(
  "field, value, match",
  [
    ("top_k", 2**31, r"top_k=2147483648 is not allowed: must be in \[0, 2147483647\]"),
    ("top_k", 2**64, "top_k="),
    ("top_k", 2.5, r"top_k=2.5 is not allowed: must be an integer"),
    ("top_k", True, "top_k=True"),
    ("max_new_tokens", 2**31, "max_new_tokens=2147483648"),
    ("max_new_tokens", 0, "max_new_tokens=0"),
    ("seed", -1, "seed=-1"),
    ("temperature", math.nan, "temperature=nan is not allowed: must be a finite number >= 0"),
    ("temperature", math.inf, "temperature=inf"),
    ("temperature", 1e39, r"temperature=1e\+39"),  # finite in float64, inf in float32
    ("temperature", "0.5", "temperature='0.5'"),
    ("repetition_penalty", math.nan, "repetition_penalty=nan"),
    ("repetition_penalty", 0, "repetition_penalty=0.0"),
    ("top_p", 0.0, r"top_p=0.0 is not allowed: must be in \(0, 1\]"),
    ("min_p", math.nan, "min_p=nan"),
    ("presence_penalty", math.inf, "presence_penalty=inf"),
    ("logprobs", 21, "logprobs=21"),
    ("stop_token_ids", (1, 2**31), "stop_token_ids=2147483648"),
    ("stop_token_ids", 5, "stop_token_ids=5 is not allowed: must be a list of token ids"),
    ("stop", ("ok", ""), "must be a list of non-empty strings"),
    ("stop", (b"x",), "stop="),
    ("ignore_eos", "yes", "ignore_eos='yes'"),
    ("skip_special_tokens", 1, "skip_special_tokens=1 is not allowed: must be true or false"),
    ("min_tokens", -1, r"min_tokens=-1 is not allowed: must be in \[0, 2147483647\]"),
    ("min_tokens", 40, "min_tokens=40 is not allowed: must be <= max_new_tokens=32"),
    ("prompt_logprobs", 21, "prompt_logprobs=21"),
    ("logit_bias", {5: 101}, r"logit_bias\[5\]=101.0 is not allowed: must be a number in"),
    ("logit_bias", {-1: 1}, "logit_bias token id=-1 is not allowed"),
    ("logit_bias", [(1, 2, 3)], r"logit_bias entry \(1, 2, 3\) is not allowed"),
    ("logit_bias", "x", "logit_bias='x' is not allowed: must map token ids"),
  ],
)
def test_fields_outside_what_the_step_holds_are_named(field, value, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**{field: value})


def test_integer_types_are_normalised():
  p = SamplingParams(top_k=np.int64(INT32_MAX), seed=np.int32(3), stop_token_ids=[np.int64(7)])
  assert p.top_k == INT32_MAX and type(p.top_k) is int and p.seed == 3
  assert p.stop_token_ids == (7,) and p.stop == ()
  assert SamplingParams(stop="\n\n").stop == ("\n\n",)  # one string, not its characters


def test_largest_top_k_and_seed_run_in_generate():
  cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64)
  tiny_model = Transformer(cfg, rngs=nnx.Rngs(0))
  # top_k past the vocabulary keeps every token, exactly like top_k=0.
  prompts = [[1, 2, 3]]
  big = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=INT32_MAX, seed=INT32_MAX)
  off = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=0, seed=INT32_MAX)
  assert generate(tiny_model, prompts, big) == generate(tiny_model, prompts, off)
