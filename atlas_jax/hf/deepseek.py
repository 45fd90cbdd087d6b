"""DeepSeek-V2 and DeepSeek-V3 (model types "deepseek_v2", "deepseek_v3"): Multi-head Latent
Attention, dense first layers (`first_k_dense_replace`) then mixture-of-experts layers with shared
experts, and V3's multi-token-prediction modules.

* Routing. V2: softmax scores, `greedy` or `group_limited_greedy` top-k, weights times
  `routed_scaling_factor`, never renormalised (transformers ignores V2's `norm_topk_prob`, so a
  config that sets it is refused). V3: sigmoid scores, `noaux_tc` (the selection bias
  `e_score_correction_bias`, groups ranked by their two best biased scores), weights renormalised
  when `norm_topk_prob`, times `routed_scaling_factor`.
* DeepSeek's checkpoints lay the rope dims of q and k_rope out as interleaved pairs (V2 always; V3
  unless `rope_interleave` is false). We permute those output rows of q_proj / q_b_proj and
  kv_a_proj_with_mqa to the rotate-half layout at import, and back at export; q and k are
  permuted alike, so every score is unchanged and the model runs one RoPE convention.
* kv_b_proj [N * (Hn + Hv), C] splits into W_UK [C, N, Hn] and W_UV [C, N, Hv].
* MTP modules (V3's num_nextn_predict_layers, stored as layers num_hidden_layers ..) load into the
  sequential MTP heads when their tensors are present (transformers' `save_pretrained` drops
  them); each is a decoder layer like layer num_hidden_layers would be (an MoE layer in V3), and
  its copies of the embedding and output head (embed_tokens, shared_head.head) are shared with
  the main model and not read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from atlas_jax.config import MLAConfig, ModelConfig, MoEConfig, MTPConfig
from atlas_jax.hf.common import (
  HFLoadError,
  base_fields,
  base_to_hf,
  export_error,
  field,
  model_config,
  moe_config,
  require,
)
from atlas_jax.hf.weights import (
  ExpertNames,
  Group,
  Spec,
  Weights,
  experts,
  linear,
  model_group,
  norm,
  out_proj,
  swiglu,
  trunk_groups,
  uses_fused_experts,
  weight,
)

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
NAMES = ExpertNames()
# Per-MTP-layer copies of tensors the main model already has.
MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def n_mtp_layers(hf: Mapping[str, Any]) -> int:
  key = "num_nextn_predict_layers" if "num_nextn_predict_layers" in hf else "num_mtp_layers"
  return field(hf, key, int, 0)


def stored_mtp_layers(hf: Mapping[str, Any], names: set[str]) -> int:
  """MTP modules actually stored (a config may announce them without the weights)."""
  L = field(hf, "num_hidden_layers", int)
  stored = 0
  while any(n.startswith(f"model.layers.{L + stored}.") for n in names):
    stored += 1
  # DeepSeek-V2 announces none; V3 and GLM-4.5 (glm4_moe) in num_nextn_predict_layers.
  announced = n_mtp_layers(hf) if hf.get("model_type") != "deepseek_v2" else 0
  if stored > announced:
    raise HFLoadError(
      f"the checkpoint holds {stored} layers past num_hidden_layers={L} but "
      f"num_nextn_predict_layers={announced}"
    )
  return stored


def config_from_hf(
  hf: Mapping[str, Any], *, dtype: str = "float32", names: set[str] | None = None
) -> ModelConfig:
  """A ModelConfig with `mla`, `moe` where any layer is MoE, and `mtp` when `names` (the stored
  tensors) hold MTP modules."""
  v3 = hf.get("model_type") == "deepseek_v3"
  if field(hf, "attention_bias", bool, False):
    raise HFLoadError(f"{hf.get('model_type')} with attention_bias=true is not supported")
  if field(hf, "mlp_bias", bool, False):
    raise HFLoadError(f"{hf.get('model_type')} with mlp_bias=true is not supported")
  fields = base_fields(hf, allowed_rope=("default", "linear", "yarn"))
  n_heads = fields["n_heads"]
  if fields["n_kv_heads"] != n_heads:
    raise HFLoadError(
      f"{hf.get('model_type')} with num_key_value_heads={fields['n_kv_heads']} != "
      f"num_attention_heads={n_heads} is not supported (MLA decompresses every head)"
    )
  L = fields["n_layers"]
  mtp = 0 if names is None else stored_mtp_layers(hf, names)
  n_experts = field(hf, "n_routed_experts", int, 0)
  dense = field(hf, "first_k_dense_replace", int, 0)
  moe = None
  if n_experts and dense < L + mtp:
    moe = moe_config(**_routing(hf, v3), n_experts=n_experts, first_k_dense=dense)
  return model_config(
    **fields,
    ffn_dim=field(hf, "intermediate_size", int),
    dtype=dtype,
    param_dtype=dtype,
    mla=MLAConfig(
      kv_lora_rank=field(hf, "kv_lora_rank", int),
      qk_rope_head_dim=field(hf, "qk_rope_head_dim", int),
      qk_nope_head_dim=field(hf, "qk_nope_head_dim", int),
      v_head_dim=field(hf, "v_head_dim", int),
      q_lora_rank=field(hf, "q_lora_rank", int, None),
    ),
    mtp=MTPConfig(kind="sequential", n_predict=mtp) if mtp else None,
    moe=moe,
  )


def _routing(hf: Mapping[str, Any], v3: bool) -> dict:
  """The MoEConfig fields of a DeepSeek router (and its shared experts)."""
  F = field(hf, "moe_intermediate_size", int)
  out = dict(
    top_k=field(hf, "num_experts_per_tok", int),
    expert_ffn_dim=F,
    routed_scaling_factor=field(hf, "routed_scaling_factor", float, 1.0),
    shared_ffn_dim=field(hf, "n_shared_experts", int, 0) * F,
  )
  if v3:
    method = field(hf, "topk_method", str, "noaux_tc")
    require(hf, "topk_method", method, "noaux_tc", "DeepSeek-V3's router")
    return dict(
      out,
      scoring="sigmoid",
      topk_method="noaux_tc",
      n_group=field(hf, "n_group", int, 1),
      topk_group=field(hf, "topk_group", int, 1),
      norm_topk_prob=field(hf, "norm_topk_prob", bool, False),
    )
  method = field(hf, "topk_method", str, "greedy")
  if method not in ("greedy", "group_limited_greedy"):
    raise HFLoadError(
      f"deepseek_v2 with topk_method={method!r} is not supported; supported: greedy, "
      "group_limited_greedy"
    )
  norm_topk = field(hf, "norm_topk_prob", bool, False)
  require(hf, "norm_topk_prob", norm_topk, False, "transformers' DeepSeek-V2 never renormalises")
  freq = field(hf, "moe_layer_freq", int, 1)
  require(hf, "moe_layer_freq", freq, 1, "transformers makes every layer past the dense ones MoE")
  groups = method == "group_limited_greedy"
  return dict(
    out,
    scoring="softmax",
    topk_method=method,
    n_group=field(hf, "n_group", int, 1) if groups else 1,
    topk_group=field(hf, "topk_group", int, 1) if groups else 1,
    norm_topk_prob=False,
  )


def _rope_order(R: int, interleaved: bool) -> np.ndarray:
  """Row order taking interleaved rope pairs (x0, x1), (x2, x3).. to rotate-half halves."""
  if not interleaved:
    return np.arange(R)
  return np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)])


def attention(cfg: ModelConfig, interleaved: bool) -> list[Weights]:
  """MLA's projections and norms (and the block's two norms)."""
  m = cfg.mla
  D, N = cfg.d_model, cfg.n_heads
  C, R, Hn, Hv, A = (
    m.kv_lora_rank,
    m.qk_rope_head_dim,
    m.qk_nope_head_dim,
    m.v_head_dim,
    m.q_lora_rank,
  )
  d = "hidden_size"
  nq = "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)"
  perm = _rope_order(R, interleaved)
  q_perm = np.concatenate([np.arange(Hn), Hn + perm])
  kv_perm = np.concatenate([np.arange(C), C + perm])
  inverse = lambda p: np.argsort(p)

  def q_out(name, inp, legend):  # [N * (Hn + R), in] <-> [in, N, Hn + R], rope rows reordered
    return weight(
      name,
      (N * (Hn + R), inp),
      f"{nq}, {legend}",
      ("attn", "wq" if name.endswith("q_proj.weight") else "wq_b"),
      lambda w: w.reshape(N, Hn + R, inp)[:, q_perm].transpose(2, 0, 1),
      lambda w: w.transpose(1, 2, 0)[:, inverse(q_perm)].reshape(N * (Hn + R), inp),
    )

  kv_b = Weights(
    ("self_attn.kv_b_proj.weight",),
    (N * (Hn + Hv), C),
    "num_attention_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank",
    lambda w: {
      ("attn", "wk_b"): w.reshape(N, Hn + Hv, C)[:, :Hn].transpose(2, 0, 1),
      ("attn", "wv_b"): w.reshape(N, Hn + Hv, C)[:, Hn:].transpose(2, 0, 1),
    },
    lambda p: (
      np.concatenate(
        [p["attn", "wk_b"].transpose(1, 2, 0), p["attn", "wv_b"].transpose(1, 2, 0)], axis=1
      ).reshape(N * (Hn + Hv), C),
    ),
  )
  out = [
    norm("input_layernorm.weight", D, d, ("attn_norm", "scale")),
    weight(
      "self_attn.kv_a_proj_with_mqa.weight",
      (C + R, D),
      f"kv_lora_rank + qk_rope_head_dim, {d}",
      ("attn", "wkv_a"),
      lambda w: w[kv_perm].T,
      lambda w: w.T[inverse(kv_perm)],
    ),
    norm("self_attn.kv_a_layernorm.weight", C, "kv_lora_rank", ("attn", "kv_norm", "scale")),
    kv_b,
    out_proj("self_attn.o_proj.weight", N, Hv, D, "num_attention_heads * v_head_dim"),
    norm("post_attention_layernorm.weight", D, d, ("mlp_norm", "scale")),
  ]
  if A is None:
    out.append(q_out("self_attn.q_proj.weight", D, d))
  else:
    out.append(linear("self_attn.q_a_proj.weight", A, D, f"q_lora_rank, {d}", ("attn", "wq_a")))
    out.append(
      norm("self_attn.q_a_layernorm.weight", A, "q_lora_rank", ("attn", "q_norm", "scale"))
    )
    out.append(q_out("self_attn.q_b_proj.weight", A, "q_lora_rank"))
  return out


def feed_forward(cfg: ModelConfig, sparse: bool, prefix: str, names) -> list[Weights]:
  D = cfg.d_model
  if not sparse:
    return swiglu("mlp", D, cfg.ffn_dim, "intermediate_size", ("mlp",))
  m = cfg.moe
  fused = uses_fused_experts(names, prefix, NAMES)
  out = experts(prefix, m.n_experts, D, m.expert_ffn_dim, names=NAMES, fused=fused)
  if m.topk_method == "noaux_tc":
    out.append(
      weight(
        "mlp.gate.e_score_correction_bias",
        (m.n_experts,),
        "n_routed_experts",
        ("mlp", "score_bias"),
      )
    )
  if m.shared_ffn_dim:
    legend = "n_shared_experts * moe_intermediate_size"
    out += swiglu("mlp.shared_experts", D, m.shared_ffn_dim, legend, ("mlp", "shared"))
  return out


def spec(cfg: ModelConfig, hf: Mapping[str, Any], names: set[str] | None = None) -> Spec:
  interleaved = hf.get("model_type") == "deepseek_v2" or field(hf, "rope_interleave", bool, True)
  return layers_spec(cfg, lambda: attention(cfg, interleaved), names)


def layers_spec(
  cfg: ModelConfig, attention_weights: Callable[[], list[Weights]], names: set[str] | None
) -> Spec:
  """The tensors of a model laid out as DeepSeek-V3's (GLM-4.5 shares it): each decoder layer's
  `attention_weights()` then its `feed_forward`, and the MTP modules past the last layer.
  `names`: the stored tensors (they tell the routed experts' layout)."""
  sparse_L = cfg.sparse_layers()

  def block(sparse: bool, prefix: str) -> list[Weights]:
    return attention_weights() + feed_forward(cfg, sparse, prefix, names)

  # transformers builds MTP layers as MoE layers whatever first_k_dense_replace says; the stored
  # ones are (their index is past it).
  sparse_mtp = cfg.moe is not None and cfg.moe.is_sparse(cfg.n_layers)
  mtp, ignored = mtp_groups(cfg, lambda prefix: block(sparse_mtp, prefix))
  trunk = trunk_groups(cfg, lambda i, prefix: tuple(block(sparse_L[i], prefix)))
  return Spec((model_group(cfg), *trunk, *mtp), ignored)


def mtp_groups(
  cfg: ModelConfig, block: Callable[[str], list[Weights]]
) -> tuple[tuple[Group, ...], frozenset[str]]:
  """The sequential MTP modules of `cfg.mtp`, stored as model.layers.{L + j} (DeepSeek-V3's
  layout, which GLM-4.5 shares): each module's norms and projection, and `block(prefix)`, its
  decoder layer's tensors; and the stored names read by nothing (the module's copies of the
  embedding and output head)."""
  L, D, d = cfg.n_layers, cfg.d_model, "hidden_size"
  J = 0 if cfg.mtp is None else cfg.mtp.n_predict
  groups = []
  for j in range(J):
    prefix = f"model.layers.{L + j}."
    head = [
      norm("enorm.weight", D, d, ("enorm", "scale")),
      norm("hnorm.weight", D, d, ("hnorm", "scale")),
      linear("eh_proj.weight", D, 2 * D, f"{d}, 2 * {d}", ("eh_proj",)),
      norm("shared_head.norm.weight", D, d, ("norm", "scale")),
    ]
    nested = [_inside("block", w) for w in block(prefix)]
    groups.append(Group(prefix, ("mtp", "heads"), j, tuple(head + nested)))
  ignored = frozenset(f"model.layers.{L + j}.{n}" for j in range(J) for n in MTP_SHARED)
  return tuple(groups), ignored


def _inside(module: str, w: Weights) -> Weights:
  """`w` for a block held as `module` of an MTP head (its paths gain that prefix)."""
  return Weights(
    w.names,
    w.shape,
    w.legend,
    lambda *ts: {(module, *k): v for k, v in w.load(*ts).items()},
    lambda p: w.save({k[1:]: v for k, v in p.items() if k[0] == module}),
  )


def model_type(cfg: ModelConfig) -> str | None:
  if cfg.mla is None:
    return None
  return "deepseek_v3" if cfg.moe is None or cfg.moe.scoring == "sigmoid" else "deepseek_v2"


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  kind, m = model_type(cfg), cfg.moe
  arch = "DeepseekV3ForCausalLM" if kind == "deepseek_v3" else "DeepseekV2ForCausalLM"
  a = cfg.mla
  out = base_to_hf(cfg, kind, arch)
  out.update(
    kv_lora_rank=a.kv_lora_rank,
    q_lora_rank=a.q_lora_rank,
    qk_rope_head_dim=a.qk_rope_head_dim,
    qk_nope_head_dim=a.qk_nope_head_dim,
    v_head_dim=a.v_head_dim,
    head_dim=a.qk_rope_head_dim,
    attention_bias=False,
    first_k_dense_replace=cfg.n_layers,
    n_routed_experts=0,
  )
  if kind == "deepseek_v3":
    out.update(rope_interleave=True, num_nextn_predict_layers=mtp_to_hf(kind, cfg))
  if m is None:
    return out
  out.update(moe_to_hf(kind, m), topk_method=m.topk_method)
  if kind == "deepseek_v3" and m.topk_method != "noaux_tc":
    raise export_error(kind, "moe.topk_method", m.topk_method, "DeepSeek-V3 routes with noaux_tc")
  if kind == "deepseek_v2" and (m.norm_topk_prob or m.topk_method == "noaux_tc"):
    raise export_error(
      kind,
      "moe.norm_topk_prob / topk_method",
      (m.norm_topk_prob, m.topk_method),
      "DeepSeek-V2: no renormalisation, greedy or group_limited_greedy",
    )
  return out


def moe_to_hf(kind: str, m: MoEConfig) -> dict[str, Any]:
  """config.json's fields for DeepSeek's mixture-of-experts layers, which GLM-4.5 (`kind`
  "glm4_moe") shares: every layer from first_k_dense_replace on is MoE, beside n_shared_experts
  ungated shared experts of moe_intermediate_size each; the router's groups and scaling."""
  if m.sparse_step != 1 or m.dense_layers or m.shared_expert_gate:
    raise export_error(
      kind,
      "moe.sparse_step / dense_layers / shared_expert_gate",
      (m.sparse_step, m.dense_layers, m.shared_expert_gate),
      "(1, (), False): the MoE layers are every layer from first_k_dense_replace on, their "
      "shared experts ungated",
    )
  if m.shared_ffn_dim % m.expert_ffn_dim:
    raise export_error(
      kind,
      "moe.shared_ffn_dim",
      m.shared_ffn_dim,
      f"a multiple of moe.expert_ffn_dim={m.expert_ffn_dim} (n_shared_experts)",
    )
  return dict(
    first_k_dense_replace=m.first_k_dense,
    n_routed_experts=m.n_experts,
    num_experts_per_tok=m.top_k,
    moe_intermediate_size=m.expert_ffn_dim,
    n_shared_experts=m.shared_ffn_dim // m.expert_ffn_dim,
    routed_scaling_factor=m.routed_scaling_factor,
    n_group=m.n_group,
    topk_group=m.topk_group,
    norm_topk_prob=m.norm_topk_prob,
  )


def mtp_to_hf(kind: str, cfg: ModelConfig) -> int:
  """config.json's num_nextn_predict_layers: the sequential MTP heads, written back as
  DeepSeek-V3's (and GLM-4.5's) MTP modules."""
  if cfg.mtp is None:
    return 0
  if cfg.mtp.kind != "sequential":
    raise export_error(kind, "mtp.kind", cfg.mtp.kind, "its MTP modules are 'sequential'")
  return cfg.mtp.n_predict
