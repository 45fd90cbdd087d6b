"""Configuration: frozen dataclasses validated on construction, loaded from YAML with overrides.

    cfg = load_config("configs/tiny.yaml", ["model.n_layers=4", "train.steps=100"])

Every invalid field raises `ConfigError` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
  """A configuration field holds a value that is not allowed."""


def _fail(field: str, value: Any, allowed: str) -> typing.NoReturn:
  raise ConfigError(f"{field}={value!r} is not allowed: {allowed}")


def _positive(section: str, obj: Any, *names: str) -> None:
  for name in names:
    value = getattr(obj, name)
    if value <= 0:
      _fail(f"{section}.{name}", value, "must be > 0")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Rotary frequency scaling. `llama3`: Llama-3.1's wavelength-dependent interpolation."""

  type: Literal["llama3", "linear"] = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    _positive("model.rope_scaling", self, "factor", "original_max_position_embeddings")
    if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
      _fail(
        "model.rope_scaling.high_freq_factor",
        self.high_freq_factor,
        f"must exceed low_freq_factor={self.low_freq_factor} > 0",
      )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer of the Llama family (Llama, Mistral, Qwen2, Qwen3)."""

  vocab_size: int = 259
  d_model: int = 256  # D
  n_layers: int = 4  # L
  n_heads: int = 8  # N
  n_kv_heads: int = 4  # K
  head_dim: int | None = None  # H; default d_model // n_heads
  ffn_dim: int = 768  # F
  max_seq_len: int = 512
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  norm_eps: float = 1e-5
  qkv_bias: bool = False  # Qwen2
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
  tie_embeddings: bool = False
  sliding_window: int | None = None  # Mistral
  init_std: float = 0.02
  dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # activations / compute
  param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"

  def __post_init__(self):
    _positive(
      "model",
      self,
      "vocab_size",
      "d_model",
      "n_layers",
      "n_heads",
      "n_kv_heads",
      "ffn_dim",
      "max_seq_len",
      "rope_theta",
      "norm_eps",
      "init_std",
    )
    if self.n_heads % self.n_kv_heads:
      _fail(
        "model.n_heads",
        self.n_heads,
        f"must be a multiple of model.n_kv_heads={self.n_kv_heads} (MHA: equal, GQA: a multiple, "
        "MQA: n_kv_heads=1)",
      )
    if self.head_dim is None:
      if self.d_model % self.n_heads:
        _fail(
          "model.d_model",
          self.d_model,
          f"must be divisible by model.n_heads={self.n_heads} when model.head_dim is not set",
        )
      object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
    if self.head_dim <= 0:
      _fail("model.head_dim", self.head_dim, "must be > 0")
    if self.head_dim % 2:
      _fail("model.head_dim", self.head_dim, "must be even: RoPE rotates pairs of dimensions")
    if self.sliding_window is not None and self.sliding_window <= 0:
      _fail("model.sliding_window", self.sliding_window, "must be a positive int or null")

  @property
  def group_size(self) -> int:  # G
    return self.n_heads // self.n_kv_heads


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """How attention is computed (not what it computes)."""

  implementation: Literal["xla", "pallas", "cudnn"] | None = None


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh axes; -1 takes the devices the other axes leave."""

  data: int = -1
  fsdp: int = 1
  tensor: int = 1

  def __post_init__(self):
    sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
    for name, size in sizes.items():
      if size == 0 or size < -1:
        _fail(f"mesh.{name}", size, "must be a positive device count or -1 (the rest)")
    if list(sizes.values()).count(-1) > 1:
      _fail("mesh", sizes, "at most one axis may be -1")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Training text and how it is tokenised."""

  source: str = "stdlib"  # "stdlib", a folder of text files, or a .jsonl file with a "text" field
  tokenizer: str = "byte"  # "byte" or a path to a tokenizer.json
  eval_fraction: float = 0.02  # share of documents held out for eval

  def __post_init__(self):
    if not 0.0 <= self.eval_fraction < 1.0:
      _fail("data.eval_fraction", self.eval_fraction, "must be in [0, 1)")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 200
  batch_size: int = 8
  seq_len: int = 128
  learning_rate: float = 3e-3
  warmup_steps: int = 20
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  seed: int = 0
  log_every: int = 20
  eval_every: int = 100
  eval_batches: int = 4
  checkpoint_dir: str = "checkpoints/tiny"
  checkpoint_every: int = 0  # 0: only at the end

  def __post_init__(self):
    _positive("train", self, "steps", "batch_size", "seq_len", "learning_rate", "log_every")
    for name in (
      "warmup_steps",
      "weight_decay",
      "grad_clip",
      "eval_every",
      "checkpoint_every",
      "eval_batches",
    ):
      if getattr(self, name) < 0:
        _fail(f"train.{name}", getattr(self, name), "must be >= 0")
    for name in ("b1", "b2", "min_lr_ratio"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        _fail(f"train.{name}", getattr(self, name), "must be in [0, 1]")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  max_new_tokens: int = 64
  temperature: float = 0.0  # 0: greedy
  top_k: int = 0  # 0: off
  top_p: float = 1.0
  max_batch: int = 8
  seed: int = 0

  def __post_init__(self):
    _positive("serve", self, "max_new_tokens", "max_batch")
    if self.temperature < 0:
      _fail("serve.temperature", self.temperature, "must be >= 0 (0 is greedy)")
    if self.top_k < 0:
      _fail("serve.top_k", self.top_k, "must be >= 0 (0 disables top-k)")
    if not 0.0 < self.top_p <= 1.0:
      _fail("serve.top_p", self.top_p, "must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  serve: ServeConfig = dataclasses.field(default_factory=ServeConfig)

  def __post_init__(self):
    if self.train.seq_len > self.model.max_seq_len:
      _fail(
        "train.seq_len",
        self.train.seq_len,
        f"must be <= model.max_seq_len={self.model.max_seq_len}",
      )

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Building dataclasses from plain dicts, with a type check per field.


def _describe(tp: Any) -> str:
  origin = typing.get_origin(tp)
  if origin is Literal:
    return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
  if origin in (typing.Union, types.UnionType):
    return " or ".join(_describe(a) for a in typing.get_args(tp))
  if tp is type(None):
    return "null"
  if dataclasses.is_dataclass(tp):
    return f"a mapping of {tp.__name__} fields"
  return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, field: str) -> Any:
  """Returns `value` as type `tp`, or raises ConfigError naming `field`."""
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    args = typing.get_args(tp)
    if value is None and type(None) in args:
      return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:  # Optional[X]: X's own, more precise error
      return _coerce(options[0], value, field)
    for arg in options:
      try:
        return _coerce(arg, value, field)
      except ConfigError:
        pass
    _fail(field, value, f"expected {_describe(tp)}")
  if origin is Literal:
    if value not in typing.get_args(tp):
      _fail(field, value, f"expected {_describe(tp)}")
    return value
  if dataclasses.is_dataclass(tp):
    if isinstance(value, tp):
      return value
    if not isinstance(value, Mapping):
      _fail(field, value, f"expected {_describe(tp)}")
    return build(tp, value, prefix=field)
  if tp is bool:
    if not isinstance(value, bool):
      _fail(field, value, "expected true or false")
    return value
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      _fail(field, value, "expected an integer")
    return value
  if tp is float:
    if isinstance(value, str):
      # YAML 1.1 reads "1e-3" (no dot) as a string; accept any string Python parses as a float.
      try:
        return float(value)
      except ValueError:
        pass
    if isinstance(value, bool) or not isinstance(value, int | float):
      _fail(field, value, "expected a number")
    return float(value)
  if tp is str:
    if not isinstance(value, str):
      _fail(field, value, "expected a string")
    return value
  raise TypeError(f"unsupported config field type {tp!r} for {field}")


def build(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
  """Builds dataclass `cls` from a mapping, rejecting unknown keys and ill-typed values."""
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  for key in data:
    if key not in names:
      where = f"{prefix}.{key}" if prefix else str(key)
      raise ConfigError(f"{where} is not a known field; allowed: {', '.join(names)}")
  kwargs = {}
  for key, value in data.items():
    where = f"{prefix}.{key}" if prefix else key
    kwargs[key] = _coerce(hints[key], value, where)
  return cls(**kwargs)


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
  """Applies `a.b=value` overrides (values parsed as YAML) to a nested dict, in place."""
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override {item!r} must look like section.field=value")
    path, raw = item.split("=", 1)
    keys = path.strip().split(".")
    if not all(keys):
      raise ConfigError(f"override {item!r} has an empty field name")
    node = data
    for key in keys[:-1]:
      child = node.get(key)
      if child is None:
        child = node[key] = {}
      if not isinstance(child, dict):
        raise ConfigError(f"override {item!r}: {key} is not a section")
      node = child
    node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else None
  return data


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
  """Loads a YAML preset (or the defaults when `path` is None) and applies overrides."""
  data: dict[str, Any] = {}
  if path is not None:
    path = Path(path)
    if not path.is_file():
      raise ConfigError(f"config file {str(path)!r} does not exist")
    loaded = yaml.safe_load(path.read_text()) or {}
    if not isinstance(loaded, dict):
      raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    data = loaded
  apply_overrides(data, overrides)
  return build(Config, data)


def dump_config(cfg: Config) -> str:
  return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
