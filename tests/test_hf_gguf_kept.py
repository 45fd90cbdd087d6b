"""GGUF projections kept quantized (`gguf_file.read_kept`, `hf.load(gguf_weights="keep")`): Q8_0,
Q4_0 and Q6_K tensors become int8/int4 QArrays with one float32 scale per 32 (Q6_K: 16) inputs
that dequantize
bit for bit to `gguf.quants.dequantize`'s values, through the family's mapping and llama.cpp's q/k
row permutation; the model's logits and greedy tokens are the dequantized load's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from qwix import QArray  # noqa: E402

from atlas_jax import hf  # noqa: E402
from atlas_jax.decoding.generate import SamplingParams, generate  # noqa: E402
from atlas_jax.hf import gguf_file  # noqa: E402
from atlas_jax.quant import dequantized  # noqa: E402
from tests import test_hf_gguf  # noqa: E402
from tests.test_hf_gguf import build, k_quant_blocks, write_gguf  # noqa: E402


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q6_K])
def test_codes_and_scales_are_gguf_dequantized_values(tmp_path, qtype):
  rng = np.random.RandomState(0)
  value = rng.randn(6, 512).astype(np.float32)
  if qtype == Q.Q6_K:  # gguf does not quantize Q6_K: random codes, sub-scales and d
    raw = k_quant_blocks(*value.shape, qtype, rng)
  else:
    raw = gguf.quants.quantize(value, qtype)
  w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
  w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  (t,) = gguf_file.reader(tmp_path / "t.gguf").tensors
  codes, scales = gguf_file.codes_and_scales(t)
  group = 16 if qtype == Q.Q6_K else 32
  assert codes.dtype == np.int8 and scales.shape == (6, 512 // group)
  lo = {Q.Q4_0: -8, Q.Q6_K: -32}.get(qtype, -128)
  assert codes.min() >= lo and codes.max() <= -lo - 1
  want = gguf.quants.dequantize(raw, qtype).reshape(value.shape)
  np.testing.assert_array_equal(codes * np.repeat(scales, group, axis=1), want)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  path = tmp_path_factory.mktemp("gguf_kept") / "llama.gguf"
  ref = build("Llama")
  saved = test_hf_gguf.K_QUANTS
  test_hf_gguf.K_QUANTS = (Q.Q6_K,)  # ffn_down Q6_K in every layer
  try:
    stored = write_gguf(path, ref, "llama")
  finally:
    test_hf_gguf.K_QUANTS = saved
  return dict(
    path=path,
    stored=stored,
    kept=hf.load(path),
    floats=hf.load(path, gguf_weights="dequantize"),
  )


def _params(model):
  from flax import nnx

  leaves = jax.tree_util.tree_flatten_with_path(
    nnx.state(model), is_leaf=lambda x: isinstance(x, QArray)
  )[0]
  return {jax.tree_util.keystr(p): v for p, v in leaves}


def test_kept_weights_dequantize_exactly_and_are_smaller(llama):
  kept, floats = _params(llama["kept"]), _params(llama["floats"])
  assert kept.keys() == floats.keys()
  q = {p: v for p, v in kept.items() if isinstance(v, QArray)}
  # attn_q, attn_output (Q8_0), attn_k (Q4_0) and ffn_down (Q6_K) kept; attn_v (Q4_1), gate
  # and up (Q5_0, Q5_1) and the rest not.
  groups = sorted((str(v.qvalue.dtype), v.qvalue.size // v.scale.size) for v in q.values())
  assert groups == [("int4", 32), ("int8", 16), ("int8", 32), ("int8", 32)], q.keys()
  kept_bytes = float_bytes = 0
  for p, v in q.items():
    np.testing.assert_array_equal(np.asarray(dequantized(v)), np.asarray(floats[p]), err_msg=p)
    bits = jnp.iinfo(v.qvalue.dtype).bits
    group = v.qvalue.size // v.scale.size
    assert v.scale.dtype == jnp.float32
    kept_bytes += v.qvalue.size * bits // 8 + v.scale.size * 4
    float_bytes += floats[p].size * 4
    # Per value: bits / 8 bytes of code and 4 / group of scale, against 4 bytes.
    want = floats[p].size * (bits * group + 32) // (8 * group)
    assert v.qvalue.size * bits // 8 + v.scale.size * 4 == want
  # q_proj and o_proj (Q8_0) at 9/32 of float32's bytes, k_proj (Q4_0) at 5/32, down_proj
  # (Q6_K as int8, a scale per 16) at 10/32.
  ratio = {("int8", 32): 9, ("int4", 32): 5, ("int8", 16): 10}
  expect = sum(
    v.qvalue.size * 4 * ratio[str(v.qvalue.dtype), v.qvalue.size // v.scale.size]
    for v in q.values()
  )
  assert kept_bytes * 32 == expect and kept_bytes * 32 < float_bytes * 10
  for p, v in kept.items():
    if not isinstance(v, QArray):
      np.testing.assert_array_equal(np.asarray(v), np.asarray(floats[p]), err_msg=p)


def test_kept_logits_and_greedy_tokens_are_the_dequantized_loads(llama):
  toks = jnp.asarray(np.random.RandomState(0).randint(0, llama["kept"].cfg.vocab_size, (2, 24)))
  got, want = np.asarray(llama["kept"](toks)), np.asarray(llama["floats"](toks))
  assert np.abs(got - want).max() <= 1e-5, np.abs(got - want).max()
  prompts = [[5, 17, 3, 99, 42, 8, 1], [60, 2, 33]]
  params = SamplingParams(max_new_tokens=12)
  assert generate(llama["kept"], prompts, params) == generate(llama["floats"], prompts, params)


def test_unknown_gguf_weights_option_is_named(llama):
  with pytest.raises(hf.HFLoadError, match="gguf_weights='packed'"):
    hf.load(llama["path"], gguf_weights="packed")


def test_log_names_the_kept_and_dequantized_types(llama, caplog):
  with caplog.at_level("INFO", logger="atlas_jax.hf"):
    hf.load(llama["path"])
  (line,) = [r.getMessage() for r in caplog.records if "GGUF projections kept" in r.getMessage()]
  assert "{'Q8_0': 6, 'Q4_0': 3, 'Q6_K': 3}" in line, line
  assert "'Q4_1': 3" in line and "'Q5_0': 3" in line and "'Q5_1': 3" in line, line
