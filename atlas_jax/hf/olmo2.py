"""OLMo 2: the Llama layout with its norms after the sublayers (x + norm(attn(x)), `post_norms`
without `pre_norms`) and one RMSNorm over all heads of q and of k (`qk_norm_scope: all_heads`,
as OLMoE)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from atlas_jax.config import ModelConfig
from atlas_jax.hf.common import HFLoadError, base_to_hf, field, llama_scoring, model_config
from atlas_jax.hf.llama import attention, gqa_fields
from atlas_jax.hf.weights import Spec, model_group, norm, swiglu, trunk_groups

MODEL_TYPES = ("olmo2",)


def config_from_hf(hf: Mapping[str, Any], *, dtype: str = "float32", names=None) -> ModelConfig:
  if field(hf, "attention_bias", bool, False):
    raise HFLoadError("olmo2 with attention_bias=true is not supported")
  return model_config(
    **gqa_fields(hf),
    ffn_dim=field(hf, "intermediate_size", int),
    qk_norm=True,
    qk_norm_scope="all_heads",
    pre_norms=False,
    post_norms=True,
    dtype=dtype,
    param_dtype=dtype,
  )


def spec(cfg: ModelConfig, hf: Mapping[str, Any] | None = None, names=None) -> Spec:
  D, d = cfg.d_model, "hidden_size"
  # The Llama family's projections and q/k norms; its two block norms are OLMo 2's post-norms.
  projections = [w for w in attention(cfg) if w.names[0].startswith("self_attn.")]
  post = [
    norm("post_attention_layernorm.weight", D, d, ("attn_post_norm", "scale")),
    norm("post_feedforward_layernorm.weight", D, d, ("mlp_post_norm", "scale")),
  ]

  def layer(i, prefix):
    return tuple(projections + post + swiglu("mlp", D, cfg.ffn_dim, "intermediate_size", ("mlp",)))

  return Spec((model_group(cfg), *trunk_groups(cfg, layer)))


def model_type(cfg: ModelConfig) -> str | None:
  olmo2 = (
    cfg.mla is None
    and cfg.moe is None
    and not cfg.pre_norms
    and cfg.post_norms
    and cfg.qk_norm
    and cfg.qk_norm_scope == "all_heads"
    and not cfg.qkv_bias
    and cfg.layer_types is None
    and cfg.sliding_window is None
    and not cfg.nope_layers
    and llama_scoring(cfg)
  )
  return "olmo2" if olmo2 else None


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  if model_type(cfg) is None:
    raise HFLoadError(f"an OLMo 2 export cannot hold this config: {cfg}")
  return {**base_to_hf(cfg, "olmo2", "Olmo2ForCausalLM"), "attention_bias": False}
