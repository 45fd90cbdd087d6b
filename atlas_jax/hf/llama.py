"""The Llama family (Llama, Mistral, Qwen2, Qwen3), and the grouped-query attention tensors the
mixture-of-experts families with GQA (Mixtral, Qwen2/3-MoE, OLMoE) store the same way."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from atlas_jax.config import ModelConfig
from atlas_jax.hf.common import HFLoadError, base_fields, base_to_hf, field, model_config
from atlas_jax.hf.weights import (
  ExpertNames,
  Spec,
  Weights,
  model_group,
  norm,
  out_proj,
  swiglu,
  trunk_groups,
  uses_fused_experts,
  weight,
)
from atlas_jax.hf.weights import experts as routed

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {
  "llama": "LlamaForCausalLM",
  "mistral": "MistralForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
}


def attention(cfg: ModelConfig, prefix: str = "self_attn") -> list[Weights]:
  """q/k/v/o projections [heads * H, D] held as [D, heads, H] (o: [N, H, D]), their biases
  (Qwen2), per-head q/k norms (Qwen3) or all-heads ones (OLMoE), and the two block norms."""
  N, K, H, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
  q, kv, d = "num_attention_heads * head_dim", "num_key_value_heads * head_dim", "hidden_size"

  def proj(name, heads, legend):
    return weight(
      f"{prefix}.{name}_proj.weight",
      (heads * H, D),
      f"{legend}, {d}",
      ("attn", f"w{name}"),
      lambda w: w.reshape(heads, H, D).transpose(2, 0, 1),
      lambda w: w.transpose(1, 2, 0).reshape(heads * H, D),
    )

  def per_head(name, heads, legend, where):  # [heads * H] held as [heads, H]
    return weight(
      name, (heads * H,), legend, where, lambda b: b.reshape(heads, H), lambda b: b.reshape(-1)
    )

  out = [
    norm("input_layernorm.weight", D, d, ("attn_norm", "scale")),
    proj("q", N, q),
    proj("k", K, kv),
    proj("v", K, kv),
    out_proj(f"{prefix}.o_proj.weight", N, H, D, q),
    norm("post_attention_layernorm.weight", D, d, ("mlp_norm", "scale")),
  ]
  if cfg.qkv_bias:
    for name, heads, legend in (("q", N, q), ("k", K, kv), ("v", K, kv)):
      out.append(per_head(f"{prefix}.{name}_proj.bias", heads, legend, ("attn", f"b{name}")))
  if cfg.qk_norm and cfg.qk_norm_scope == "all_heads":
    out.append(per_head(f"{prefix}.q_norm.weight", N, q, ("attn", "q_norm")))
    out.append(per_head(f"{prefix}.k_norm.weight", K, kv, ("attn", "k_norm")))
  elif cfg.qk_norm:
    out.append(norm(f"{prefix}.q_norm.weight", H, "head_dim", ("attn", "q_norm", "scale")))
    out.append(norm(f"{prefix}.k_norm.weight", H, "head_dim", ("attn", "k_norm", "scale")))
  return out


def gqa_fields(hf: Mapping[str, Any]) -> dict:
  """`base_fields` plus the head dim (config.json's, or hidden_size / heads)."""
  fields = base_fields(hf)
  fields["head_dim"] = field(hf, "head_dim", int, fields["d_model"] // fields["n_heads"])
  return fields


def no_sliding_window(hf: Mapping[str, Any]) -> None:
  if field(hf, "use_sliding_window", bool, False):
    raise HFLoadError(
      f"{hf.get('model_type')} with use_sliding_window=true is not supported (per-layer windows)"
    )


def config_from_hf(hf: Mapping[str, Any], *, dtype: str = "float32", names=None) -> ModelConfig:
  model_type = hf.get("model_type")
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
  else:
    no_sliding_window(hf)
  return model_config(
    **gqa_fields(hf),
    ffn_dim=field(hf, "intermediate_size", int),
    qkv_bias=model_type == "qwen2",
    qk_norm=model_type == "qwen3",
    sliding_window=sliding_window,
    dtype=dtype,
    param_dtype=dtype,
  )


def spec(cfg: ModelConfig, hf: Mapping[str, Any] | None = None, names=None) -> Spec:
  return gqa_spec(cfg)


def gqa_spec(
  cfg: ModelConfig,
  *,
  experts: ExpertNames | None = None,
  stored: set[str] | None = None,
  legend_f: str = "moe_intermediate_size",
  shared: Callable[[], list[Weights]] | None = None,
) -> Spec:
  """A GQA model's table: dense SwiGLU layers, and mixture-of-experts ones where the config has
  them (their experts stored as `experts` names them, per expert or fused as `stored` shows;
  `shared()` the shared expert's tensors, when the family has one)."""
  D, sparse_L = cfg.d_model, cfg.sparse_layers()

  def layer(i, prefix):
    if not sparse_L[i]:
      return tuple(attention(cfg) + swiglu("mlp", D, cfg.ffn_dim, "intermediate_size", ("mlp",)))
    m = cfg.moe
    fused = uses_fused_experts(stored, prefix, experts)
    ffn = routed(
      prefix, m.n_experts, D, m.expert_ffn_dim, names=experts, fused=fused, legend_f=legend_f
    )
    return tuple(attention(cfg) + ffn + (shared() if shared else []))

  return Spec((model_group(cfg), *trunk_groups(cfg, layer)))


def model_type(cfg: ModelConfig) -> str | None:
  """The model type a config exports as, or None when it is not of this family."""
  if cfg.mla is not None or cfg.moe is not None or cfg.partial_rotary_factor != 1:
    return None  # transformers' Llama and Qwen rotate every dim of a head
  if cfg.qk_norm:
    return "qwen3" if cfg.qk_norm_scope == "head" and not cfg.qkv_bias else None
  if cfg.qkv_bias:
    return "qwen2"
  return "mistral" if cfg.sliding_window else "llama"


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  kind = model_type(cfg)
  if kind is None:
    raise HFLoadError(f"a Llama-family export cannot hold this config: {cfg}")
  return {
    **base_to_hf(cfg, kind, ARCHITECTURES[kind]),
    "head_dim": cfg.head_dim,
    "attention_bias": cfg.qkv_bias,
    "sliding_window": cfg.sliding_window,
    "use_sliding_window": False,
  }
