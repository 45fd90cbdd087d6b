"""GGUF projections kept quantized (`gguf_file.read_kept`, `hf.load(gguf_weights="keep")`): Q8_0
and Q4_0 tensors become int8/int4 QArrays with one float32 scale per 32 inputs that dequantize
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
from tests.test_hf_gguf import build, write_gguf  # noqa: E402


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0])
def test_codes_and_scales_are_gguf_dequantized_values(tmp_path, qtype):
  value = np.random.RandomState(0).randn(6, 96).astype(np.float32)
  raw = gguf.quants.quantize(value, qtype)
  w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
  w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  (t,) = gguf_file.reader(tmp_path / "t.gguf").tensors
  codes, scales = gguf_file.codes_and_scales(t)
  assert codes.dtype == np.int8 and scales.shape == (6, 3)
  lo = -8 if qtype == Q.Q4_0 else -128
  assert codes.min() >= lo and codes.max() <= -lo - 1
  want = gguf.quants.dequantize(raw, qtype).reshape(value.shape)
  np.testing.assert_array_equal(codes * np.repeat(scales, 32, axis=1), want)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  path = tmp_path_factory.mktemp("gguf_kept") / "llama.gguf"
  ref = build("Llama")
  stored = write_gguf(path, ref, "llama")
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
  # attn_q, attn_output (Q8_0) and attn_k (Q4_0) kept; attn_v (Q4_1), the MLP and the rest not.
  assert sorted(str(v.qvalue.dtype) for v in q.values()) == ["int4", "int8", "int8"], q.keys()
  kept_bytes = float_bytes = 0
  for p, v in q.items():
    np.testing.assert_array_equal(np.asarray(dequantized(v)), np.asarray(floats[p]), err_msg=p)
    bits = jnp.iinfo(v.qvalue.dtype).bits
    assert v.scale.size * 32 == v.qvalue.size and v.scale.dtype == jnp.float32
    kept_bytes += v.qvalue.size * bits // 8 + v.scale.size * 4
    float_bytes += floats[p].size * 4
    # Per value: bits / 8 bytes of code and 4 / 32 of scale, (bits + 1) / 8 bytes against 4.
    assert (v.qvalue.size * bits // 8 + v.scale.size * 4) * 8 == floats[p].size * (bits + 1)
  # q_proj and o_proj (Q8_0) at 9/32 of float32's bytes, k_proj (Q4_0) at 5/32.
  sizes = {str(v.qvalue.dtype): [] for v in q.values()}
  for v in q.values():
    sizes[str(v.qvalue.dtype)].append(v.qvalue.size * 4)
  assert kept_bytes * 32 == sum(sizes["int8"]) * 9 + sum(sizes["int4"]) * 5
  assert float_bytes == sum(sizes["int8"]) + sum(sizes["int4"])
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
