"""GGUF files (llama.cpp's format, which Ollama and most local users hold), read with the `gguf`
package into the same config.json fields and tensor names a Hugging Face folder has, so that the
families' tables check and convert them as they do a folder's.

* The config comes from the `{architecture}.*` metadata (llama, qwen2, qwen3; llama.cpp writes
  Mistral's models as llama, which they are but for a sliding window: one in the metadata makes
  the model a mistral), as transformers' GGUF loader reads it; `head_dim` from
  `attention.key_length` where the file has it.
  Llama 3.1's `rope_freqs.weight` (llama.cpp's per-frequency factors) becomes the llama3 rope
  scaling that produced it, checked factor by factor.
* Tensors are dequantized at load (exactly: each block's codes times its scales, by
  `gguf.quants.dequantize`) for the float types, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants
  (Q2_K .. Q6_K). llama.cpp stores a Llama's q/k rows permuted for its own RoPE; they are put back
  in Hugging Face's order, as transformers does.
* The tokenizer, its special tokens (bos/eos/pad) and the chat template are built from the
  `tokenizer.*` metadata by transformers' own GGUF converter (transformers must be installed).

* Kept (`read_kept`, `hf.load(gguf_weights="keep")`, the default): a projection's Q8_0, Q4_0 or
  Q6_K tensor stays 8- or 4-bit on the device. Q8_0's block of 32 codes times one f16 scale is
  exactly a qwix QArray of int8 codes (Q4_0: int4 codes q - 8 in [-8, 7]) with one float32 scale
  per 32 inputs of each row; Q6_K's 6-bit codes (q - 32, in [-32, 31]) are int8 with one float32
  scale d * sc per 16 inputs (the product of an f16 and an int8 is exact in float32). The kept
  weight dequantizes to the very floats `dequantize` gives. The codes and their scales go through
  the family's mapping as an FP8 folder's do (`fp8.kept_weight`); llama.cpp's q/k row order is
  undone on both (the groups run along the inputs, so a row's scales move with it). Every other
  type, and the embeddings and LM head (gathered from floats), is dequantized: the types with a
  minimum or offset (Q4_1, Q5_0, Q5_1, Q2_K .. Q5_K) would need qwix zero points.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from atlas_jax.hf.common import HFLoadError

MAGIC = b"GGUF"
MODEL_TYPES = ("llama", "qwen2", "qwen3")
# Tensor types `read_tensors` dequantizes (names as gguf.GGMLQuantizationType spells them).
SUPPORTED_TYPES = (
  "F32",
  "F16",
  "BF16",
  "Q8_0",
  "Q4_0",
  "Q4_1",
  "Q5_0",
  "Q5_1",
  "Q2_K",
  "Q3_K",
  "Q4_K",
  "Q5_K",
  "Q6_K",
)
# llama.cpp's tensor names -> Hugging Face's (after "blk.N." -> "model.layers.N.").
MODEL_NAMES = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
  "attn_norm": "input_layernorm",
  "attn_q": "self_attn.q_proj",
  "attn_k": "self_attn.k_proj",
  "attn_v": "self_attn.v_proj",
  "attn_output": "self_attn.o_proj",
  "attn_q_norm": "self_attn.q_norm",
  "attn_k_norm": "self_attn.k_norm",
  "ffn_norm": "post_attention_layernorm",
  "ffn_gate": "mlp.gate_proj",
  "ffn_up": "mlp.up_proj",
  "ffn_down": "mlp.down_proj",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"


def is_gguf(path: str | Path) -> bool:
  """Whether `path` is a file that starts with GGUF's magic."""
  path = Path(path)
  if not path.is_file():
    return False
  with path.open("rb") as f:
    return f.read(4) == MAGIC


def _gguf():
  try:
    import gguf
  except ImportError as e:  # pragma: no cover - a declared dependency
    raise HFLoadError(f"reading a GGUF file needs the gguf package (pip install gguf): {e}") from e
  return gguf


def reader(path: str | Path):
  """The file's `gguf.GGUFReader` (memory-mapped: no tensor is read yet)."""
  try:
    return _gguf().GGUFReader(str(path))
  except Exception as e:  # gguf raises ValueError, struct errors and OSError alike
    raise HFLoadError(f"{path}: not a readable GGUF file: {type(e).__name__}: {e}") from e


def metadata(r) -> dict[str, Any]:
  """Every metadata key but the tokenizer's arrays -> its value."""
  out = {}
  for key, f in r.fields.items():
    if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "merges", "scores", "types")):
      continue
    out[key] = f.contents()
  return out


def _vocab_size(r, meta: dict[str, Any], arch: str) -> int | None:
  if isinstance(meta.get(f"{arch}.vocab_size"), int):
    return meta[f"{arch}.vocab_size"]
  tokens = r.fields.get("tokenizer.ggml.tokens")
  return len(tokens.data) if tokens is not None else None


def llama3_rope(freqs: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
  """The llama3 `rope_scaling` whose per-frequency factors are `freqs` (llama.cpp writes them as
  `rope_freqs.weight` instead of the four numbers): Meta's published settings (low 1, high 4,
  original context 8192) with the largest factor, checked against every factor."""
  factor = float(np.max(freqs))
  scaling = dict(
    rope_type="llama3",
    factor=factor,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
  )
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  wavelen = 2 * np.pi / inv_freq
  old, low, high = 8192, 1.0, 4.0
  smooth = (old / wavelen - low) / (high - low)
  want = np.where(
    wavelen < old / high,
    1.0,
    np.where(wavelen > old / low, factor, 1.0 / ((1 - smooth) / factor + smooth)),
  )
  if freqs.shape != want.shape or not np.allclose(freqs, want, rtol=1e-3):
    raise HFLoadError(
      f"{ROPE_FREQS}: per-frequency rope factors {np.round(freqs[:4], 4).tolist()}... are not "
      f"llama3 scaling with factor {factor}, low_freq_factor 1, high_freq_factor 4, original "
      "context 8192; only those are supported"
    )
  return scaling


def config(r, meta: dict[str, Any] | None = None) -> dict[str, Any]:
  """The config.json fields the file's metadata gives (no tensor is read but `rope_freqs`)."""
  meta = metadata(r) if meta is None else meta
  arch = meta.get("general.architecture")
  if arch not in MODEL_TYPES:
    raise HFLoadError(
      f"GGUF general.architecture={arch!r} is not supported; supported: {', '.join(MODEL_TYPES)}"
    )

  def get(key, default=None):
    value = meta.get(f"{arch}.{key}", default)
    if value is None:
      raise HFLoadError(f"GGUF metadata lacks '{arch}.{key}'")
    return value

  n_heads = get("attention.head_count")
  hidden = get("embedding_length")
  head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
  names = {t.name for t in r.tensors}
  hf: dict[str, Any] = {
    "model_type": arch,
    "hidden_size": hidden,
    "intermediate_size": get("feed_forward_length"),
    "num_hidden_layers": get("block_count"),
    "num_attention_heads": n_heads,
    "num_key_value_heads": get("attention.head_count_kv", n_heads),
    "head_dim": head_dim or hidden // n_heads,
    "max_position_embeddings": get("context_length", 4096),
    "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
    "rope_theta": float(get("rope.freq_base", 10000.0)),
    "vocab_size": _vocab_size(r, meta, arch),
    "tie_word_embeddings": "output.weight" not in names,
    "hidden_act": "silu",
  }
  if meta.get(f"{arch}.attention.sliding_window"):
    hf["sliding_window"] = meta[f"{arch}.attention.sliding_window"]
    if arch == "llama":
      hf["model_type"] = "mistral"
    else:
      hf["use_sliding_window"] = True  # rejected by the family, naming it
  kind = meta.get(f"{arch}.rope.scaling.type")
  if kind not in (None, "none"):
    hf["rope_scaling"] = {"rope_type": kind, "factor": meta.get(f"{arch}.rope.scaling.factor")}
    if meta.get(f"{arch}.rope.scaling.original_context_length") is not None:
      hf["rope_scaling"]["original_max_position_embeddings"] = meta[
        f"{arch}.rope.scaling.original_context_length"
      ]
  if ROPE_FREQS in names:
    (t,) = [t for t in r.tensors if t.name == ROPE_FREQS]
    freqs = np.asarray(dequantize(t), np.float64).reshape(-1)
    hf["rope_scaling"] = llama3_rope(freqs, hf["head_dim"], hf["rope_theta"])
  return hf


def dequantize(t) -> np.ndarray:
  """One `gguf.ReaderTensor` as float32 in numpy's (Hugging Face's) order: [out, in]."""
  gguf = _gguf()
  kind = gguf.GGMLQuantizationType(t.tensor_type).name
  if kind not in SUPPORTED_TYPES:
    raise HFLoadError(
      f"GGUF tensor {t.name} has type {kind}; supported types: {', '.join(SUPPORTED_TYPES)}"
    )
  values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
  return np.asarray(values, np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row order (each head's rotary halves interleaved, for its RoPE)."""
  rows = w.shape[0]
  return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(name: str) -> str:
  if name in MODEL_NAMES:
    return MODEL_NAMES[name]
  m = _LAYER.fullmatch(name)
  if m is None or m.group(2) not in LAYER_NAMES:
    raise HFLoadError(f"GGUF tensor {name} is not one this importer knows (llama-family layers)")
  return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def read_tensors(r, hf: dict[str, Any], dtype: Any = np.float32) -> dict[str, np.ndarray]:
  """Every tensor under its Hugging Face name, dequantized and cast to `dtype` one at a time."""
  return read_kept(r, hf, dtype, keep=False)[0]


# Types kept as QArrays (`read_kept`): name -> (bytes per block, values per block, codes' dtype,
# values per scale).
KEPT_TYPES = {
  "Q8_0": (34, 32, "int8", 32),
  "Q4_0": (18, 32, "int4", 32),
  "Q6_K": (210, 256, "int8", 16),
}


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q6_K super-blocks of 256 values (bytes: 128 of low nibbles, 64 of high 2-bit pairs, 16 int8
  sub-scales, an f16 d) -> (int8[n, 256] codes in [-32, 31], float32[n, 16] scales d * sc).
  Each half of 128 values: value k < 64 has ql[k]'s low nibble, 64 + k its high one; value
  32 j + i takes bits 2j, 2j + 1 of qh[i] as its top two bits; the code is that 6-bit q - 32."""
  n = blocks.shape[0]
  ql = blocks[:, :128].reshape(n, 2, 64)
  qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
  sub = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
  d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
  low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # [n, 2, 128]
  high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 0x03  # [n, 2, 4, 32]
  q = (low | (high.reshape(n, 2, 128) << 4)).astype(np.int8) - 32
  return q.reshape(n, 256), d * sub


def codes_and_scales(t) -> tuple[np.ndarray, np.ndarray]:
  """A Q8_0/Q4_0/Q6_K `gguf.ReaderTensor`'s codes, int8[out, in] (Q4_0's q - 8, in [-8, 7]; Q6_K's
  q - 32, in [-32, 31]), and scales, float32[out, in / group], from its raw blocks: Q8_0 an f16
  scale d then 32 int8 codes; Q4_0 d then 16 bytes of nibbles, low nibbles elements 0..15 and
  high ones 16..31 (value d * (q - 8)); Q6_K as `_q6_k` unpacks, a scale per 16. codes * scales
  (each scale repeated over its group) is `dequantize`'s value, bit for bit."""
  gguf = _gguf()
  kind = gguf.GGMLQuantizationType(t.tensor_type).name
  if kind not in KEPT_TYPES:
    raise HFLoadError(f"GGUF tensor {t.name} has type {kind}; kept types: {', '.join(KEPT_TYPES)}")
  size, _, _, group = KEPT_TYPES[kind]
  out, inp = (int(n) for n in reversed(t.shape))
  blocks = np.asarray(t.data).view(np.uint8).reshape(-1, size)
  if kind == "Q6_K":
    codes, scales = _q6_k(blocks)
  else:
    scales = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    body = blocks[:, 2:]
    if kind == "Q8_0":
      codes = body.copy().view(np.int8)
    else:
      codes = np.concatenate([body & 0x0F, body >> 4], axis=1).astype(np.int8) - 8
  return codes.reshape(out, inp), scales.reshape(out, inp // group)


def _keepable(r) -> set[str]:
  """The projections' names (less "blk.N.") whose tensors `read_kept` keeps: of a kept type in
  every layer, the same codes' dtype and group in all (the layers' QArrays stack into one)."""
  gguf = _gguf()
  forms: dict[str, set] = {}
  for t in r.tensors:
    key = re.sub(r"^blk\.\d+\.", "", t.name)
    kind = gguf.GGMLQuantizationType(t.tensor_type).name
    forms.setdefault(key, set()).add(KEPT_TYPES[kind][2:] if kind in KEPT_TYPES else None)
  return {
    key
    for key, f in forms.items()
    if len(f) == 1 and None not in f and _projection(key) is not None
  }


def _projection(key: str) -> str | None:
  """Whether a layer tensor's name less "blk.N." is a projection's weight: its Hugging Face
  suffix, else None."""
  m = re.fullmatch(r"(\w+)\.weight", key)
  if m is None or m.group(1) not in LAYER_NAMES or not LAYER_NAMES[m.group(1)].endswith("_proj"):
    return None
  return LAYER_NAMES[m.group(1)]


def read_kept(r, hf: dict[str, Any], dtype: Any = np.float32, *, keep: bool = True):
  """(tensors, scales, report): every tensor under its Hugging Face name, a projection's Q8_0,
  Q4_0 or Q6_K tensor as its codes (int8 or int4) with its scales in `scales` (an `fp8.Scales`
  of 1 x 32 blocks, 1 x 16 for Q6_K, the form `weights.params_from_tensors` keeps as QArrays)
  where every layer's is of one such form (`_keepable`), the rest dequantized to `dtype` (all of
  them without `keep`); report: {"kept": {type: count}, "dequantized": {type: count}}."""
  import jax.numpy as jnp

  from atlas_jax.hf import fp8

  gguf = _gguf()
  out, by_weight, blocks = {}, {}, {}
  report: dict[str, dict[str, int]] = {"kept": {}, "dequantized": {}}
  permuted = hf["model_type"] in ("llama", "mistral")
  keepable = _keepable(r) if keep else set()
  for t in r.tensors:
    if t.name == ROPE_FREQS:
      continue
    name = hf_name(t.name)
    kind = gguf.GGMLQuantizationType(t.tensor_type).name
    heads = None
    if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
      kv = name.endswith("k_proj.weight")
      heads = hf["num_key_value_heads"] if kv else hf["num_attention_heads"]
    if re.sub(r"^blk\.\d+\.", "", t.name) in keepable:
      codes, scales = codes_and_scales(t)
      if heads is not None:  # rows move with their scales: the groups run along the inputs
        codes, scales = unpermute(codes, heads), unpermute(scales, heads)
      out[name] = jnp.asarray(codes, jnp.dtype(KEPT_TYPES[kind][2]))
      by_weight[name] = scales
      blocks[name] = (1, KEPT_TYPES[kind][3])
      report["kept"][kind] = report["kept"].get(kind, 0) + 1
      continue
    w = dequantize(t)
    if heads is not None:
      w = unpermute(w, heads)
    out[name] = w.astype(dtype)
    report["dequantized"][kind] = report["dequantized"].get(kind, 0) + 1
  scales = fp8.Scales(by_weight, (1, 32), "none", blocks=blocks) if by_weight else None
  return out, scales, report


def read(path: str | Path, dtype: Any = np.float32) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """(config.json fields, {Hugging Face name: tensor}) of a GGUF file."""
  r = reader(path)
  hf = config(r)
  return hf, read_tensors(r, hf, dtype)


def file_config(path: str | Path) -> dict[str, Any]:
  """The config.json fields of a GGUF file, from its metadata alone."""
  return config(reader(path))


def tokenizer_parts(path: str | Path) -> dict[str, Any]:
  """{"tokenizer": a `tokenizers.Tokenizer`, "bos"/"eos"/"pad": special tokens' text ("" for
  none), "eos_ids", "chat_template": str or None}, built from the file's metadata by
  transformers' GGUF converter (as `AutoTokenizer.from_pretrained(..., gguf_file=...)` does)."""
  path = Path(path)
  try:
    from transformers import AutoTokenizer
  except ImportError as e:
    raise HFLoadError(
      f"{path}: a GGUF file's tokenizer is built by transformers' GGUF converter; install "
      f"transformers (pip install 'atlas-jax[hf]'): {e}"
    ) from e
  try:
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  except Exception as e:  # the converter raises whatever the metadata provokes
    raise HFLoadError(
      f"{path}: transformers cannot build the tokenizer: {type(e).__name__}: {e}"
    ) from e
  text = lambda t: t if isinstance(t, str) else ""
  eos_id = tok.eos_token_id
  template = tok.chat_template if isinstance(tok.chat_template, str) else None
  return {
    "tokenizer": tok.backend_tokenizer,
    "bos": text(tok.bos_token),
    "eos": text(tok.eos_token),
    "pad": text(tok.pad_token),
    "eos_ids": (eos_id,) if isinstance(eos_id, int) else None,
    "chat_template": template,
    "special_tokens": {
      k: v for k in ("bos_token", "eos_token", "unk_token", "pad_token") if (v := getattr(tok, k))
    },
  }
