"""OLMoE: every layer a softmax top-k mixture of experts (renormalised when `norm_topk_prob`),
and q/k normalised by one RMSNorm over all heads of the projection."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from atlas_jax.config import ModelConfig
from atlas_jax.hf.common import (
  HFLoadError,
  base_to_hf,
  expert_count,
  export_error,
  field,
  model_config,
  moe_config,
  plain_top_k,
)
from atlas_jax.hf.llama import gqa_fields, gqa_spec
from atlas_jax.hf.weights import ExpertNames, Spec

MODEL_TYPES = ("olmoe",)
NAMES = ExpertNames()


def config_from_hf(hf: Mapping[str, Any], *, dtype: str = "float32", names=None) -> ModelConfig:
  if field(hf, "attention_bias", bool, False):
    raise HFLoadError("olmoe with attention_bias=true is not supported")
  clip = field(hf, "clip_qkv", float, None)
  if clip is not None:
    raise HFLoadError(f"olmoe with clip_qkv={clip} is not supported; only null (no clipping)")
  F = field(hf, "intermediate_size", int)
  return model_config(
    **gqa_fields(hf),
    ffn_dim=F,  # no dense layer: every layer is a mixture of experts of this width
    qk_norm=True,
    qk_norm_scope="all_heads",
    dtype=dtype,
    param_dtype=dtype,
    moe=moe_config(
      n_experts=expert_count(hf, "num_experts", "num_local_experts"),
      top_k=field(hf, "num_experts_per_tok", int),
      expert_ffn_dim=F,
      norm_topk_prob=field(hf, "norm_topk_prob", bool, False),
    ),
  )


def spec(cfg: ModelConfig, hf=None, names=None) -> Spec:
  return gqa_spec(cfg, experts=NAMES, stored=names, legend_f="intermediate_size")


def model_type(cfg: ModelConfig) -> str | None:
  if cfg.moe is None or cfg.mla is not None or not cfg.qk_norm or cfg.qkv_bias:
    return None
  if cfg.partial_rotary_factor != 1:  # transformers' OLMoE rotates every dim of a head
    return None
  return "olmoe" if cfg.qk_norm_scope == "all_heads" and plain_top_k(cfg.moe) else None


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  m = cfg.moe
  if m.routed_scaling_factor != 1.0:
    raise export_error("olmoe", "moe.routed_scaling_factor", m.routed_scaling_factor, "only 1.0")
  if not all(cfg.sparse_layers()):
    raise export_error("olmoe", "moe dense layers", cfg.sparse_layers(), "every layer is MoE")
  if cfg.n_heads * cfg.head_dim != cfg.d_model:
    raise export_error(
      "olmoe", "head_dim", cfg.head_dim, f"n_heads x head_dim must be d_model={cfg.d_model}"
    )
  out = base_to_hf(cfg, "olmoe", "OlmoeForCausalLM")
  out.update(
    intermediate_size=m.expert_ffn_dim,
    num_experts=m.n_experts,
    num_experts_per_tok=m.top_k,
    norm_topk_prob=m.norm_topk_prob,
    attention_bias=False,
    clip_qkv=None,
  )
  return out
