"""gpt-oss (transformers' `GptOssForCausalLM`): GQA with every mixture-of-experts layer, each of
its differences a config field.

* q/k/v and output projections with biases (`qkv_bias`, `attn_out_bias`).
* A learned logit per query head joining each softmax's denominator (`attention_sinks`;
  `self_attn.sinks` [num_attention_heads]).
* Sliding-window and full layers alternating (`layer_types`, `sliding_window`), YaRN RoPE with
  `truncate: false` (the correction range left fractional).
* The router a linear with a bias (`moe.router_bias`): top-k of the logits, then a softmax over
  the k chosen, which is the softmax over every expert renormalised over the k
  (`moe.norm_topk_prob`).
* Experts with biases (`moe.expert_bias`) and the clamped SwiGLU (`moe.swiglu_limit`,
  `moe.swiglu_alpha`). They are stored fused: `mlp.experts.gate_up_proj` [E, D, 2F] with gate and
  up interleaved along the last axis (gate = [..., ::2], up = [..., 1::2]) and its bias [E, 2F];
  `down_proj` [E, F, D] and its bias [E, D] (already in our [in, out] layout).

The released checkpoints store the experts quantized to MXFP4 (`*_blocks`, `*_scales`):
`atlas_jax.hf.mxfp4` dequantizes them at load into the float layout this table reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from atlas_jax.config import ModelConfig
from atlas_jax.hf import mxfp4
from atlas_jax.hf.common import (
  HFLoadError,
  base_fields,
  base_to_hf,
  expert_count,
  export_error,
  field,
  model_config,
  moe_config,
)
from atlas_jax.hf.llama import attention
from atlas_jax.hf.weights import Spec, Weights, model_group, trunk_groups, weight

MODEL_TYPES = ("gpt_oss",)
LAYER_TYPES = ("full_attention", "sliding_attention")


def config_from_hf(hf: Mapping[str, Any], *, dtype: str = "float32", names=None) -> ModelConfig:
  quant = hf.get("quantization_config")
  if quant is not None and not mxfp4.applies(hf):
    method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
    raise HFLoadError(
      f"gpt_oss with quantization_config.quant_method={method!r} is not supported: only "
      "'mxfp4' (the released checkpoints' experts, dequantized at load) or float checkpoints"
    )
  if not field(hf, "attention_bias", bool, True):
    raise HFLoadError("gpt_oss with attention_bias=false is not supported (only true)")
  fields = base_fields(hf, allowed_rope=("default", "yarn"))
  fields["head_dim"] = field(hf, "head_dim", int, fields["d_model"] // fields["n_heads"])
  L = fields["n_layers"]
  layer_types = field(hf, "layer_types", list, None)
  if layer_types is None:
    layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
  bad = [t for t in layer_types if t not in LAYER_TYPES]
  if bad or len(layer_types) != L:
    raise HFLoadError(
      f"config.json field 'layer_types'={layer_types!r} must list num_hidden_layers={L} of "
      f"{LAYER_TYPES}"
    )
  E = expert_count(hf, "num_local_experts", "num_experts")
  F = field(hf, "intermediate_size", int)
  return model_config(
    **fields,
    ffn_dim=F,  # every layer is MoE; the dense width is unused
    qkv_bias=True,
    attn_out_bias=True,
    attention_sinks=True,
    sliding_window=field(hf, "sliding_window", int, 128),
    layer_types=tuple(layer_types),
    dtype=dtype,
    param_dtype=dtype,
    moe=moe_config(
      n_experts=E,
      top_k=field(hf, "num_experts_per_tok", int),
      expert_ffn_dim=F,
      norm_topk_prob=True,
      router_bias=True,
      expert_bias=True,
      swiglu_limit=field(hf, "swiglu_limit", float, 7.0),
      swiglu_alpha=field(hf, "swiglu_alpha", float, 1.702),
    ),
  )


def _experts(cfg: ModelConfig) -> list[Weights]:
  m, D = cfg.moe, cfg.d_model
  E, F = m.n_experts, m.expert_ffn_dim
  legend = "num_local_experts, hidden_size, 2 * intermediate_size"

  def interleave(a, b):  # [..., F] twice -> [..., 2F] as gate, up, gate, up, ...
    a, b = np.asarray(a), np.asarray(b)
    return np.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])

  def fused(name, shape, legend, gate, up):
    return Weights(
      (name,),
      shape,
      legend,
      lambda w: {("mlp", gate): w[..., ::2], ("mlp", up): w[..., 1::2]},
      lambda p: (interleave(p["mlp", gate], p["mlp", up]),),
    )

  return [
    weight(
      "mlp.router.weight",
      (E, D),
      "num_local_experts, hidden_size",
      ("mlp", "router"),
      lambda w: w.T,
      lambda w: w.T,
    ),
    weight("mlp.router.bias", (E,), "num_local_experts", ("mlp", "router_bias")),
    fused("mlp.experts.gate_up_proj", (E, D, 2 * F), legend, "w_gate", "w_up"),
    fused(
      "mlp.experts.gate_up_proj_bias",
      (E, 2 * F),
      "num_local_experts, 2 * intermediate_size",
      "b_gate",
      "b_up",
    ),
    weight(
      "mlp.experts.down_proj",
      (E, F, D),
      "num_local_experts, intermediate_size, hidden_size",
      ("mlp", "w_down"),
    ),
    weight(
      "mlp.experts.down_proj_bias", (E, D), "num_local_experts, hidden_size", ("mlp", "b_down")
    ),
  ]


def spec(cfg: ModelConfig, hf: Mapping[str, Any] | None = None, names=None) -> Spec:
  N, D = cfg.n_heads, cfg.d_model
  extra = [
    weight("self_attn.o_proj.bias", (D,), "hidden_size", ("attn", "bo")),
    weight("self_attn.sinks", (N,), "num_attention_heads", ("attn", "sinks")),
  ]

  def layer(i, prefix):
    return tuple(attention(cfg) + extra + _experts(cfg))

  return Spec((model_group(cfg), *trunk_groups(cfg, layer)))


def model_type(cfg: ModelConfig) -> str | None:
  """gpt_oss for a config with any of gpt-oss's own features (sinks, output bias, the experts'
  biases or clamped SwiGLU), else None; `config_to_hf` refuses one lacking the rest."""
  m = cfg.moe
  own = cfg.attention_sinks or cfg.attn_out_bias
  if m is not None:
    own = own or m.router_bias or m.expert_bias or m.swiglu_limit is not None
  return "gpt_oss" if own else None


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  kind, m = "gpt_oss", cfg.moe
  required = {
    "attention_sinks": cfg.attention_sinks,
    "attn_out_bias": cfg.attn_out_bias,
    "qkv_bias": cfg.qkv_bias,
    "moe.router_bias": m is not None and m.router_bias,
    "moe.expert_bias": m is not None and m.expert_bias,
    "moe.norm_topk_prob": m is not None and m.norm_topk_prob,
  }
  for name, value in required.items():
    if not value:
      raise export_error(kind, name, value, "only true (gpt-oss's layout)")
  if m.swiglu_limit is None:
    raise export_error(kind, "moe.swiglu_limit", None, "a number (gpt-oss's clamped SwiGLU)")
  checks = {
    "mla": (cfg.mla, None),
    "mtp": (cfg.mtp, None),
    "qk_norm": (cfg.qk_norm, False),
    "post_norms": (cfg.post_norms, False),
    "pre_norms": (cfg.pre_norms, True),
    "mlp_activation": (cfg.mlp_activation, "silu"),
    "scale_embeddings": (cfg.scale_embeddings, False),
    "attn_logit_softcapping": (cfg.attn_logit_softcapping, None),
    "final_logit_softcapping": (cfg.final_logit_softcapping, None),
    "query_pre_attn_scalar": (cfg.query_pre_attn_scalar, None),
    "rope_local_theta": (cfg.rope_local_theta, None),
    "nope_layers": (cfg.nope_layers, ()),
    "partial_rotary_factor": (cfg.partial_rotary_factor, 1.0),
    "moe.scoring": (m.scoring, "softmax"),
    "moe.topk_method": (m.topk_method, "greedy"),
    "moe.shared_ffn_dim": (m.shared_ffn_dim, 0),
    "moe.routed_scaling_factor": (m.routed_scaling_factor, 1.0),
    "moe.first_k_dense": (m.first_k_dense, 0),
    "moe.sparse_step": (m.sparse_step, 1),
    "moe.dense_layers": (m.dense_layers, ()),
  }
  for name, (value, allowed) in checks.items():
    if value != allowed:
      raise export_error(kind, name, value, f"only {allowed!r}")
  layer_types = cfg.layer_types or (
    ("sliding_attention" if cfg.sliding_window else "full_attention",) * cfg.n_layers
  )
  out = base_to_hf(cfg, kind, "GptOssForCausalLM")
  out.update(
    head_dim=cfg.head_dim,
    intermediate_size=m.expert_ffn_dim,
    num_local_experts=m.n_experts,
    num_experts_per_tok=m.top_k,
    swiglu_limit=m.swiglu_limit,
    swiglu_alpha=m.swiglu_alpha,
    attention_bias=True,
    sliding_window=cfg.sliding_window,
    layer_types=list(layer_types),
  )
  return out
