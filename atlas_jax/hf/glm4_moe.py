"""GLM-4.5 and GLM-4.6 (model_type "glm4_moe"): grouped-query attention with q/k/v biases
(`attention_bias`), optional per-head QK-norm (`use_qk_norm`) and partial RoPE; dense SwiGLU
first layers (`first_k_dense_replace`), then mixture-of-experts layers routed as DeepSeek-V3's
(sigmoid scores, the selection bias `e_score_correction_bias`, `noaux_tc` over n_group /
topk_group, weights renormalised when `norm_topk_prob`, times `routed_scaling_factor`) beside one
ungated shared expert of n_shared_experts x moe_intermediate_size.

* RoPE. transformers' Glm4Moe rotates the first int(head_dim * partial_rotary_factor) dims of
  each head in the rotate-half layout (halves, not interleaved pairs), as our attention does, so
  q and k load unpermuted. Glm4MoeConfig defaults the factor to 0.5 when config.json names none
  (the rope dict's value wins over the top-level one), and so do we; export writes it always.
* MTP. The released checkpoints store `num_nextn_predict_layers` multi-token-prediction modules
  as layers num_hidden_layers .. in DeepSeek-V3's layout (enorm, hnorm, eh_proj, an MoE decoder
  layer, shared_head.norm, and copies of the embedding and head). Glm4MoeForCausalLM ignores
  them; we load them, when stored, into the sequential MTP heads (`model.mtp`, self-speculation),
  as `deepseek` does, and write them back at export.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from atlas_jax.config import ModelConfig, MTPConfig
from atlas_jax.hf.common import (
  HFLoadError,
  base_fields,
  base_to_hf,
  export_error,
  field,
  model_config,
  moe_config,
)
from atlas_jax.hf.deepseek import layers_spec, moe_to_hf, mtp_to_hf, stored_mtp_layers
from atlas_jax.hf.llama import attention
from atlas_jax.hf.weights import Spec

MODEL_TYPES = ("glm4_moe",)
# Glm4MoeConfig's partial_rotary_factor when config.json gives none.
DEFAULT_PARTIAL_ROTARY = 0.5


def _hf_view(hf: Mapping[str, Any]) -> dict[str, Any]:
  """config.json with Glm4MoeConfig's default partial rotary factor filled in."""
  out = dict(hf)
  key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
  rope = hf.get(key)
  in_rope = isinstance(rope, dict) and rope.get("partial_rotary_factor") is not None
  if not in_rope and hf.get("partial_rotary_factor") is None:
    out["partial_rotary_factor"] = DEFAULT_PARTIAL_ROTARY
  return out


def config_from_hf(
  hf: Mapping[str, Any], *, dtype: str = "float32", names: set[str] | None = None
) -> ModelConfig:
  """A ModelConfig with `moe` where any layer is MoE, and `mtp` when `names` (the stored tensors)
  hold MTP modules."""
  fields = base_fields(_hf_view(hf), partial_rotary=True)
  fields["head_dim"] = field(hf, "head_dim", int, fields["d_model"] // fields["n_heads"])
  L = fields["n_layers"]
  mtp = 0 if names is None else stored_mtp_layers(hf, names)
  n_experts = field(hf, "n_routed_experts", int)
  dense = field(hf, "first_k_dense_replace", int, 1)
  if dense < 0:
    raise HFLoadError(f"config.json field 'first_k_dense_replace'={dense} must be >= 0")
  moe = None
  if dense < L + mtp:
    F = field(hf, "moe_intermediate_size", int)
    shared = field(hf, "n_shared_experts", int, 1)
    if shared < 0:
      raise HFLoadError(f"config.json field 'n_shared_experts'={shared} must be >= 0")
    moe = moe_config(
      n_experts=n_experts,
      top_k=field(hf, "num_experts_per_tok", int),
      expert_ffn_dim=F,
      scoring="sigmoid",
      topk_method="noaux_tc",
      n_group=field(hf, "n_group", int, 1),
      topk_group=field(hf, "topk_group", int, 1),
      norm_topk_prob=field(hf, "norm_topk_prob", bool, True),
      routed_scaling_factor=field(hf, "routed_scaling_factor", float, 1.0),
      shared_ffn_dim=shared * F,
      first_k_dense=dense,
    )
  return model_config(
    **fields,
    ffn_dim=field(hf, "intermediate_size", int),
    qkv_bias=field(hf, "attention_bias", bool, False),
    qk_norm=field(hf, "use_qk_norm", bool, False),
    dtype=dtype,
    param_dtype=dtype,
    mtp=MTPConfig(kind="sequential", n_predict=mtp) if mtp else None,
    moe=moe,
  )


def spec(cfg: ModelConfig, hf: Mapping[str, Any] | None = None, names=None) -> Spec:
  """Each layer: attention with q/k/v biases and QK-norm as config.json asks, then DeepSeek-V3's
  dense SwiGLU or MoE (the router, its selection bias, the routed experts per expert or fused as
  `names` shows, the shared expert); the MTP modules as DeepSeek-V3's."""
  return layers_spec(cfg, lambda: attention(cfg), names)


def model_type(cfg: ModelConfig) -> str | None:
  """ "glm4_moe" for a GQA model with DeepSeek-V3's router (sigmoid, noaux_tc) that reads back
  unchanged; None otherwise."""
  m = cfg.moe
  if cfg.mla is not None or m is None or cfg.sliding_window is not None:
    return None
  if m.scoring != "sigmoid" or m.topk_method != "noaux_tc":
    return None
  try:
    back = config_from_hf(_to_hf(cfg), dtype=cfg.dtype)
  except HFLoadError:
    return None
  # config.json alone never holds MTP heads (the stored tensors decide them), nor the training
  # run's expert capacity.
  moe = dataclasses.replace(back.moe, capacity_factor=m.capacity_factor) if back.moe else None
  back = dataclasses.replace(
    back, param_dtype=cfg.param_dtype, init_std=cfg.init_std, mtp=cfg.mtp, moe=moe
  )
  return "glm4_moe" if back == cfg else None


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
  m = cfg.moe
  if cfg.qk_norm and cfg.qk_norm_scope != "head":
    raise export_error("glm4_moe", "qk_norm_scope", cfg.qk_norm_scope, "'head'")
  out = base_to_hf(cfg, "glm4_moe", "Glm4MoeForCausalLM")
  # Written in both places: a config without it reads as Glm4MoeConfig's 0.5.
  out["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
  out["partial_rotary_factor"] = cfg.partial_rotary_factor
  out.update(
    head_dim=cfg.head_dim,
    attention_bias=cfg.qkv_bias,
    use_qk_norm=cfg.qk_norm,
    **moe_to_hf("glm4_moe", m),
    num_nextn_predict_layers=mtp_to_hf("glm4_moe", cfg),
  )
  return out


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  if model_type(cfg) is None:
    raise HFLoadError(f"a glm4_moe export cannot hold this config: {cfg}")
  return _to_hf(cfg)
