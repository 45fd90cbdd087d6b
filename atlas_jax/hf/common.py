"""What every family's import shares: the error type, config.json fields checked one by one, RoPE
parameters (transformers v4's `rope_scaling` or v5's `rope_parameters`), and the step from a dict
of fields to a validated `ModelConfig`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from atlas_jax.config import ConfigError, ModelConfig, MoEConfig, RopeScaling


class HFLoadError(ValueError):
  """A Hugging Face folder that cannot be imported (unsupported, incomplete or inconsistent), or
  a model that cannot be exported to a family's format."""


def read_json(path: Path) -> dict[str, Any]:
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
  list: "a list",
}


def field(hf: Mapping[str, Any], key: str, kind: type, default: Any = REQUIRED, *, where=""):
  """config.json's `key`, checked to be of `kind` (int, float, bool, str, dict or list).

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


def require(hf: Mapping[str, Any], key: str, value: Any, allowed: Any, why: str) -> None:
  """Raises HFLoadError unless config.json's `key` (read as `value`) equals `allowed`."""
  if value != allowed:
    raise HFLoadError(
      f"{hf.get('model_type')} with {key}={value!r} is not supported: only {allowed!r} ({why})"
    )


def check_silu(hf: Mapping[str, Any]) -> None:
  hidden_act = field(hf, "hidden_act", str, "silu")
  if hidden_act != "silu":
    raise HFLoadError(f"hidden_act={hidden_act!r} is not supported; only 'silu' (SwiGLU)")


GQA_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_ORIGINAL_FIRST = ("llama3", "yarn", "longrope")  # the types that read the original context


def rope_from_hf(
  hf: Mapping[str, Any], *, allowed: tuple[str, ...] = GQA_ROPE_TYPES
) -> tuple[float, RopeScaling | None]:
  """(theta, scaling) from either transformers v5's `rope_parameters` or v4's `rope_scaling`
  (`rope_type` or `type`); `allowed` names the scaling types the family's attention implements.

  As transformers reads them: `original_max_position_embeddings` at the top level of config.json
  wins over the rope dict's (Phi-3 keeps it there), which defaults to max_position_embeddings; a
  missing yarn or longrope `factor` is max_position_embeddings / original.
  """
  key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
  params = dict(field(hf, key, dict, {}))
  rope = lambda name, kind, default=REQUIRED: field(params, name, kind, default, where=f"{key}.")
  rope_type = rope("rope_type", str, None) or rope("type", str, "default")
  theta = rope("rope_theta", float, None)
  theta = field(hf, "rope_theta", float, 10000.0) if theta is None else theta
  if rope_type not in allowed:
    raise HFLoadError(
      f"config.json field '{key}.rope_type'={rope_type!r} is not supported for "
      f"{hf.get('model_type')}; supported: {', '.join(allowed)}"
    )
  if rope_type == "default":
    return theta, None
  old_len = None
  if rope_type in _ORIGINAL_FIRST:
    old_len = field(hf, "original_max_position_embeddings", int, None)
    if old_len is None:
      old_len = rope("original_max_position_embeddings", int, None)
    if old_len is None:
      old_len = field(hf, "max_position_embeddings", int)
    if old_len <= 0:
      raise HFLoadError(
        f"config.json field '{key}.original_max_position_embeddings'={old_len} must be > 0"
      )

  def factor_or_ratio() -> float:  # DeepSeek's and Phi-3's convention: the extension ratio
    factor = rope("factor", float, None)
    return field(hf, "max_position_embeddings", int) / old_len if factor is None else factor

  try:
    if rope_type == "linear":
      return theta, RopeScaling(type="linear", factor=rope("factor", float))
    if rope_type == "llama3":
      return theta, RopeScaling(
        type="llama3",
        factor=rope("factor", float),
        low_freq_factor=rope("low_freq_factor", float),
        high_freq_factor=rope("high_freq_factor", float),
        original_max_position_embeddings=old_len,
      )
    if rope_type == "longrope":
      factors = {}
      for name in ("short_factor", "long_factor"):
        values = rope(name, list)
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
          raise HFLoadError(
            f"config.json field '{key}.{name}'={values!r} is not allowed: must be a list of numbers"
          )
        factors[name] = tuple(float(v) for v in values)
      return theta, RopeScaling(
        type="longrope",
        factor=float(factor_or_ratio()),
        original_max_position_embeddings=old_len,
        attention_factor=rope("attention_factor", float, None),
        **factors,
      )
    return theta, RopeScaling(
      type="yarn",
      factor=float(factor_or_ratio()),
      original_max_position_embeddings=old_len,
      beta_fast=rope("beta_fast", float, None) or 32.0,
      beta_slow=rope("beta_slow", float, None) or 1.0,
      mscale=rope("mscale", float, None) or 0.0,
      mscale_all_dim=rope("mscale_all_dim", float, None) or 0.0,
      attention_factor=rope("attention_factor", float, None),
      truncate=rope("truncate", bool, True),
    )
  except ConfigError as e:
    raise HFLoadError(f"config.json's rope scaling maps to an invalid model config: {e}") from e


def partial_rotary_from_hf(hf: Mapping[str, Any]) -> float:
  """The fraction of each head RoPE rotates: the rope dict's `partial_rotary_factor`, else
  config.json's, else 1."""
  key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
  params = field(hf, key, dict, {})
  factor = field(params, "partial_rotary_factor", float, None, where=f"{key}.")
  return field(hf, "partial_rotary_factor", float, 1.0) if factor is None else factor


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """transformers v5's `rope_parameters` for our rope settings."""
  rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
  if cfg.partial_rotary_factor != 1:
    rope["partial_rotary_factor"] = cfg.partial_rotary_factor
  s = cfg.rope_scaling
  if s is None:
    return rope
  rope.update(rope_type=s.type, factor=s.factor)
  if s.type in _ORIGINAL_FIRST:
    rope["original_max_position_embeddings"] = s.original_max_position_embeddings
  if s.type == "llama3":
    rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
  if s.type == "yarn":
    rope.update(
      beta_fast=s.beta_fast,
      beta_slow=s.beta_slow,
      mscale=s.mscale,
      mscale_all_dim=s.mscale_all_dim,
      truncate=s.truncate,
    )
  if s.type == "longrope":
    rope.update(short_factor=list(s.short_factor), long_factor=list(s.long_factor))
  if s.type in ("yarn", "longrope") and s.attention_factor is not None:
    rope["attention_factor"] = s.attention_factor
  return rope


def base_fields(
  hf: Mapping[str, Any],
  *,
  allowed_rope: tuple[str, ...] | None = None,
  partial_rotary: bool = False,
) -> dict:
  """The ModelConfig fields every family reads the same way (`partial_rotary`: the family's
  transformers model rotates part of each head when config.json asks; elsewhere that is refused)."""
  check_silu(hf)
  theta, scaling = (
    rope_from_hf(hf) if allowed_rope is None else rope_from_hf(hf, allowed=allowed_rope)
  )
  partial = partial_rotary_from_hf(hf)
  if partial != 1 and not partial_rotary:
    raise HFLoadError(
      f"{hf.get('model_type')} with partial_rotary_factor={partial} is not supported: its "
      "transformers model rotates every dim of a head (only 1.0)"
    )
  n_heads = field(hf, "num_attention_heads", int)
  if n_heads <= 0:
    raise HFLoadError(f"config.json field 'num_attention_heads'={n_heads} must be > 0")
  return dict(
    vocab_size=field(hf, "vocab_size", int),
    d_model=field(hf, "hidden_size", int),
    n_layers=field(hf, "num_hidden_layers", int),
    n_heads=n_heads,
    n_kv_heads=field(hf, "num_key_value_heads", int, n_heads),
    max_seq_len=field(hf, "max_position_embeddings", int, 4096),
    rope_theta=theta,
    rope_scaling=scaling,
    partial_rotary_factor=partial,
    norm_eps=field(hf, "rms_norm_eps", float, 1e-6),
    tie_embeddings=field(hf, "tie_word_embeddings", bool, False),
  )


def base_to_hf(cfg: ModelConfig, model_type: str, architecture: str) -> dict[str, Any]:
  """The config.json fields every family writes the same way."""
  rope = rope_to_hf(cfg)
  return {
    "architectures": [architecture],
    "model_type": model_type,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model,
    "intermediate_size": cfg.ffn_dim,
    "num_hidden_layers": cfg.n_layers,
    "num_attention_heads": cfg.n_heads,
    "num_key_value_heads": cfg.n_kv_heads,
    "hidden_act": "silu",
    "max_position_embeddings": cfg.max_seq_len,
    "rms_norm_eps": cfg.norm_eps,
    "rope_theta": cfg.rope_theta,
    "rope_scaling": None
    if cfg.rope_scaling is None
    else {k: v for k, v in rope.items() if k != "rope_theta"},
    "rope_parameters": rope,
    "tie_word_embeddings": cfg.tie_embeddings,
    "torch_dtype": "float32",  # save() writes float32 tensors
  }


def expert_count(hf: Mapping[str, Any], *keys: str) -> int:
  """The routed experts, under the first of `keys` config.json has (transformers writes
  `num_local_experts` or `num_experts` depending on the family and version)."""
  key = next((k for k in keys if hf.get(k) is not None), keys[0])
  return field(hf, key, int)


def moe_config(**fields) -> MoEConfig:
  try:
    return MoEConfig(**fields)
  except ConfigError as e:
    raise HFLoadError(f"config.json maps to an invalid mixture-of-experts config: {e}") from e


def plain_top_k(m: MoEConfig) -> bool:
  """A softmax router taking the top k of every expert, no shared expert (Mixtral, Qwen3-MoE,
  OLMoE)."""
  return m.scoring == "softmax" and m.topk_method == "greedy" and not m.shared_ffn_dim


def model_config(**fields) -> ModelConfig:
  try:
    return ModelConfig(**fields)
  except ConfigError as e:
    raise HFLoadError(f"config.json maps to an invalid model config: {e}") from e


def export_error(family: str, name: str, value: Any, allowed: str) -> HFLoadError:
  return HFLoadError(f"cannot export to {family}: {name}={value!r} is not allowed: {allowed}")


def llama_scoring(cfg: ModelConfig) -> bool:
  """What a Llama computes beside its block layout and windows: a SwiGLU feed-forward,
  embeddings as stored, the softmax scale H ** -0.5, nothing soft-capped, one RoPE base."""
  return (
    cfg.mlp_activation == "silu"
    and not cfg.scale_embeddings
    and cfg.rope_local_theta is None
    and cfg.attn_logit_softcapping is None
    and cfg.final_logit_softcapping is None
    and cfg.query_pre_attn_scalar is None
  )
