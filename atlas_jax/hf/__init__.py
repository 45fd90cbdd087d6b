"""Hugging Face import and export for the Llama family (Llama, Mistral, Qwen2, Qwen3).

    model = atlas_jax.hf.load("path/to/folder")          # config.json + *.safetensors
    logits_BTV = model(tokens_BT)                          # matches transformers' logits
    tokenizer = atlas_jax.hf.load_tokenizer("path/to/folder")

Weights are read with safetensors straight into jax arrays (single file or sharded with an index),
reshaped from torch's [out, in] Linear layout into our einsum layouts, and stacked over layers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from atlas_jax.config import ConfigError, ModelConfig, RopeScaling
from atlas_jax.model import Transformer, build

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "deepseek_v3")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class HFLoadError(ValueError):
  """A Hugging Face folder that cannot be imported (unsupported, incomplete or inconsistent)."""


def _read_json(path: Path) -> dict[str, Any]:
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except FileNotFoundError:
    raise HFLoadError(
      f"{path.parent}: no {path.name} (expected a Hugging Face model folder)"
    ) from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise HFLoadError(f"{path}: not valid JSON ({e})") from e
  except OSError as e:
    raise HFLoadError(f"{path}: cannot be read ({e})") from e
  if not isinstance(data, dict):
    raise HFLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
  return data


REQUIRED = object()  # `field`'s default for a field config.json must have
_KINDS = {
  int: "an integer",
  float: "a number",
  bool: "true or false",
  str: "a string",
  dict: "an object",
}


def field(hf: Mapping[str, Any], key: str, kind: type, default: Any = REQUIRED, *, where=""):
  """config.json's `key`, checked to be of `kind` (int, float, bool, str or dict).

  Absent or null gives `default`; without one the field is required. Errors name the field
  (`where` prefixes it, e.g. "rope_scaling.") and the value.
  """
  value = hf.get(key)
  if value is None:
    if default is REQUIRED:
      raise HFLoadError(f"config.json lacks the field '{where}{key}'")
    return default
  ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    ok, value = True, float(value)
  if not ok:
    raise HFLoadError(
      f"config.json field '{where}{key}'={value!r} is not allowed: must be {_KINDS[kind]}"
    )
  return value


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
  """(theta, scaling) from either transformers v5's `rope_parameters` or v4's fields."""
  key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
  params = dict(field(hf, key, dict, {}))
  if key == "rope_scaling":
    params.setdefault("rope_theta", field(hf, "rope_theta", float, 10000.0))
  rope = lambda name, kind, default=REQUIRED: field(params, name, kind, default, where=f"{key}.")
  rope_type = rope("rope_type", str, None) or rope("type", str, "default")
  theta = rope("rope_theta", float, None)
  theta = field(hf, "rope_theta", float, 10000.0) if theta is None else theta
  if rope_type == "default":
    return theta, None
  if rope_type == "linear":
    return theta, _rope_scaling(type="linear", factor=rope("factor", float))
  if rope_type == "llama3":
    return theta, _rope_scaling(
      type="llama3",
      factor=rope("factor", float),
      low_freq_factor=rope("low_freq_factor", float),
      high_freq_factor=rope("high_freq_factor", float),
      original_max_position_embeddings=rope("original_max_position_embeddings", int),
    )
  raise HFLoadError(
    f"rope scaling type {rope_type!r} is not supported; supported: default, linear, llama3"
  )


def _rope_scaling(**kwargs) -> RopeScaling:
  try:
    return RopeScaling(**kwargs)
  except ConfigError as e:
    raise HFLoadError(f"config.json's rope scaling maps to an invalid model config: {e}") from e


def config_from_hf(hf: Mapping[str, Any], *, dtype: str = "float32") -> ModelConfig:
  """Maps a transformers config.json dict onto a ModelConfig, rejecting what we cannot run."""
  model_type = hf.get("model_type")
  if model_type == "deepseek_v3":
    from atlas_jax import hf_deepseek

    return hf_deepseek.config_from_hf(hf, dtype=dtype)
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise HFLoadError(
      f"model_type={model_type!r} (architectures={hf.get('architectures')}) is not supported; "
      f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )
  hidden_act = field(hf, "hidden_act", str, "silu")
  if hidden_act != "silu":
    raise HFLoadError(f"hidden_act={hidden_act!r} is not supported; only 'silu' (SwiGLU)")
  attention_bias = field(hf, "attention_bias", bool, False)
  mlp_bias = field(hf, "mlp_bias", bool, False)
  if model_type in ("llama", "mistral") and (attention_bias or mlp_bias):
    raise HFLoadError(
      f"{model_type} with attention_bias={attention_bias} / mlp_bias={mlp_bias} is not "
      "supported; only bias-free Llama/Mistral projections"
    )
  if model_type == "qwen3" and attention_bias:
    raise HFLoadError("qwen3 with attention_bias=true is not supported")
  sliding_window = None
  if model_type == "mistral":
    sliding_window = field(hf, "sliding_window", int, None)
  elif field(hf, "use_sliding_window", bool, False):
    raise HFLoadError(
      f"{model_type} with use_sliding_window=true is not supported (per-layer windows)"
    )
  theta, scaling = _rope_from_hf(hf)
  n_heads = field(hf, "num_attention_heads", int)
  d_model = field(hf, "hidden_size", int)
  if n_heads <= 0:
    raise HFLoadError(f"config.json field 'num_attention_heads'={n_heads} must be > 0")
  try:
    return ModelConfig(
      vocab_size=field(hf, "vocab_size", int),
      d_model=d_model,
      n_layers=field(hf, "num_hidden_layers", int),
      n_heads=n_heads,
      n_kv_heads=field(hf, "num_key_value_heads", int, n_heads),
      head_dim=field(hf, "head_dim", int, d_model // n_heads),
      ffn_dim=field(hf, "intermediate_size", int),
      max_seq_len=field(hf, "max_position_embeddings", int, 4096),
      rope_theta=theta,
      rope_scaling=scaling,
      norm_eps=field(hf, "rms_norm_eps", float, 1e-6),
      qkv_bias=model_type == "qwen2",
      qk_norm=model_type == "qwen3",
      tie_embeddings=field(hf, "tie_word_embeddings", bool, False),
      sliding_window=sliding_window,
      dtype=dtype,
      param_dtype=dtype,
    )
  except ConfigError as e:
    raise HFLoadError(f"config.json maps to an invalid model config: {e}") from e


def load_config(path: str | Path, *, dtype: str = "float32") -> ModelConfig:
  return config_from_hf(_read_json(Path(path) / "config.json"), dtype=dtype)


def _safetensors_files(folder: Path) -> list[Path]:
  index = folder / "model.safetensors.index.json"
  if index.is_file():
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
      raise HFLoadError(f"{index}: 'weight_map' must map tensor names to file names")
    return sorted({folder / name for name in weight_map.values()})
  files = sorted(folder.glob("*.safetensors"))
  if not files:
    raise HFLoadError(f"{folder}: no *.safetensors files (only safetensors weights are supported)")
  return files


def tensor_names(folder: str | Path) -> set[str]:
  """The names of a folder's tensors, from the safetensors headers (no tensor is read)."""
  from safetensors import safe_open

  names: set[str] = set()
  for file in _safetensors_files(Path(folder)):
    try:
      with safe_open(str(file), framework="numpy") as f:
        names.update(f.keys())
    except Exception as e:  # safetensors raises its own error types, and OSError
      raise HFLoadError(f"{file}: not a readable safetensors file: {type(e).__name__}: {e}") from e
  return names


def folder_config(path: str | Path, *, dtype: str = "float32") -> ModelConfig:
  """The ModelConfig `load` gives a folder, from config.json and the tensor names alone."""
  hf_config = _read_json(Path(path) / "config.json")
  if hf_config.get("model_type") == "deepseek_v3":
    from atlas_jax import hf_deepseek

    hf_deepseek.config_from_hf(hf_config, dtype=dtype)  # reject unsupported configs first
    return hf_deepseek.config_for_tensors(hf_config, tensor_names(path), dtype=dtype)
  return config_from_hf(hf_config, dtype=dtype)


def read_safetensors(folder: str | Path) -> dict[str, jax.Array]:
  """All tensors of a folder (single file or sharded), as jax arrays on the host.

  Raises:
    HFLoadError naming the file when one is missing, truncated or not safetensors.
  """
  from safetensors import safe_open

  tensors = {}
  for file in _safetensors_files(Path(folder)):
    if not file.is_file():
      raise HFLoadError(f"{file} is listed in the index but missing")
    try:
      with safe_open(str(file), framework="flax") as f:
        for name in f.keys():
          tensors[name] = f.get_tensor(name)
    except Exception as e:  # safetensors raises its own error types, and OSError
      raise HFLoadError(
        f"{file}: not a readable safetensors file (truncated or damaged?): {type(e).__name__}: {e}"
      ) from e
  return tensors


def check_tensor_shapes(
  tensors: Mapping[str, Any], expected: Mapping[str, tuple[tuple[int, ...], str]]
) -> None:
  """Checks each stored tensor's shape exactly against `expected` ({name: (shape, legend)})
  before anything is reshaped or transposed: a transposed projection whose transpose would
  still reshape must not load as wrong weights."""
  for name, (shape, legend) in expected.items():
    got = tuple(tensors[name].shape)
    if got != tuple(shape):
      hint = " (stored transposed?)" if got == tuple(shape)[::-1] else ""
      raise HFLoadError(
        f"tensor {name} has shape {got} in the checkpoint, but config.json implies "
        f"{tuple(shape)} = ({legend}){hint}"
      )


def _shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
  """The shape of every tensor in torch's layout, with what each dimension is in config.json."""
  N, K, H, D, F, V = (
    cfg.n_heads,
    cfg.n_kv_heads,
    cfg.head_dim,
    cfg.d_model,
    cfg.ffn_dim,
    cfg.vocab_size,
  )
  q, kv, d, f = (
    "num_attention_heads * head_dim",
    "num_key_value_heads * head_dim",
    "hidden_size",
    "intermediate_size",
  )
  per_layer = {
    "input_layernorm.weight": ((D,), d),
    "self_attn.q_proj.weight": ((N * H, D), f"{q}, {d}"),
    "self_attn.k_proj.weight": ((K * H, D), f"{kv}, {d}"),
    "self_attn.v_proj.weight": ((K * H, D), f"{kv}, {d}"),
    "self_attn.o_proj.weight": ((D, N * H), f"{d}, {q}"),
    "post_attention_layernorm.weight": ((D,), d),
    "mlp.gate_proj.weight": ((F, D), f"{f}, {d}"),
    "mlp.up_proj.weight": ((F, D), f"{f}, {d}"),
    "mlp.down_proj.weight": ((D, F), f"{d}, {f}"),
  }
  if cfg.qkv_bias:
    per_layer["self_attn.q_proj.bias"] = ((N * H,), q)
    per_layer["self_attn.k_proj.bias"] = ((K * H,), kv)
    per_layer["self_attn.v_proj.bias"] = ((K * H,), kv)
  if cfg.qk_norm:
    per_layer["self_attn.q_norm.weight"] = ((H,), "head_dim")
    per_layer["self_attn.k_norm.weight"] = ((H,), "head_dim")
  shapes = {
    "model.embed_tokens.weight": ((V, D), f"vocab_size, {d}"),
    "model.norm.weight": ((D,), d),
  }
  if not cfg.tie_embeddings:
    shapes["lm_head.weight"] = ((V, D), f"vocab_size, {d}")
  for i in range(cfg.n_layers):
    shapes.update({f"model.layers.{i}.{n}": v for n, v in per_layer.items()})
  return shapes


# Per-layer tensors: HF name (after `model.layers.{i}.`) -> (our path, torch -> ours).
def _layer_map(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], Callable]]:
  N, K, H, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model

  def proj(heads):  # torch Linear [heads*H, D] -> [D, heads, H]
    return lambda w: w.reshape(heads, H, D).transpose(2, 0, 1)

  def bias(heads):
    return lambda b: b.reshape(heads, H)

  same = lambda w: w
  m = {
    "input_layernorm.weight": (("attn_norm", "scale"), same),
    "self_attn.q_proj.weight": (("attn", "wq"), proj(N)),
    "self_attn.k_proj.weight": (("attn", "wk"), proj(K)),
    "self_attn.v_proj.weight": (("attn", "wv"), proj(K)),
    "self_attn.o_proj.weight": (("attn", "wo"), lambda w: w.T.reshape(N, H, D)),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), same),
    "mlp.gate_proj.weight": (("mlp", "w_gate"), lambda w: w.T),
    "mlp.up_proj.weight": (("mlp", "w_up"), lambda w: w.T),
    "mlp.down_proj.weight": (("mlp", "w_down"), lambda w: w.T),
  }
  if cfg.qkv_bias:
    m["self_attn.q_proj.bias"] = (("attn", "bq"), bias(N))
    m["self_attn.k_proj.bias"] = (("attn", "bk"), bias(K))
    m["self_attn.v_proj.bias"] = (("attn", "bv"), bias(K))
  if cfg.qk_norm:
    m["self_attn.q_norm.weight"] = (("attn", "q_norm", "scale"), same)
    m["self_attn.k_norm.weight"] = (("attn", "k_norm", "scale"), same)
  return m


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def params_from_hf(tensors: Mapping[str, jax.Array], cfg: ModelConfig) -> dict[str, Any]:
  """Our pure parameter dict from HF tensors; raises HFLoadError listing missing/unused names."""
  dtype = jnp.dtype(cfg.param_dtype)
  layer_map = _layer_map(cfg)
  shapes = _shapes(cfg)
  expected = list(shapes)
  missing = [n for n in expected if n not in tensors]
  if missing:
    shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
    raise HFLoadError(f"missing tensors: {shown}; expected {len(expected)} tensors in all")
  unused = sorted(
    n
    for n in set(tensors) - set(expected)
    if not n.endswith(_IGNORED_SUFFIXES) and not (cfg.tie_embeddings and n == "lm_head.weight")
  )
  if unused:
    raise HFLoadError(
      f"unexpected tensors (a feature this importer does not support?): {', '.join(unused[:8])}"
    )

  check_tensor_shapes(tensors, shapes)

  def cast(x):
    return jnp.asarray(x).astype(dtype)

  params: dict[str, Any] = {}
  params["embed"] = cast(tensors["model.embed_tokens.weight"])
  _set(params, ("final_norm", "scale"), cast(tensors["model.norm.weight"]))
  if not cfg.tie_embeddings:
    params["lm_head"] = cast(tensors["lm_head.weight"]).T
  blocks: dict[str, Any] = {}
  for hf_name, (path, convert) in layer_map.items():
    layers = [convert(cast(tensors[f"model.layers.{i}.{hf_name}"])) for i in range(cfg.n_layers)]
    _set(blocks, path, jnp.stack(layers))
  params["blocks"] = blocks
  check_shapes(params, cfg)
  return params


def _abstract_model(cfg: ModelConfig, implementation: str | None = None) -> Transformer:
  """The model `cfg` calls for, shapes only."""
  return nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0), implementation=implementation))


def check_shapes(params: dict[str, Any], cfg: ModelConfig) -> None:
  """Raises HFLoadError naming the first parameter that is missing or has the wrong shape."""
  want = nnx.to_pure_dict(nnx.state(_abstract_model(cfg)))
  flat_want = dict(jax.tree_util.tree_leaves_with_path(want))
  flat_got = dict(jax.tree_util.tree_leaves_with_path(params))
  for path, leaf in flat_want.items():
    got = flat_got.get(path)
    name = ".".join(str(getattr(k, "key", k)) for k in path)
    if got is None:
      raise HFLoadError(f"no tensor for parameter {name}")
    if tuple(got.shape) != tuple(leaf.shape):
      raise HFLoadError(
        f"parameter {name} has shape {tuple(got.shape)} from the checkpoint but the config "
        f"implies {tuple(leaf.shape)}"
      )


def build_model(
  cfg: ModelConfig, params: dict[str, Any], *, implementation: str | None = None
) -> Transformer:
  """The model holding `params`, never initialising random weights."""
  graphdef, state = nnx.split(_abstract_model(cfg, implementation))
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


def load(
  path: str | Path, *, dtype: str = "float32", implementation: str | None = None
) -> Transformer:
  """Loads a Hugging Face folder (config.json + *.safetensors) into a Transformer.

  Llama, Mistral, Qwen2 and Qwen3 folders, and DeepSeek-V3-style ones (MLA, dense layers, MTP).

  Args:
    path: a local folder saved by transformers' `save_pretrained` (or downloaded from the Hub).
    dtype: parameter and compute dtype, "float32", "bfloat16" or "float16".
    implementation: attention implementation passed to `atlas_jax.kernels.attention`.

  Returns:
    The model; its ModelConfig is `model.cfg`.
  """
  folder = Path(path)
  if not folder.is_dir():
    raise HFLoadError(f"{folder} is not a folder")
  hf_config = _read_json(folder / "config.json")
  if hf_config.get("model_type") == "deepseek_v3":
    from atlas_jax import hf_deepseek

    return hf_deepseek.load(folder, hf_config, dtype=dtype, implementation=implementation)
  cfg = load_config(folder, dtype=dtype)
  params = params_from_hf(read_safetensors(folder), cfg)
  return build_model(cfg, params, implementation=implementation)


def load_tokenizer(path: str | Path):
  """The `tokenizers.Tokenizer` saved beside the weights as tokenizer.json."""
  from tokenizers import Tokenizer

  file = Path(path) / "tokenizer.json"
  if not file.is_file():
    raise HFLoadError(f"{Path(path)}: no tokenizer.json")
  try:
    return Tokenizer.from_file(str(file))
  except Exception as e:  # the tokenizers library raises a bare Exception
    raise HFLoadError(f"{file}: not a readable tokenizer ({e})") from e


# ---------------------------------------------------------------------------------------------
# Export: our model -> a folder transformers can load.


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  model_type = (
    "qwen3"
    if cfg.qk_norm
    else "qwen2"
    if cfg.qkv_bias
    else ("mistral" if cfg.sliding_window else "llama")
  )
  arch = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
  }[model_type]
  rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
  if cfg.rope_scaling is not None:
    s = cfg.rope_scaling
    rope.update(rope_type=s.type, factor=s.factor)
    if s.type == "llama3":
      rope.update(
        low_freq_factor=s.low_freq_factor,
        high_freq_factor=s.high_freq_factor,
        original_max_position_embeddings=s.original_max_position_embeddings,
      )
  return {
    "architectures": [arch],
    "model_type": model_type,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model,
    "intermediate_size": cfg.ffn_dim,
    "num_hidden_layers": cfg.n_layers,
    "num_attention_heads": cfg.n_heads,
    "num_key_value_heads": cfg.n_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": cfg.max_seq_len,
    "rms_norm_eps": cfg.norm_eps,
    "rope_theta": cfg.rope_theta,
    "rope_scaling": None
    if cfg.rope_scaling is None
    else {k: v for k, v in rope.items() if k != "rope_theta"},
    "rope_parameters": rope,
    "tie_word_embeddings": cfg.tie_embeddings,
    "attention_bias": cfg.qkv_bias,
    "sliding_window": cfg.sliding_window,
    "use_sliding_window": False,
    "torch_dtype": "float32",  # save() writes float32 tensors
  }


def save(model: Transformer, path: str | Path) -> None:
  """Writes config.json and model.safetensors in Hugging Face's layout (round-trips with load)."""
  from safetensors.numpy import save_file

  cfg = model.cfg
  if cfg.mla is not None or cfg.mtp is not None:
    raise HFLoadError(
      "save writes the Llama family (llama, mistral, qwen2, qwen3); this model has "
      + ("MLA attention" if cfg.mla is not None else "MTP heads")
      + ", which no exporter here writes"
    )
  folder = Path(path)
  folder.mkdir(parents=True, exist_ok=True)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  N, K, H, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
  to_np = lambda x: np.asarray(jnp.asarray(x, jnp.float32))  # numpy has no bfloat16
  out = {
    "model.embed_tokens.weight": to_np(params["embed"]),
    "model.norm.weight": to_np(params["final_norm"]["scale"]),
  }
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = to_np(params["lm_head"]).T
  inverse = {
    "wq": lambda w: w.transpose(1, 2, 0).reshape(N * H, D),
    "wk": lambda w: w.transpose(1, 2, 0).reshape(K * H, D),
    "wv": lambda w: w.transpose(1, 2, 0).reshape(K * H, D),
    "wo": lambda w: w.reshape(N * H, D).T,
    "bq": lambda b: b.reshape(-1),
    "bk": lambda b: b.reshape(-1),
    "bv": lambda b: b.reshape(-1),
    "w_gate": lambda w: w.T,
    "w_up": lambda w: w.T,
    "w_down": lambda w: w.T,
    "scale": lambda w: w,
  }
  for hf_name, (ours, _) in _layer_map(cfg).items():
    stacked = params["blocks"]
    for key in ours:
      stacked = stacked[key]
    stacked = to_np(stacked)
    for i in range(cfg.n_layers):
      out[f"model.layers.{i}.{hf_name}"] = np.ascontiguousarray(inverse[ours[-1]](stacked[i]))
  save_file(
    {k: np.ascontiguousarray(v) for k, v in out.items()},
    str(folder / "model.safetensors"),
    metadata={"format": "pt"},
  )
  (folder / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2))
