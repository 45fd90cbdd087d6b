"""Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's differences, each a config field.

* GeGLU feed-forward (`mlp_activation: gelu_tanh`, transformers' `gelu_pytorch_tanh`).
* Embeddings times sqrt(hidden_size) (`scale_embeddings`).
* Four norms per block, before and after each sublayer (`pre_norms` and `post_norms`).
* RMSNorm scales stored as w with the norm multiplying by (1 + w): held here as 1 + w (added in
  float32 at load, as transformers computes it; subtracted at export), so the model's RMSNorm is
  the Llama one.
* A softmax scale of its own, query_pre_attn_scalar ** -0.5 (`query_pre_attn_scalar`).
* Sliding-window and global layers (`layer_types`, `sliding_window`): Gemma 2 alternates them,
  Gemma 3 has five local layers per global one; Gemma 3's local layers rotate with their own RoPE
  base (`rope_local_theta`), its global ones with the scaled one.
* Gemma 2: attention scores and final logits soft-capped, c * tanh(x / c)
  (`attn_logit_softcapping`, `final_logit_softcapping`). Gemma 3: per-head RMSNorm on q and k
  (`qk_norm`) and no capping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from atlas_jax.config import ModelConfig
from atlas_jax.hf.common import (
  HFLoadError,
  base_to_hf,
  export_error,
  field,
  model_config,
  rope_from_hf,
  rope_to_hf,
)
from atlas_jax.hf.llama import attention, gqa_fields
from atlas_jax.hf.weights import Spec, Weights, model_group, swiglu, trunk_groups, weight

MODEL_TYPES = ("gemma2", "gemma3_text")
ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
GELU = ("gelu_pytorch_tanh", "gelu_tanh")


def gemma_norm(name: str, dim: int, legend: str, where: tuple[str, ...]) -> Weights:
  """A Gemma RMSNorm weight w, held as the scale 1 + w."""
  return weight(
    name,
    (dim,),
    legend,
    where,
    lambda w: jnp.asarray(w, jnp.float32) + 1.0,
    lambda s: s - 1.0,
  )


def _rope(hf: Mapping[str, Any], params: Any, where: str):
  """(theta, scaling) of one layer type's RoPE, read as the families read theirs."""
  one = {"model_type": hf.get("model_type"), "rope_parameters": params}
  one["max_position_embeddings"] = hf.get("max_position_embeddings")
  try:
    return rope_from_hf(one, allowed=("default", "linear", "llama3"))
  except HFLoadError as e:
    raise HFLoadError(f"{where}: {e}") from e


def config_from_hf(hf: Mapping[str, Any], *, dtype: str = "float32", names=None) -> ModelConfig:
  model_type = hf.get("model_type")
  act = field(hf, "hidden_activation", str, None) or field(hf, "hidden_act", str, GELU[0])
  if act not in GELU:
    raise HFLoadError(f"{model_type} with hidden_activation={act!r} is not supported: {GELU}")
  if field(hf, "attention_bias", bool, False):
    raise HFLoadError(f"{model_type} with attention_bias=true is not supported")
  if field(hf, "use_bidirectional_attention", bool, False):
    raise HFLoadError(f"{model_type} with use_bidirectional_attention=true is not supported")
  fields = gqa_fields({**hf, "hidden_act": "silu"})  # the activation is checked above
  L = fields["n_layers"]
  layer_types = field(hf, "layer_types", list, None)
  if layer_types is None:  # older config.json: the pattern's period
    period = 2 if model_type == "gemma2" else field(hf, "sliding_window_pattern", int, 6)
    layer_types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(L)]
  rope_local = None
  params = hf.get("rope_parameters")
  if model_type == "gemma3_text":
    if isinstance(params, dict) and "full_attention" in params:
      theta, scaling = _rope(hf, params["full_attention"], "rope_parameters.full_attention")
      local, local_scaling = _rope(
        hf, params.get("sliding_attention", {}), "rope_parameters.sliding_attention"
      )
      if local_scaling is not None:
        raise HFLoadError(
          f"gemma3_text: rope_parameters.sliding_attention scaling {local_scaling.type!r} is "
          "not supported; the local layers' RoPE is unscaled"
        )
      fields.update(rope_theta=theta, rope_scaling=scaling)
      rope_local = local
    else:  # transformers v4: rope_theta and rope_scaling for the global layers
      rope_local = field(hf, "rope_local_base_freq", float, 10000.0)
  return model_config(
    **fields,
    ffn_dim=field(hf, "intermediate_size", int),
    qk_norm=model_type == "gemma3_text",
    sliding_window=field(hf, "sliding_window", int, None),
    layer_types=tuple(layer_types),
    rope_local_theta=rope_local,
    attn_logit_softcapping=field(hf, "attn_logit_softcapping", float, None),
    final_logit_softcapping=field(hf, "final_logit_softcapping", float, None),
    query_pre_attn_scalar=field(hf, "query_pre_attn_scalar", float, float(fields["head_dim"])),
    post_norms=True,
    mlp_activation="gelu_tanh",
    scale_embeddings=True,
    dtype=dtype,
    param_dtype=dtype,
  )


def spec(cfg: ModelConfig, hf: Mapping[str, Any] | None = None, names=None) -> Spec:
  D, H, d = cfg.d_model, cfg.head_dim, "hidden_size"
  norms = {
    "input_layernorm.weight": ("attn_norm", "scale"),
    "post_attention_layernorm.weight": ("attn_post_norm", "scale"),
    "pre_feedforward_layernorm.weight": ("mlp_norm", "scale"),
    "post_feedforward_layernorm.weight": ("mlp_post_norm", "scale"),
  }
  block_norms = [gemma_norm(name, D, d, where) for name, where in norms.items()]
  if cfg.qk_norm:
    for qk in ("q", "k"):
      where = ("attn", f"{qk}_norm", "scale")
      block_norms.append(gemma_norm(f"self_attn.{qk}_norm.weight", H, "head_dim", where))
  # The projections as the Llama family stores them (its norms are Gemma's, above).
  projections = [
    w for w in attention(cfg) if w.names[0].startswith("self_attn.") and "_norm" not in w.names[0]
  ]

  def layer(i, prefix):
    ffn = swiglu("mlp", D, cfg.ffn_dim, "intermediate_size", ("mlp",))
    return tuple(projections + block_norms + ffn)

  top = model_group(cfg)
  final = gemma_norm("model.norm.weight", D, d, ("final_norm", "scale"))
  weights = tuple(final if w.names[0] == final.names[0] else w for w in top.weights)
  top = dataclasses.replace(top, weights=weights)
  return Spec((top, *trunk_groups(cfg, layer)))


def model_type(cfg: ModelConfig) -> str | None:
  """gemma2 or gemma3_text for a config of their layout, else None."""
  gemma = (
    cfg.mla is None
    and cfg.moe is None
    and cfg.mtp is None
    and cfg.pre_norms
    and cfg.post_norms
    and cfg.mlp_activation == "gelu_tanh"
    and cfg.scale_embeddings
    and not cfg.qkv_bias
    and not cfg.nope_layers
  )
  if not gemma:
    return None
  if cfg.qk_norm:
    return "gemma3_text" if cfg.qk_norm_scope == "head" else None
  return "gemma2" if cfg.rope_local_theta is None else None


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  kind = model_type(cfg)
  if kind is None:
    raise HFLoadError(f"a Gemma export cannot hold this config: {cfg}")
  if kind == "gemma3_text" and cfg.attn_logit_softcapping is not None:
    raise export_error(kind, "attn_logit_softcapping", cfg.attn_logit_softcapping, "only null")
  kinds, _ = cfg.attention_kinds()
  layer_types = cfg.layer_types or (
    ("sliding_attention" if cfg.sliding_window else "full_attention",) * cfg.n_layers
  )
  out = base_to_hf(cfg, kind, ARCHITECTURES[kind])
  del out["hidden_act"]
  out.update(
    hidden_activation="gelu_pytorch_tanh",
    head_dim=cfg.head_dim,
    attention_bias=False,
    sliding_window=cfg.sliding_window,
    layer_types=list(layer_types),
    attn_logit_softcapping=cfg.attn_logit_softcapping,
    final_logit_softcapping=cfg.final_logit_softcapping,
    query_pre_attn_scalar=_int_if_whole(cfg.query_pre_attn_scalar or cfg.head_dim),
  )
  if kind == "gemma3_text":
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    out["rope_parameters"] = {"full_attention": rope_to_hf(cfg), "sliding_attention": local}
    out.pop("rope_scaling", None)
    out.pop("rope_theta", None)
  return out


def _int_if_whole(x: float) -> int | float:
  """transformers' Gemma configs type query_pre_attn_scalar as an int."""
  return int(x) if float(x).is_integer() else x
