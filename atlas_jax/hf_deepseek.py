"""Hugging Face import for DeepSeek-V3-family folders (model_type "deepseek_v3"), dense layers only.

    model = atlas_jax.hf.load("path/to/folder")   # dispatches here for deepseek_v3
    logits_BTV = model(tokens_BT)                  # matches transformers' DeepseekV3ForCausalLM

Mapping notes:

* Mixture-of-experts layers are rejected: every layer must be dense
  (first_k_dense_replace >= num_hidden_layers).
* DeepSeek's checkpoints lay the rope dims of q and k_rope out as interleaved pairs
  (rope_interleave, the default). We permute those output rows of q_proj / q_b_proj and
  kv_a_proj_with_mqa to the rotate-half layout at import; q and k are permuted alike, so every
  score is unchanged and the model runs one RoPE convention.
* kv_b_proj [N * (Hn + Hv), C] splits into W_UK [C, N, Hn] and W_UV [C, N, Hv].
* MTP modules (num_nextn_predict_layers, stored as layers num_hidden_layers ..) load into the
  sequential MTP heads when their tensors are present; their copies of the embedding and output
  head (embed_tokens, shared_head.head) are shared with the main model and not read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from atlas_jax.config import ConfigError, MLAConfig, ModelConfig, MTPConfig, RopeScaling
from atlas_jax.model import Transformer

MODEL_TYPES = ("deepseek_v3",)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Per-MTP-layer copies of tensors the main model already has.
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def _error(message: str) -> Exception:
  from atlas_jax.hf import HFLoadError

  return HFLoadError(message)


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
  params = hf.get("rope_parameters")
  if params is None:
    params = dict(hf.get("rope_scaling") or {})
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type == "default":
    return theta, None
  if rope_type == "linear":
    return theta, RopeScaling(type="linear", factor=float(params["factor"]))
  if rope_type == "yarn":
    old_len = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:  # DeepSeek's convention: the context extension ratio
      factor = hf["max_position_embeddings"] / old_len
    attention_factor = params.get("attention_factor")
    return theta, RopeScaling(
      type="yarn",
      factor=float(factor),
      original_max_position_embeddings=old_len,
      beta_fast=float(params.get("beta_fast") or 32),
      beta_slow=float(params.get("beta_slow") or 1),
      mscale=float(params.get("mscale") or 0.0),
      mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
      attention_factor=None if attention_factor is None else float(attention_factor),
      truncate=bool(params.get("truncate", True)),
    )
  raise _error(
    f"deepseek_v3 rope scaling type {rope_type!r} is not supported; supported: default, linear, "
    "yarn"
  )


def n_mtp_layers(hf: Mapping[str, Any]) -> int:
  return int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0)


def config_from_hf(
  hf: Mapping[str, Any], *, dtype: str = "float32", mtp_layers: int = 0
) -> ModelConfig:
  """A ModelConfig with `mla` (and `mtp` when `mtp_layers` > 0) for a deepseek_v3 config.json."""
  if hf.get("model_type") not in MODEL_TYPES:
    raise _error(f"model_type={hf.get('model_type')!r} is not one of {MODEL_TYPES}")
  n_layers = hf["num_hidden_layers"]
  dense = hf.get("first_k_dense_replace")
  if hf.get("n_routed_experts") and (dense is None or dense < n_layers):
    raise _error(
      f"deepseek_v3 with first_k_dense_replace={dense} < num_hidden_layers={n_layers} has "
      f"mixture-of-experts layers (n_routed_experts={hf.get('n_routed_experts')}), which are not "
      "supported; only dense layers (first_k_dense_replace >= num_hidden_layers)"
    )
  if hf.get("hidden_act", "silu") != "silu":
    raise _error(f"hidden_act={hf['hidden_act']!r} is not supported; only 'silu' (SwiGLU)")
  if hf.get("attention_bias"):
    raise _error("deepseek_v3 with attention_bias=true is not supported")
  n_heads = hf["num_attention_heads"]
  if (hf.get("num_key_value_heads") or n_heads) != n_heads:
    raise _error(
      f"deepseek_v3 with num_key_value_heads={hf['num_key_value_heads']} != "
      f"num_attention_heads={n_heads} is not supported (MLA decompresses every head)"
    )
  theta, scaling = _rope_from_hf(hf)
  try:
    return ModelConfig(
      vocab_size=hf["vocab_size"],
      d_model=hf["hidden_size"],
      n_layers=n_layers,
      n_heads=n_heads,
      n_kv_heads=n_heads,
      ffn_dim=hf["intermediate_size"],
      max_seq_len=hf.get("max_position_embeddings", 4096),
      rope_theta=theta,
      rope_scaling=scaling,
      norm_eps=hf.get("rms_norm_eps", 1e-6),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      dtype=dtype,
      param_dtype=dtype,
      mla=MLAConfig(
        kv_lora_rank=hf["kv_lora_rank"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        q_lora_rank=hf.get("q_lora_rank"),
      ),
      mtp=MTPConfig(kind="sequential", n_predict=mtp_layers) if mtp_layers else None,
    )
  except KeyError as e:
    raise _error(f"config.json lacks the field {e.args[0]!r}") from e
  except ConfigError as e:
    raise _error(f"config.json maps to an invalid model config: {e}") from e


def _deinterleave(R: int) -> np.ndarray:
  """Row order taking interleaved rope pairs (x0, x1), (x2, x3).. to rotate-half halves."""
  return np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)])


def _layer_map(cfg: ModelConfig, interleaved: bool) -> dict[str, tuple[tuple[str, ...], Callable]]:
  """HF name (after `model.layers.{i}.`) -> (our path inside a Block, torch -> ours)."""
  m = cfg.mla
  D, N = cfg.d_model, cfg.n_heads
  C, R, Hn, Hv = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
  perm = _deinterleave(R) if interleaved else np.arange(R)
  q_perm = np.concatenate([np.arange(Hn), Hn + perm])
  kv_perm = np.concatenate([np.arange(C), C + perm])

  def q_out(w):  # [N * (Hn + R), in] -> [in, N, Hn + R], rope rows de-interleaved
    return w.reshape(N, Hn + R, -1)[:, q_perm].transpose(2, 0, 1)

  def kv_b(lo, hi):  # [N * (Hn + Hv), C] -> [C, N, hi - lo]
    return lambda w: w.reshape(N, Hn + Hv, C)[:, lo:hi].transpose(2, 0, 1)

  same = lambda w: w
  mapping = {
    "input_layernorm.weight": (("attn_norm", "scale"), same),
    "self_attn.kv_a_proj_with_mqa.weight": (("attn", "wkv_a"), lambda w: w[kv_perm].T),
    "self_attn.kv_a_layernorm.weight": (("attn", "kv_norm", "scale"), same),
    "self_attn.kv_b_proj.weight": (("attn", "wk_b"), kv_b(0, Hn)),
    "self_attn.o_proj.weight": (("attn", "wo"), lambda w: w.T.reshape(N, Hv, D)),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), same),
    "mlp.gate_proj.weight": (("mlp", "w_gate"), lambda w: w.T),
    "mlp.up_proj.weight": (("mlp", "w_up"), lambda w: w.T),
    "mlp.down_proj.weight": (("mlp", "w_down"), lambda w: w.T),
  }
  if m.q_lora_rank is None:
    mapping["self_attn.q_proj.weight"] = (("attn", "wq"), q_out)
  else:
    mapping["self_attn.q_a_proj.weight"] = (("attn", "wq_a"), lambda w: w.T)
    mapping["self_attn.q_a_layernorm.weight"] = (("attn", "q_norm", "scale"), same)
    mapping["self_attn.q_b_proj.weight"] = (("attn", "wq_b"), q_out)
  return mapping


# kv_b_proj feeds two of our parameters; the second one is mapped here.
def _extra_maps(cfg: ModelConfig):
  m = cfg.mla
  N, C, Hn, Hv = cfg.n_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim
  return {
    "self_attn.kv_b_proj.weight": (
      ("attn", "wv_b"),
      lambda w: w.reshape(N, Hn + Hv, C)[:, Hn:].transpose(2, 0, 1),
    )
  }


def _mtp_map(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], Callable]]:
  same = lambda w: w
  return {
    "enorm.weight": (("enorm", "scale"), same),
    "hnorm.weight": (("hnorm", "scale"), same),
    "eh_proj.weight": (("eh_proj",), lambda w: w.T),
    "shared_head.norm.weight": (("norm", "scale"), same),
  }


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def params_from_hf(
  tensors: Mapping[str, Any], cfg: ModelConfig, *, interleaved: bool = True
) -> dict[str, Any]:
  """Our pure parameter dict from HF tensors; raises HFLoadError listing missing/unused names."""
  dtype = jnp.dtype(cfg.param_dtype)
  L = cfg.n_layers
  J = 0 if cfg.mtp is None else cfg.mtp.n_predict
  layer_map = _layer_map(cfg, interleaved)
  extra = _extra_maps(cfg)
  mtp_map = _mtp_map(cfg)
  moe = sorted(n for n in tensors if ".mlp.experts." in n or ".mlp.gate.weight" in n)
  if moe:
    raise _error(
      f"mixture-of-experts tensors ({', '.join(moe[:4])}, ...) are not supported; only dense "
      "DeepSeek layers load"
    )
  expected = ["model.embed_tokens.weight", "model.norm.weight"]
  if not cfg.tie_embeddings:
    expected.append("lm_head.weight")
  expected += [f"model.layers.{i}.{n}" for i in range(L + J) for n in layer_map]
  expected += [f"model.layers.{L + j}.{n}" for j in range(J) for n in mtp_map]
  missing = [n for n in expected if n not in tensors]
  if missing:
    shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
    raise _error(f"missing tensors: {shown}; expected {len(expected)} tensors in all")
  shared = {f"model.layers.{L + j}.{n}" for j in range(J) for n in _MTP_SHARED}
  unused = sorted(
    n
    for n in set(tensors) - set(expected) - shared
    if not n.endswith(_IGNORED_SUFFIXES) and not (cfg.tie_embeddings and n == "lm_head.weight")
  )
  if unused:
    raise _error(
      f"unexpected tensors (a feature this importer does not support?): {', '.join(unused[:8])}"
    )

  def cast(x):
    return jnp.asarray(x).astype(dtype)

  def stack(layers: range, mapping, tree: dict) -> None:
    for hf_name, (path, convert) in mapping.items():
      _set(
        tree,
        path,
        jnp.stack([convert(cast(tensors[f"model.layers.{i}.{hf_name}"])) for i in layers]),
      )

  params: dict[str, Any] = {"embed": cast(tensors["model.embed_tokens.weight"])}
  _set(params, ("final_norm", "scale"), cast(tensors["model.norm.weight"]))
  if not cfg.tie_embeddings:
    params["lm_head"] = cast(tensors["lm_head.weight"]).T
  blocks: dict[str, Any] = {}
  stack(range(L), layer_map, blocks)
  stack(range(L), extra, blocks)
  params["blocks"] = blocks
  if J:
    heads: dict[str, Any] = {}
    stack(range(L, L + J), mtp_map, heads)
    block: dict[str, Any] = {}
    stack(range(L, L + J), layer_map, block)
    stack(range(L, L + J), extra, block)
    heads["block"] = block
    params["mtp"] = {"heads": heads}
  from atlas_jax.hf import check_shapes

  check_shapes(params, cfg)
  return params


def load(
  folder: str | Path,
  hf_config: Mapping[str, Any],
  *,
  dtype: str = "float32",
  implementation: str | None = None,
) -> Transformer:
  """Loads a deepseek_v3 folder; called by `atlas_jax.hf.load` (which reads config.json)."""
  from atlas_jax.hf import read_safetensors

  config_from_hf(hf_config, dtype=dtype)  # reject unsupported configs before reading weights
  tensors = read_safetensors(folder)
  L = hf_config["num_hidden_layers"]
  # Count the MTP modules actually stored: transformers' save_pretrained drops them, so a
  # config may announce num_nextn_predict_layers without the weights.
  stored = 0
  while any(n.startswith(f"model.layers.{L + stored}.") for n in tensors):
    stored += 1
  announced = n_mtp_layers(hf_config)
  if stored > announced:
    raise _error(
      f"the checkpoint holds {stored} layers past num_hidden_layers={L} but "
      f"num_nextn_predict_layers={announced}"
    )
  cfg = config_from_hf(hf_config, dtype=dtype, mtp_layers=stored)
  interleaved = bool(hf_config.get("rope_interleave", True))
  params = params_from_hf(tensors, cfg, interleaved=interleaved)
  from atlas_jax.hf import build_model

  return build_model(cfg, params, implementation=implementation)
