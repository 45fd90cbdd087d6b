"""Mixtral: Mistral attention, every layer a softmax top-k mixture of experts, the k weights
renormalised. Checkpoints store the experts as `block_sparse_moe.experts.{e}.w1/w3/w2`
(transformers v5 as fused `mlp.experts.gate_up_proj` / `down_proj`); both load, export writes
the first."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from atlas_jax.config import ModelConfig
from atlas_jax.hf.common import (
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

MODEL_TYPES = ("mixtral",)
NAMES = ExpertNames(
  router="block_sparse_moe.gate.weight",
  per_expert="block_sparse_moe.experts.{e}.{proj}.weight",
  projections=("w1", "w3", "w2"),
)


def config_from_hf(hf: Mapping[str, Any], *, dtype: str = "float32", names=None) -> ModelConfig:
  F = field(hf, "intermediate_size", int)
  return model_config(
    **gqa_fields(hf),
    ffn_dim=F,  # no dense layer: every layer is a mixture of experts of this width
    sliding_window=field(hf, "sliding_window", int, None),
    dtype=dtype,
    param_dtype=dtype,
    moe=moe_config(
      n_experts=expert_count(hf, "num_local_experts", "num_experts"),
      top_k=field(hf, "num_experts_per_tok", int),
      expert_ffn_dim=F,
      norm_topk_prob=True,
    ),
  )


def spec(cfg: ModelConfig, hf=None, names=None) -> Spec:
  return gqa_spec(cfg, experts=NAMES, stored=names, legend_f="intermediate_size")


def model_type(cfg: ModelConfig) -> str | None:
  if cfg.moe is None or cfg.mla is not None or cfg.qk_norm or cfg.qkv_bias:
    return None
  if cfg.partial_rotary_factor != 1:  # transformers' Mixtral rotates every dim of a head
    return None
  return "mixtral" if plain_top_k(cfg.moe) else None


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  m = cfg.moe
  for name, value, allowed in (
    ("moe.norm_topk_prob", m.norm_topk_prob, True),
    ("moe.routed_scaling_factor", m.routed_scaling_factor, 1.0),
  ):
    if value != allowed:
      raise export_error("mixtral", name, value, f"Mixtral has only {allowed!r}")
  if not all(cfg.sparse_layers()):
    raise export_error("mixtral", "moe dense layers", cfg.sparse_layers(), "every layer is MoE")
  out = base_to_hf(cfg, "mixtral", "MixtralForCausalLM")
  out.update(
    intermediate_size=m.expert_ffn_dim,
    head_dim=cfg.head_dim,
    sliding_window=cfg.sliding_window,
    num_local_experts=m.n_experts,
    num_experts_per_tok=m.top_k,
    router_jitter_noise=0.0,
  )
  return out
