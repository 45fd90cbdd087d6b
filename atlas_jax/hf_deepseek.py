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
from atlas_jax.hf import (
  REQUIRED,
  HFLoadError,
  build_model,
  check_shapes,
  check_tensor_shapes,
  field,
  read_safetensors,
)
from atlas_jax.model import Transformer

MODEL_TYPES = ("deepseek_v3",)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Per-MTP-layer copies of tensors the main model already has.
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def _error(message: str) -> Exception:
  return HFLoadError(message)


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
  key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
  params = field(hf, key, dict, {})
  rope = lambda name, kind, default=None: field(params, name, kind, default, where=f"{key}.")
  theta = rope("rope_theta", float)
  theta = field(hf, "rope_theta", float, 10000.0) if theta is None else theta
  rope_type = rope("rope_type", str) or rope("type", str, "default")
  if rope_type == "default":
    return theta, None
  try:
    if rope_type == "linear":
      return theta, RopeScaling(type="linear", factor=rope("factor", float, REQUIRED))
    if rope_type == "yarn":
      old_len = rope("original_max_position_embeddings", int, REQUIRED)
      if old_len <= 0:
        raise _error(
          f"config.json field '{key}.original_max_position_embeddings'={old_len} must be > 0"
        )
      factor = rope("factor", float)
      if factor is None:  # DeepSeek's convention: the context extension ratio
        factor = field(hf, "max_position_embeddings", int) / old_len
      return theta, RopeScaling(
        type="yarn",
        factor=float(factor),
        original_max_position_embeddings=old_len,
        beta_fast=rope("beta_fast", float) or 32.0,
        beta_slow=rope("beta_slow", float) or 1.0,
        mscale=rope("mscale", float) or 0.0,
        mscale_all_dim=rope("mscale_all_dim", float) or 0.0,
        attention_factor=rope("attention_factor", float),
        truncate=rope("truncate", bool, True),
      )
  except ConfigError as e:
    raise _error(f"config.json's rope scaling maps to an invalid model config: {e}") from e
  raise _error(
    f"deepseek_v3 rope scaling type {rope_type!r} is not supported; supported: default, linear, "
    "yarn"
  )


def n_mtp_layers(hf: Mapping[str, Any]) -> int:
  key = "num_nextn_predict_layers" if "num_nextn_predict_layers" in hf else "num_mtp_layers"
  return field(hf, key, int, 0)


def config_from_hf(
  hf: Mapping[str, Any], *, dtype: str = "float32", mtp_layers: int = 0
) -> ModelConfig:
  """A ModelConfig with `mla` (and `mtp` when `mtp_layers` > 0) for a deepseek_v3 config.json."""
  if hf.get("model_type") not in MODEL_TYPES:
    raise _error(f"model_type={hf.get('model_type')!r} is not one of {MODEL_TYPES}")
  n_layers = field(hf, "num_hidden_layers", int)
  dense = field(hf, "first_k_dense_replace", int, None)
  n_experts = field(hf, "n_routed_experts", int, None)
  if n_experts and (dense is None or dense < n_layers):
    raise _error(
      f"deepseek_v3 with first_k_dense_replace={dense} < num_hidden_layers={n_layers} has "
      f"mixture-of-experts layers (n_routed_experts={n_experts}), which are not "
      "supported; only dense layers (first_k_dense_replace >= num_hidden_layers)"
    )
  hidden_act = field(hf, "hidden_act", str, "silu")
  if hidden_act != "silu":
    raise _error(f"hidden_act={hidden_act!r} is not supported; only 'silu' (SwiGLU)")
  if field(hf, "attention_bias", bool, False):
    raise _error("deepseek_v3 with attention_bias=true is not supported")
  n_heads = field(hf, "num_attention_heads", int)
  n_kv_heads = field(hf, "num_key_value_heads", int, n_heads)
  if n_kv_heads != n_heads:
    raise _error(
      f"deepseek_v3 with num_key_value_heads={n_kv_heads} != "
      f"num_attention_heads={n_heads} is not supported (MLA decompresses every head)"
    )
  theta, scaling = _rope_from_hf(hf)
  try:
    return ModelConfig(
      vocab_size=field(hf, "vocab_size", int),
      d_model=field(hf, "hidden_size", int),
      n_layers=n_layers,
      n_heads=n_heads,
      n_kv_heads=n_heads,
      ffn_dim=field(hf, "intermediate_size", int),
      max_seq_len=field(hf, "max_position_embeddings", int, 4096),
      rope_theta=theta,
      rope_scaling=scaling,
      norm_eps=field(hf, "rms_norm_eps", float, 1e-6),
      tie_embeddings=field(hf, "tie_word_embeddings", bool, False),
      dtype=dtype,
      param_dtype=dtype,
      mla=MLAConfig(
        kv_lora_rank=field(hf, "kv_lora_rank", int),
        qk_rope_head_dim=field(hf, "qk_rope_head_dim", int),
        qk_nope_head_dim=field(hf, "qk_nope_head_dim", int),
        v_head_dim=field(hf, "v_head_dim", int),
        q_lora_rank=field(hf, "q_lora_rank", int, None),
      ),
      mtp=MTPConfig(kind="sequential", n_predict=mtp_layers) if mtp_layers else None,
    )
  except ConfigError as e:
    raise _error(f"config.json maps to an invalid model config: {e}") from e


def _shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
  """Every tensor's shape in torch's layout, with what each dimension is in config.json."""
  m = cfg.mla
  D, N, F, V = cfg.d_model, cfg.n_heads, cfg.ffn_dim, cfg.vocab_size
  C, R, Hn, Hv = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
  A = m.q_lora_rank
  L, J = cfg.n_layers, 0 if cfg.mtp is None else cfg.mtp.n_predict
  d, f, nq = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads * (qk_nope + qk_rope_head_dim)",
  )
  per_layer = {
    "input_layernorm.weight": ((D,), d),
    "self_attn.kv_a_proj_with_mqa.weight": ((C + R, D), f"kv_lora_rank + qk_rope_head_dim, {d}"),
    "self_attn.kv_a_layernorm.weight": ((C,), "kv_lora_rank"),
    "self_attn.kv_b_proj.weight": (
      (N * (Hn + Hv), C),
      "num_attention_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank",
    ),
    "self_attn.o_proj.weight": ((D, N * Hv), f"{d}, num_attention_heads * v_head_dim"),
    "post_attention_layernorm.weight": ((D,), d),
    "mlp.gate_proj.weight": ((F, D), f"{f}, {d}"),
    "mlp.up_proj.weight": ((F, D), f"{f}, {d}"),
    "mlp.down_proj.weight": ((D, F), f"{d}, {f}"),
  }
  if A is None:
    per_layer["self_attn.q_proj.weight"] = ((N * (Hn + R), D), f"{nq}, {d}")
  else:
    per_layer["self_attn.q_a_proj.weight"] = ((A, D), f"q_lora_rank, {d}")
    per_layer["self_attn.q_a_layernorm.weight"] = ((A,), "q_lora_rank")
    per_layer["self_attn.q_b_proj.weight"] = ((N * (Hn + R), A), f"{nq}, q_lora_rank")
  mtp = {
    "enorm.weight": ((D,), d),
    "hnorm.weight": ((D,), d),
    "eh_proj.weight": ((D, 2 * D), f"{d}, 2 * {d}"),
    "shared_head.norm.weight": ((D,), d),
  }
  shapes = {
    "model.embed_tokens.weight": ((V, D), f"vocab_size, {d}"),
    "model.norm.weight": ((D,), d),
  }
  if not cfg.tie_embeddings:
    shapes["lm_head.weight"] = ((V, D), f"vocab_size, {d}")
  for i in range(L + J):
    shapes.update({f"model.layers.{i}.{n}": v for n, v in per_layer.items()})
  for j in range(J):
    shapes.update({f"model.layers.{L + j}.{n}": v for n, v in mtp.items()})
  return shapes


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
  shapes = _shapes(cfg)
  expected = list(shapes)
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

  check_tensor_shapes(tensors, shapes)

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
  check_shapes(params, cfg)
  return params


def config_for_tensors(
  hf_config: Mapping[str, Any], names: set[str], *, dtype: str = "float32"
) -> ModelConfig:
  """The config of a checkpoint whose tensors are `names`: MTP heads for the MTP modules it
  actually stores (transformers' save_pretrained drops them, so a config may announce
  num_nextn_predict_layers without the weights)."""
  L = config_from_hf(hf_config, dtype=dtype).n_layers
  stored = 0
  while any(n.startswith(f"model.layers.{L + stored}.") for n in names):
    stored += 1
  announced = n_mtp_layers(hf_config)
  if stored > announced:
    raise _error(
      f"the checkpoint holds {stored} layers past num_hidden_layers={L} but "
      f"num_nextn_predict_layers={announced}"
    )
  return config_from_hf(hf_config, dtype=dtype, mtp_layers=stored)


def load(
  folder: str | Path,
  hf_config: Mapping[str, Any],
  *,
  dtype: str = "float32",
  implementation: str | None = None,
) -> Transformer:
  """Loads a deepseek_v3 folder; called by `atlas_jax.hf.load` (which reads config.json)."""
  config_from_hf(hf_config, dtype=dtype)  # reject unsupported configs before reading weights
  tensors = read_safetensors(folder)
  cfg = config_for_tensors(hf_config, set(tensors), dtype=dtype)
  interleaved = field(hf_config, "rope_interleave", bool, True)
  params = params_from_hf(tensors, cfg, interleaved=interleaved)
  return build_model(cfg, params, implementation=implementation)
