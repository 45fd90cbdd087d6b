"""SmolLM3: the Llama layout with some layers applying no RoPE (NoPE; config.json's
`no_rope_layers`, one flag per layer, 1 where the layer rotates), held as `nope_layers` (the
indices of the layers that do not), and optional sliding-window layers (`use_sliding_window`,
`layer_types`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from atlas_jax.config import ModelConfig
from atlas_jax.hf.common import HFLoadError, base_to_hf, field, llama_scoring, model_config
from atlas_jax.hf.llama import gqa_fields, gqa_spec
from atlas_jax.hf.weights import Spec

MODEL_TYPES = ("smollm3",)


def config_from_hf(hf: Mapping[str, Any], *, dtype: str = "float32", names=None) -> ModelConfig:
  if field(hf, "attention_bias", bool, False) or field(hf, "mlp_bias", bool, False):
    raise HFLoadError("smollm3 with attention_bias or mlp_bias true is not supported")
  fields = gqa_fields(hf)
  L = fields["n_layers"]
  uses_rope = field(hf, "no_rope_layers", list, None)
  if uses_rope is None:  # transformers' default: every `no_rope_layer_interval`-th layer
    interval = field(hf, "no_rope_layer_interval", int, 4)
    uses_rope = [int((i + 1) % interval != 0) for i in range(L)]
  if len(uses_rope) != L or any(flag not in (0, 1) for flag in uses_rope):
    raise HFLoadError(
      f"config.json field 'no_rope_layers'={uses_rope!r} is not allowed: one 0 or 1 per layer "
      f"({L}, num_hidden_layers)"
    )
  layer_types = None
  window = None
  if field(hf, "use_sliding_window", bool, False):
    window = field(hf, "sliding_window", int, None)
    layer_types = field(hf, "layer_types", list, None)
    if layer_types is None and window is not None:  # transformers' default: the NoPE layers
      layer_types = ["full_attention" if r else "sliding_attention" for r in uses_rope]
    if layer_types is not None and "sliding_attention" not in layer_types:
      layer_types, window = None, None
  return model_config(
    **fields,
    ffn_dim=field(hf, "intermediate_size", int),
    nope_layers=tuple(i for i, r in enumerate(uses_rope) if not r),
    sliding_window=window,
    layer_types=None if layer_types is None else tuple(layer_types),
    dtype=dtype,
    param_dtype=dtype,
  )


def spec(cfg: ModelConfig, hf: Mapping[str, Any] | None = None, names=None) -> Spec:
  return gqa_spec(cfg)


def model_type(cfg: ModelConfig) -> str | None:
  smol = (
    cfg.mla is None
    and cfg.moe is None
    and cfg.nope_layers
    and cfg.pre_norms
    and not cfg.post_norms
    and not cfg.qk_norm
    and not cfg.qkv_bias
    and llama_scoring(cfg)
  )
  return "smollm3" if smol else None


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  if model_type(cfg) is None:
    raise HFLoadError(f"a SmolLM3 export cannot hold this config: {cfg}")
  windowed = cfg.sliding_window is not None
  layer_types = cfg.layer_types or (
    ("sliding_attention" if windowed else "full_attention",) * cfg.n_layers
  )
  return {
    **base_to_hf(cfg, "smollm3", "SmolLM3ForCausalLM"),
    "attention_bias": False,
    "mlp_bias": False,
    "no_rope_layers": [int(i not in cfg.nope_layers) for i in range(cfg.n_layers)],
    "use_sliding_window": windowed,
    "sliding_window": cfg.sliding_window,
    "layer_types": list(layer_types),
    # transformers' default (128004) is a row of the real vocabulary only; ours holds no pad id.
    "pad_token_id": None,
  }
