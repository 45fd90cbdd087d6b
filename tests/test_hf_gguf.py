"""GGUF files (llama.cpp's format) written here with the gguf package's writer from tiny random
transformers models: every tensor type we dequantize but Q2_K and Q3_K (the float types; Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1 through gguf's quantizer; Q4_K, Q5_K and Q6_K blocks of random codes with
finite scales, which it does not quantize), Llama's q/k rows permuted as llama.cpp stores them.
Checked against transformers' own GGUF loader: the same dequantized weights, logits to float
tolerance, greedy tokens equal, and the tokenizer, special tokens and chat template it builds from
the file's metadata."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it

from gguf import GGMLQuantizationType as Q  # noqa: E402
from tokenizers import pre_tokenizers  # noqa: E402

from atlas_jax import hf  # noqa: E402
from atlas_jax.decoding.generate import SamplingParams, generate  # noqa: E402
from atlas_jax.hf import gguf_file  # noqa: E402
from atlas_jax.hf.tokenizer import load_tokenizer  # noqa: E402
from atlas_jax.serving import model_files  # noqa: E402
from tests.hf_reference import TINY, hf_greedy, hf_logits  # noqa: E402
from tests.hf_reference import build as build_reference  # noqa: E402

MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r", "Ġ a", "o u", "Ġ i", "Ġi n"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES]
TOKENS += SPECIALS
V = len(TOKENS)
ENDOFTEXT, IM_START, IM_END = (TOKENS.index(t) for t in SPECIALS)
CHATML = (
  "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXTS = ["the inner tree", "Hello, how are you?", " in  a  house\n\tof  ünïcödé 😀", ""]
LAYER_NAMES = {v: k for k, v in gguf_file.LAYER_NAMES.items()}
MODEL_NAMES = {v: k for k, v in gguf_file.MODEL_NAMES.items()}
# Tensor types by llama.cpp's name (after "blk.N."); the rest F32. ffn_down: one K-quant a layer.
TYPES = {
  "token_embd": Q.F16,
  "output": Q.BF16,
  "attn_q": Q.Q8_0,
  "attn_k": Q.Q4_0,
  "attn_v": Q.Q4_1,
  "attn_output": Q.Q8_0,
  "ffn_gate": Q.Q5_0,
  "ffn_up": Q.Q5_1,
}
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def build(family: str, **overrides):
  """A tiny random `family` model (not saved: the tests write it as GGUF)."""
  config = dict(
    TINY,
    vocab_size=V,
    intermediate_size=256,  # a K-quant block spans 256 inputs: ffn_down holds one a row
    num_hidden_layers=3,
    rms_norm_eps=1e-5,
  )
  return build_reference(family, None, {**config, **overrides})


def gguf_name(name: str) -> str:
  if name in MODEL_NAMES:
    return MODEL_NAMES[name]
  _, _, i, *mid, suffix = name.split(".")
  return f"blk.{i}.{LAYER_NAMES['.'.join(mid)]}.{suffix}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's q/k row order for a Llama (convert_hf_to_gguf's permute)."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def k_quant_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
  """Random K-quant codes with small finite f16 super-block scales (d, and dmin where it has
  one), as the bytes the file stores: [rows, cols / 256 * block bytes]."""
  size = gguf.GGML_QUANT_SIZES[qtype][1]
  raw = rng.randint(0, 256, (rows, cols // 256, size)).astype(np.uint8)
  f16 = lambda lo, hi: rng.uniform(lo, hi, raw.shape[:2]).astype(np.float16)
  if qtype == Q.Q6_K:  # ql, qh, int8 scales, then d
    raw[..., -2:] = f16(2e-4, 4e-4)[..., None].view(np.uint8)
  else:  # d, dmin, then the 6-bit scales and codes
    raw[..., 0:2] = f16(2e-4, 4e-4)[..., None].view(np.uint8)
    raw[..., 2:4] = f16(1e-4, 2e-4)[..., None].view(np.uint8)
  return raw.reshape(rows, -1)


def write_gguf(path, model, arch: str, *, bos=None, eos=IM_END, add_bos=False, **extra):
  """`model` as a GGUF file of `arch`: TYPES' quantizations, K-quant ffn_down, a byte-level BPE;
  `extra`: rope_freqs (llama.cpp's rope factors tensor), sliding_window."""
  cfg = model.config
  w = gguf.GGUFWriter(str(path), arch)
  if extra.get("sliding_window"):
    w.add_sliding_window(extra["sliding_window"])
  w.add_block_count(cfg.num_hidden_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_attention_heads)
  w.add_head_count_kv(cfg.num_key_value_heads)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
  head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
  w.add_rope_dimension_count(head_dim)
  w.add_key_length(head_dim)
  w.add_value_length(head_dim)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "default")
  w.add_token_list(TOKENS)
  w.add_token_types([1] * (V - len(SPECIALS)) + [3] * len(SPECIALS))
  w.add_token_merges(MERGES)
  if bos is not None:
    w.add_bos_token_id(bos)
  w.add_eos_token_id(eos)
  w.add_pad_token_id(ENDOFTEXT)
  w.add_add_bos_token(add_bos)
  w.add_chat_template(CHATML)
  rng = np.random.RandomState(1)
  dequantized = {}  # what the file holds, in Hugging Face's order
  for name, t in model.state_dict().items():
    value, g = t.numpy().astype(np.float32), gguf_name(name)
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
      heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
      value = permute(value, heads)
    kind = g.split(".")[-2]
    if kind == "ffn_down":
      qtype = K_QUANTS[int(g.split(".")[1]) % len(K_QUANTS)]
      raw = k_quant_blocks(*value.shape, qtype, rng)
    elif value.ndim == 2 and kind in TYPES:
      qtype = TYPES[kind]
      raw = value.astype(np.float16) if qtype == Q.F16 else gguf.quants.quantize(value, qtype)
    else:
      qtype, raw = Q.F32, value
    if qtype in (Q.F32, Q.F16):
      w.add_tensor(g, raw)
    else:
      w.add_tensor(g, raw, raw_dtype=qtype)
    dequantized[name] = gguf.quants.dequantize(raw, qtype).reshape(value.shape)
  if extra.get("rope_freqs") is not None:
    w.add_tensor(gguf_file.ROPE_FREQS, extra["rope_freqs"].astype(np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return dequantized


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("gguf")
  out = {}
  for arch, family, bos, eos, add_bos in (
    ("llama", "Llama", IM_START, IM_END, True),
    ("qwen2", "Qwen2", ENDOFTEXT, IM_END, False),
    ("qwen3", "Qwen3", ENDOFTEXT, IM_END, False),  # head_dim 128: transformers' GGUF default
  ):
    path = root / f"{arch}.gguf"
    stored = write_gguf(path, build(family), arch, bos=bos, eos=eos, add_bos=add_bos)
    ref = transformers.AutoModelForCausalLM.from_pretrained(root, gguf_file=path.name).eval()
    out[arch] = dict(path=path, stored=stored, ref=ref, ours=hf.load(path))
  return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_weights_are_transformers_dequantized_ones(files, arch):
  f = files[arch]
  ref = f["ref"].state_dict()
  hf_config, tensors = gguf_file.read(f["path"])
  assert hf_config["model_type"] == arch and hf_config["vocab_size"] == V
  assert set(tensors) == set(f["stored"])
  for name, value in tensors.items():
    np.testing.assert_array_equal(value, ref[name].numpy(), err_msg=name)
  # The Llama's q/k rows are back in Hugging Face's order: llama.cpp's permutation gives the
  # file's rows back, which differ.
  q = "model.layers.0.self_attn.q_proj.weight"
  if arch == "llama":
    assert np.abs(permute(tensors[q], 4) - f["stored"][q]).max() == 0
    assert np.abs(tensors[q] - f["stored"][q]).max() > 0.1


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_logits_and_greedy_tokens_match_transformers(files, arch):
  f = files[arch]
  cfg = f["ours"].cfg
  assert (cfg.n_layers, cfg.d_model, cfg.vocab_size) == (3, 64, V)
  assert (cfg.qkv_bias, cfg.qk_norm) == (arch == "qwen2", arch == "qwen3")
  toks = np.random.RandomState(0).randint(0, V, (2, 40))
  got = np.asarray(f["ours"](jnp.asarray(toks, jnp.int32)))
  want = hf_logits(f["ref"], toks)
  assert np.abs(got - want).max() <= 1e-4, (arch, np.abs(got - want).max())
  if arch == "qwen3":
    return  # greedy decoding: the two families' code paths are covered by llama and qwen2
  prompts = [[5, 17, 3, 99, 42, 8, 1], [60, 2, 33]]
  got = generate(f["ours"], prompts, SamplingParams(max_new_tokens=16))
  assert got == [hf_greedy(f["ref"], prompt, 16) for prompt in prompts]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_special_tokens_and_template_are_transformers(files, arch):
  path = files[arch]["path"]
  want = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
  ours = load_tokenizer(path, V)
  for text in TEXTS:
    ids = want(text).input_ids
    assert ours.encode(text, add_special_tokens=True) == ids, text
    assert ours.decode(ids[1:] if arch == "llama" else ids) == text
  assert ours.encode("", add_special_tokens=True) == ([IM_START] if arch == "llama" else [])
  assert (ours.bos_token, ours.eos_ids, ours.pad_id) == (want.bos_token, (IM_END,), ENDOFTEXT)
  messages = [{"role": "user", "content": "the inner tree"}]
  template = model_files.chat_template(path, ours)
  assert template is not None
  rendered = template.render(messages, add_generation_prompt=True)
  assert rendered == want.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_llama3_rope_freqs_become_its_rope_scaling(tmp_path):
  """llama.cpp keeps Llama 3.1's rope scaling as per-frequency factors (rope_freqs.weight), which
  transformers' GGUF loader drops: checked against the folder's own transformers model."""
  rope = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
    rope_theta=500000.0,
  )
  model = build("Llama", rope_parameters=rope, num_hidden_layers=1)
  head_dim, theta = 16, rope["rope_theta"]
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
  wavelen = 2 * np.pi / inv
  smooth = (8192 / wavelen - 1) / 3
  freqs = np.where(
    wavelen < 8192 / 4, 1.0, np.where(wavelen > 8192, 8.0, 1 / ((1 - smooth) / 8 + smooth))
  )
  assert 1.0 < freqs.max() and freqs.min() == 1.0  # every branch of the formula is exercised
  write_gguf(tmp_path / "m.gguf", model, "llama", rope_freqs=freqs)
  ours = hf.load(tmp_path / "m.gguf")
  s = ours.cfg.rope_scaling
  assert (s.type, s.factor, s.original_max_position_embeddings) == ("llama3", 8.0, 8192)
  # the file's weights in a transformers model with the scaling: the file's logits
  stored = gguf_file.read(tmp_path / "m.gguf")[1]
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(torch.from_numpy(stored[name]))
  toks = np.arange(60)[None] % V
  got = np.asarray(ours(jnp.asarray(toks, jnp.int32)))
  assert np.abs(got - hf_logits(model, toks)).max() <= 1e-4
  bad = freqs.copy()
  bad[1] = 3.0
  write_gguf(tmp_path / "b.gguf", model, "llama", rope_freqs=bad)
  with pytest.raises(hf.HFLoadError, match="rope_freqs.weight: per-frequency rope factors"):
    hf.load(tmp_path / "b.gguf")


def test_a_llama_file_with_a_sliding_window_is_a_mistral(tmp_path):
  """llama.cpp writes Mistral's models as llama; a sliding window in the metadata makes the
  model a mistral, checked against transformers' Mistral past the window."""
  model = build("Mistral", sliding_window=8, num_hidden_layers=1)
  write_gguf(tmp_path / "m.gguf", model, "llama", sliding_window=8)
  ours = hf.load(tmp_path / "m.gguf")
  assert ours.cfg.sliding_window == 8
  stored = gguf_file.read(tmp_path / "m.gguf")[1]
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(torch.from_numpy(stored[name]))
  toks = np.arange(3, 33)[None] % V
  got = np.asarray(ours(jnp.asarray(toks, jnp.int32)))
  assert np.abs(got - hf_logits(model, toks)).max() <= 1e-4


def test_unsupported_files_are_named(tmp_path):
  w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
  w.add_block_count(1)
  w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(hf.HFLoadError, match="general.architecture='gpt2' is not supported"):
    hf.load(tmp_path / "g.gguf")
  (tmp_path / "t.gguf").write_bytes(b"GGUF" + b"\0" * 7)
  with pytest.raises(hf.HFLoadError, match="not a readable GGUF file"):
    hf.load(tmp_path / "t.gguf")
  (tmp_path / "x.bin").write_bytes(b"nope")
  with pytest.raises(hf.HFLoadError, match="not a folder or a GGUF file"):
    hf.load(tmp_path / "x.bin")


def test_serve_py_answers_over_http_as_transformers(files):
  """serve.py --checkpoint FILE.gguf: the prompt ids, greedy completion and chat prompt are
  transformers' (its GGUF tokenizer and model, stopping on the file's eos)."""
  import sys
  from pathlib import Path

  import httpx

  from .serving.conftest import serving_app

  sys.path.insert(0, str(Path(__file__).parents[1]))
  import serve

  f = files["llama"]
  tok = transformers.AutoTokenizer.from_pretrained(f["path"].parent, gguf_file=f["path"].name)
  flags = ["--max-batch", "2", "--block-size", "8", "--max-num-batched-tokens", "32"]
  flags += ["--prefill-chunk", "32", "--max-model-len", "64", "--log-level", "warning"]
  args = serve.parse_args(["--checkpoint", str(f["path"]), "--port", "1", *flags])
  engine, tokenizer, template, _ = serve.prepare(args)
  app, runner = serve.build_server(args, engine, tokenizer, template)

  def post(url, path, body):
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()

  with serving_app(app, runner) as url:
    for text in ("the inner tree", "Hello"):
      ids = tok(text).input_ids
      assert post(url, "/tokenize", {"prompt": text})["tokens"] == ids
      r = post(url, "/v1/completions", {"prompt": text, "max_tokens": 8, "temperature": 0})
      with torch.no_grad():
        out = f["ref"].generate(
          torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=IM_END
        )
      new = out[0, len(ids) :].tolist()
      assert r["choices"][0]["text"] == tok.decode(new, skip_special_tokens=True)
      usage = r["usage"]
      assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), len(new))
      stopped = new[-1] == IM_END
      assert r["choices"][0]["finish_reason"] == ("stop" if stopped else "length")
    messages = [{"role": "user", "content": "the inner tree"}]
    want = tok.apply_chat_template(
      messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert post(url, "/tokenize", {"messages": messages})["tokens"] == want


def test_sentencepiece_tokenizer_is_transformers(tmp_path):
  """A Llama-2-style vocabulary (tokenizer.ggml.model "llama": scored pieces, <0xNN> byte
  fallback, <s> added in front): ids, text and special tokens as transformers builds them."""
  pieces = ["▁", "▁t", "he", "▁the", "in", "▁in", "er", "▁a", "ou", "▁H", "ello"]
  pieces += list("abcdefghijklmnopqrstuvwxyzH,?!.")
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces
  w = gguf.GGUFWriter(str(tmp_path / "s.gguf"), "llama")
  w.add_block_count(1)
  w.add_tokenizer_model("llama")
  w.add_token_list(tokens)
  w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
  w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_unk_token_id(0)
  w.add_add_bos_token(True)
  w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  want = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="s.gguf")
  ours = load_tokenizer(tmp_path / "s.gguf", len(tokens))
  for text in TEXTS:
    ids = want(text).input_ids
    assert ours.encode(text, add_special_tokens=True) == ids and ids[0] == 1, text
    assert ours.decode(ids) == want.decode(ids, skip_special_tokens=True)
  assert 259 < max(want(TEXTS[1]).input_ids) and 3 <= min(want(TEXTS[2]).input_ids[1:]) < 259
  assert (ours.bos_token, ours.eos_token, ours.eos_ids) == ("<s>", "</s>", (2,))
