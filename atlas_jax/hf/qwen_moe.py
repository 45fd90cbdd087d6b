"""Qwen2-MoE and Qwen3-MoE: softmax top-k experts (renormalised when `norm_topk_prob`), MoE
layers every `decoder_sparse_step` layers except `mlp_only_layers` (dense SwiGLU of
`intermediate_size`). Qwen2-MoE adds q/k/v biases and a shared expert scaled by
sigmoid(x @ shared_expert_gate); Qwen3-MoE has per-head q/k norms and no shared expert."""

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
)
from atlas_jax.hf.llama import gqa_fields, gqa_spec, no_sliding_window
from atlas_jax.hf.weights import ExpertNames, Spec, swiglu, weight

MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
NAMES = ExpertNames()


def config_from_hf(hf: Mapping[str, Any], *, dtype: str = "float32", names=None) -> ModelConfig:
  qwen2 = hf.get("model_type") == "qwen2_moe"
  no_sliding_window(hf)
  if not qwen2 and field(hf, "attention_bias", bool, False):
    raise HFLoadError("qwen3_moe with attention_bias=true is not supported")
  dense = field(hf, "mlp_only_layers", list, [])
  if not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
    raise HFLoadError(f"config.json field 'mlp_only_layers'={dense!r} must be a list of integers")
  shared = field(hf, "shared_expert_intermediate_size", int) if qwen2 else 0
  if qwen2 and shared <= 0:
    raise HFLoadError(
      f"qwen2_moe with shared_expert_intermediate_size={shared} is not supported: must be > 0"
    )
  return model_config(
    **gqa_fields(hf),
    ffn_dim=field(hf, "intermediate_size", int),
    qkv_bias=qwen2 and field(hf, "qkv_bias", bool, True),
    qk_norm=not qwen2,
    dtype=dtype,
    param_dtype=dtype,
    moe=moe_config(
      n_experts=expert_count(hf, "num_experts", "num_local_experts"),
      top_k=field(hf, "num_experts_per_tok", int),
      expert_ffn_dim=field(hf, "moe_intermediate_size", int),
      norm_topk_prob=field(hf, "norm_topk_prob", bool, False),
      shared_ffn_dim=shared,
      shared_expert_gate=qwen2,
      sparse_step=field(hf, "decoder_sparse_step", int, 1),
      dense_layers=tuple(dense),
    ),
  )


def spec(cfg: ModelConfig, hf=None, names=None) -> Spec:
  m, D = cfg.moe, cfg.d_model

  def shared():  # Qwen2-MoE: one shared expert, scaled by sigmoid(x @ shared_expert_gate)
    legend = "shared_expert_intermediate_size"
    return swiglu("mlp.shared_expert", D, m.shared_ffn_dim, legend, ("mlp", "shared")) + [
      weight(
        "mlp.shared_expert_gate.weight",
        (1, D),
        "1, hidden_size",
        ("mlp", "shared_gate"),
        lambda w: w[0],
        lambda w: w[None],
      )
    ]

  return gqa_spec(cfg, experts=NAMES, stored=names, shared=shared if m.shared_ffn_dim else None)


def model_type(cfg: ModelConfig) -> str | None:
  if cfg.moe is None or cfg.mla is not None or cfg.sliding_window is not None:
    return None
  if cfg.partial_rotary_factor != 1:  # transformers' Qwen-MoE rotates every dim of a head
    return None
  m = cfg.moe
  if m.scoring != "softmax" or m.topk_method != "greedy" or m.first_k_dense:
    return None  # Qwen's routers are plain top-k; its dense layers are mlp_only_layers
  if m.shared_expert_gate and cfg.qkv_bias and not cfg.qk_norm:
    return "qwen2_moe"
  if not m.shared_ffn_dim and cfg.qk_norm and cfg.qk_norm_scope == "head" and not cfg.qkv_bias:
    return "qwen3_moe"
  return None


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  kind, m = model_type(cfg), cfg.moe
  if m.routed_scaling_factor != 1.0:
    raise export_error(kind, "moe.routed_scaling_factor", m.routed_scaling_factor, "only 1.0")
  arch = "Qwen2MoeForCausalLM" if kind == "qwen2_moe" else "Qwen3MoeForCausalLM"
  out = base_to_hf(cfg, kind, arch)
  out.update(
    head_dim=cfg.head_dim,
    num_experts=m.n_experts,
    num_experts_per_tok=m.top_k,
    moe_intermediate_size=m.expert_ffn_dim,
    norm_topk_prob=m.norm_topk_prob,
    decoder_sparse_step=m.sparse_step,
    mlp_only_layers=list(m.dense_layers),
    use_sliding_window=False,
  )
  if kind == "qwen2_moe":
    out.update(shared_expert_intermediate_size=m.shared_ffn_dim, qkv_bias=True)
  else:
    out.update(attention_bias=False)
  return out
