"""Weight-only quantization (`atlas_jax.quant`): each format's round-trip error within its bound,
a quantized model's logits and greedy tokens equal to the float model holding the dequantized
weights (GQA, MoE experts, MLA), the compiled step's weight arguments at 1/4 (int8, fp8) and 1/8
(int4) of float32 plus the scales, and the settings' errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax import quant
from atlas_jax.config import ConfigError, MLAConfig, ModelConfig, MoEConfig, ServeConfig
from atlas_jax.model import build

SHAPE = dict(vocab_size=64, d_model=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=64)
KINDS = {
  "gqa": dict(n_kv_heads=2),
  "moe": dict(n_kv_heads=2, moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=64)),
  "mla": dict(n_kv_heads=4, mla=MLAConfig(32, 16, 16, 16, q_lora_rank=32)),
}
GROUP = 32


def model_of(kind: str, fmt: str | None = None, **kw):
  model = build(ModelConfig(**SHAPE, init_std=0.3, **KINDS[kind], **kw), rngs=nnx.Rngs(0))
  if fmt is not None:
    quant.quantize_model(model, fmt, group_size=GROUP)
  return model


def logits_fn(model):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)), state


PROMPTS = ([1, 2, 3], [9, 40, 7, 7, 21], [60])
WIDTH = 12  # every call one shape: one compile per model


def greedy(f, state, n):
  """n greedy tokens after each of PROMPTS, each row padded to WIDTH (the model is causal: the
  padding after a row's last token does not reach it)."""
  rows = [list(p) for p in PROMPTS]
  for _ in range(n):
    batch = jnp.asarray([r + [0] * (WIDTH - len(r)) for r in rows])
    logits = np.asarray(f(state, batch))
    for i, r in enumerate(rows):
      r.append(int(np.argmax(logits[i, len(r) - 1])))
  return [r[len(p) :] for r, p in zip(rows, PROMPTS)]


# -- the arrays ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize(
  "shape,axes",
  [((64, 96), ("embed", "mlp")), ((2, 4, 16, 64), ("layers", "q_heads", "head_dim", "embed"))],
  ids=["mlp", "stacked_wo"],
)
def test_round_trip_within_the_format_bound(fmt, shape, axes):
  w = jax.random.normal(jax.random.key(1), shape, jnp.float32) * 0.05
  q = quant.quantize_weight(w, axes, fmt, group_size=GROUP)
  assert q.qvalue.shape == w.shape
  assert q.qvalue.dtype == {"int8": jnp.int8, "int4": jnp.int4, "fp8": jnp.float8_e4m3fn}[fmt]
  contracted = quant.contracted_axes(axes)
  n_in = int(np.prod([shape[a] for a in contracted]))
  # One scale per output channel (and stacked slice); int4's also per group of GROUP inputs.
  per_in = n_in // GROUP if fmt == "int4" else 1
  assert q.scale.size == w.size // n_in * per_in
  full, codes = np.asarray(w), np.asarray(q.qvalue, np.float32)
  err = np.abs(np.asarray(quant.dequantized(q)) - full)
  scale_w = np.asarray(q.scale)  # broadcast to w's shape: each scale covers a tile of w
  for axis, size in enumerate(w.shape):
    scale_w = np.repeat(scale_w, size // scale_w.shape[axis], axis=axis)
  if fmt == "fp8":
    # e4m3 keeps 3 mantissa bits: half a unit in the last place is 2^-4 relative; below its
    # normal range the spacing is 2^-9 scale units.
    bound = np.abs(full) * 2.0**-4 + scale_w * 2.0**-10
  else:
    bound = scale_w / 2  # rounded to the nearest step
  assert np.all(err <= bound * (1 + 1e-4))  # and float32's rounding of the division
  # The scales span what they cover: the largest code times its scale is w's absmax within
  # half a step (qwix's integer scales are absmax / (qmax + 1/2), codes in [-qmax - 1, qmax]).
  qmax = {"int8": 127, "int4": 7, "fp8": 448}[fmt]
  assert qmax <= np.abs(codes).max() <= qmax + 1
  np.testing.assert_allclose(np.abs(codes * scale_w).max(), np.abs(full).max(), rtol=0.5 / qmax)


def test_scales_follow_groups_across_heads():
  """int4 groups cut the flattened contracted dims: W_O's [N, H] in runs of GROUP, across heads
  when GROUP > H."""
  w = jnp.ones((4, 16, 8))
  q = quant.quantize_weight(w, ("q_heads", "head_dim", "embed"), "int4", group_size=GROUP)
  assert q.scale.shape == (2, 1, 8)  # 64 inputs in 2 groups of 32 (two heads each)
  q = quant.quantize_weight(w, ("q_heads", "head_dim", "embed"), "int4", group_size=8)
  assert q.scale.shape == (4, 2, 8)


def test_a_group_size_that_does_not_divide_is_named():
  with pytest.raises(ValueError, match=r"serve.quantization_group_size=48 must divide .* 64"):
    quant.quantize_weight(jnp.ones((64, 8)), ("embed", "mlp"), "int4", group_size=48)
  with pytest.raises(ValueError, match="serve.quantization='int3' is not one of"):
    quant.quantize_weight(jnp.ones((64, 8)), ("embed", "mlp"), "int3")


def test_serve_config_names_bad_settings():
  with pytest.raises(ConfigError, match="serve.quantization='int3' is not allowed"):
    ServeConfig(quantization="int3")
  with pytest.raises(ConfigError, match="serve.quantization_group_size=0"):
    ServeConfig(quantization="int4", quantization_group_size=0)


# -- the model -----------------------------------------------------------------------------------


# GQA in every format; the experts and MLA in int8 (all of them with -m slow).
MODEL_CASES = [
  pytest.param(kind, fmt, marks=() if kind == "gqa" or fmt == "int8" else pytest.mark.slow)
  for kind in KINDS
  for fmt in quant.FORMATS
]


@pytest.mark.parametrize("kind,fmt", MODEL_CASES)
def test_logits_and_greedy_tokens_equal_the_dequantized_model(kind, fmt):
  q = model_of(kind, fmt)
  ref = model_of(kind, fmt)
  names = quant.dequantize_model(ref)
  assert names and all(n.split(".")[-1] in quant.PROJECTIONS for n in names)
  tokens = jax.random.randint(jax.random.key(2), (3, WIDTH), 0, SHAPE["vocab_size"])
  (fq, sq), (fr, sr) = logits_fn(q), logits_fn(ref)
  got, want = np.asarray(fq(sq, tokens)), np.asarray(fr(sr, tokens))
  np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)
  assert greedy(fq, sq, 4) == greedy(fr, sr, 4)
  # Quantization is not the identity: the float model's logits differ.
  f, s = logits_fn(model_of(kind))
  assert np.abs(np.asarray(f(s, tokens)) - want).max() > 1e-4


def test_the_lm_head_stays_float_unless_asked():
  model = model_of("gqa", tie_embeddings=False)
  names = quant.quantize_model(model, "int8")
  assert "lm_head" not in names and not quant.is_quantized(model.lm_head[...])
  assert "lm_head" in quant.quantize_model(model, "int8", lm_head=True)
  assert quant.is_quantized(model.lm_head[...]) and not quant.is_quantized(model.embed[...])


# -- what the step reads -------------------------------------------------------------------------


def argument_bytes(model) -> int:
  """The compiled forward's argument bytes (weights and a [1, 1] token), from XLA."""
  f, state = logits_fn(model)
  compiled = f.lower(state, jnp.zeros((1, 1), jnp.int32)).compile()
  return compiled.memory_analysis().argument_size_in_bytes


@pytest.fixture(scope="module")
def float_bytes():
  model = model_of("gqa")
  names = quant.PROJECTIONS
  projections = sum(
    node.get_value().nbytes
    for path, node in nnx.iter_graph(model)
    if isinstance(node, nnx.Param) and path[-1] in names
  )
  return argument_bytes(model), projections


@pytest.mark.parametrize("fmt,ratio", [("int8", 1 / 4), ("fp8", 1 / 4), ("int4", 1 / 8)])
def test_the_step_reads_the_quantized_bytes(fmt, ratio, float_bytes):
  total, projections = float_bytes
  model = model_of("gqa", fmt)
  scales = sum(
    node.get_value().scale.nbytes
    for _, node in nnx.iter_graph(model)
    if isinstance(node, nnx.Param) and quant.is_quantized(node.get_value())
  )
  held = argument_bytes(model) - (total - projections)
  # Exactly the values at their width (int4: two to a byte) and the float32 scales.
  assert held == projections * ratio + scales
  assert ratio < held / projections < ratio * 1.3  # the scales: 4 bytes per channel or group
