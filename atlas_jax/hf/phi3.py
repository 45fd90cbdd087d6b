"""Phi-3 and Phi-4 (model_type "phi3"; Phi-4-mini too): a Llama-shaped decoder whose checkpoint
fuses q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj` (split at load, fused again at
export), with LongRoPE scaling, a partial rotary factor (Phi-4-mini rotates 3/4 of each head) and,
on some Phi-3 checkpoints, one sliding window on every layer (as Mistral)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from atlas_jax.config import ModelConfig
from atlas_jax.hf.common import (
  HFLoadError,
  base_fields,
  base_to_hf,
  export_error,
  field,
  model_config,
)
from atlas_jax.hf.weights import (
  Spec,
  Weights,
  linear,
  model_group,
  norm,
  out_proj,
  trunk_groups,
)

MODEL_TYPES = ("phi3",)
# Phi3Config's own default when config.json leaves `original_max_position_embeddings` out; it
# takes priority over the rope dict's value in transformers.
DEFAULT_ORIGINAL_CONTEXT = 4096


def _hf_view(hf: Mapping[str, Any]) -> dict[str, Any]:
  """config.json as transformers' Phi3Config reads it: the early LongRoPE names "su" and "yarn"
  mean longrope, and the top-level original context and the norms' eps have defaults of their
  own."""
  out = dict(hf)
  for key, default in (
    ("original_max_position_embeddings", DEFAULT_ORIGINAL_CONTEXT),
    ("rms_norm_eps", 1e-5),  # Phi3Config's defaults
  ):
    if out.get(key) is None:
      out[key] = default
  key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
  rope = hf.get(key)
  if isinstance(rope, dict):
    kind = rope.get("rope_type") or rope.get("type")
    if kind in ("su", "yarn"):
      out[key] = {**rope, "rope_type": "longrope"}
  return out


def config_from_hf(hf: Mapping[str, Any], *, dtype: str = "float32", names=None) -> ModelConfig:
  # transformers' Phi3Config allows no other rope types.
  fields = base_fields(_hf_view(hf), allowed_rope=("default", "longrope"), partial_rotary=True)
  fields["head_dim"] = field(hf, "head_dim", int, fields["d_model"] // fields["n_heads"])
  window = field(hf, "sliding_window", int, None)
  if window is not None and window >= fields["max_seq_len"]:
    # Phi-4-mini's 262,144 never binds inside its 131,072 positions: dropping it keeps the
    # unwindowed attention paths and changes no score.
    window = None
  return model_config(
    **fields,
    ffn_dim=field(hf, "intermediate_size", int),
    sliding_window=window,
    dtype=dtype,
    param_dtype=dtype,
  )


def _layer(cfg: ModelConfig) -> tuple[Weights, ...]:
  N, K, H, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model, cfg.ffn_dim
  d = "hidden_size"
  q, kv = N * H, K * H
  # qkv_proj [(N + 2K) * H, D]: the query heads, then the key heads, then the value heads.
  qkv = Weights(
    ("self_attn.qkv_proj.weight",),
    ((N + 2 * K) * H, D),
    f"(num_attention_heads + 2 * num_key_value_heads) * head_dim, {d}",
    lambda w: {
      ("attn", "wq"): w[:q].reshape(N, H, D).transpose(2, 0, 1),
      ("attn", "wk"): w[q : q + kv].reshape(K, H, D).transpose(2, 0, 1),
      ("attn", "wv"): w[q + kv :].reshape(K, H, D).transpose(2, 0, 1),
    },
    lambda p: (
      np.concatenate(
        [
          p["attn", "wq"].transpose(1, 2, 0).reshape(q, D),
          p["attn", "wk"].transpose(1, 2, 0).reshape(kv, D),
          p["attn", "wv"].transpose(1, 2, 0).reshape(kv, D),
        ]
      ),
    ),
  )
  # gate_up_proj [2F, D]: the gate's rows, then the up projection's (transformers' `chunk(2)`).
  gate_up = Weights(
    ("mlp.gate_up_proj.weight",),
    (2 * F, D),
    f"2 * intermediate_size, {d}",
    lambda w: {("mlp", "w_gate"): w[:F].T, ("mlp", "w_up"): w[F:].T},
    lambda p: (np.concatenate([p["mlp", "w_gate"].T, p["mlp", "w_up"].T]),),
  )
  return (
    norm("input_layernorm.weight", D, d, ("attn_norm", "scale")),
    qkv,
    out_proj("self_attn.o_proj.weight", N, H, D, "num_attention_heads * head_dim"),
    norm("post_attention_layernorm.weight", D, d, ("mlp_norm", "scale")),
    gate_up,
    linear("mlp.down_proj.weight", D, F, f"{d}, intermediate_size", ("mlp", "w_down")),
  )


def spec(cfg: ModelConfig, hf: Mapping[str, Any] | None = None, names=None) -> Spec:
  return Spec((model_group(cfg), *trunk_groups(cfg, lambda i, prefix: _layer(cfg))))


def model_type(cfg: ModelConfig) -> str | None:
  """ "phi3" for a config only Phi-3 holds among the GQA families (a partial rotary factor, or
  LongRoPE) that reads back unchanged; a plain one exports as Llama or Mistral."""
  longrope = cfg.rope_scaling is not None and cfg.rope_scaling.type == "longrope"
  if cfg.partial_rotary_factor == 1 and not longrope:
    return None
  try:
    back = config_from_hf(_to_hf(cfg), dtype=cfg.dtype)
  except HFLoadError:
    return None
  same = dataclasses.replace(back, param_dtype=cfg.param_dtype, init_std=cfg.init_std) == cfg
  return "phi3" if same else None


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
  if cfg.mla is not None or cfg.moe is not None or cfg.qk_norm or cfg.qkv_bias:
    raise export_error("phi3", "attention", "MLA, MoE, qk_norm or qkv_bias", "plain GQA only")
  if cfg.n_heads * cfg.head_dim != cfg.d_model:
    # transformers' Phi3Config checks the LongRoPE factors against hidden_size / heads.
    raise export_error(
      "phi3", "head_dim", cfg.head_dim, f"n_heads x head_dim must be d_model={cfg.d_model}"
    )
  out = base_to_hf(cfg, "phi3", "Phi3ForCausalLM")
  out.update(sliding_window=cfg.sliding_window, partial_rotary_factor=cfg.partial_rotary_factor)
  for key, default in (("bos_token_id", 1), ("eos_token_id", 32000), ("pad_token_id", 32000)):
    if default >= cfg.vocab_size:  # Phi3Config's default would index past the embedding
      out[key] = None
  s = cfg.rope_scaling
  if s is not None and s.type != "longrope":
    raise export_error("phi3", "rope_scaling.type", s.type, "'longrope' or no scaling")
  # Phi3Config gives this top-level field priority over the rope dict's (and defaults it to 4096).
  out["original_max_position_embeddings"] = (
    cfg.max_seq_len if s is None else s.original_max_position_embeddings
  )
  return out


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  return _to_hf(cfg)
