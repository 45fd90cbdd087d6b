"""Every parameter a config builds, with its shape and logical axes, from the config alone.

`inventory(cfg)` lists the parameters `atlas_jax.model.build` creates (stacked layers carry a
leading [L] axis, multi-token-prediction heads a leading [J] axis), each with the logical axis
names that sharding rules map onto mesh axes. Counting, sharding and FLOP figures all start here.

Logical axes are the ones the model declares on each parameter (`atlas_jax.model.layers.param`):
vocab, embed (D), q_heads (N), kv_heads (K), head_dim, mlp (F), q_lora (A), kv_lora (C; also the
C + R latent projection's output), mtp_in (2D, the MTP projection's input), experts (E) and
expert_mlp (an expert's F), and the stacking axis layers (L, or J for the MTP heads). A model with
dense and mixture-of-experts layers stacks each kind apart (`blocks`, `dense_blocks`, as
`atlas_jax.model.transformer` does). `tests/plan` checks them against the real ones.

Mixture of experts: a token runs its k routed experts of E, so of each MoE layer's routed-expert
parameters only k / E are active per token; the router, the shared experts and everything
outside the experts are always active. `ParamCounts.active` is what one token uses, the figure
published as "active parameters" (DeepSeek-V3: 37B of 671B).
"""

from __future__ import annotations

import dataclasses
import math

from atlas_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  path: str  # "blocks/attn/wq", as in the model's state
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]  # one logical axis name per dimension
  trainable: bool = True  # False: a variable outside the gradient (DeepSeek-V3's router bias)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def is_norm(self) -> bool:
    return self.path.endswith(("/scale", "attn/q_norm", "attn/k_norm"))

  @property
  def is_routed_expert(self) -> bool:
    """One of the routed experts' weights ([.., E, ...]), of which a token uses k / E."""
    name = self.path.rsplit("/", 1)[-1]
    return "experts" in self.axes and name in (
      "w_gate",
      "w_up",
      "w_down",
      "b_gate",
      "b_up",
      "b_down",
    )


def _attention(cfg: ModelConfig) -> list[ParamSpec]:
  D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  if cfg.mla is None:
    out = [
      ParamSpec("wq", (D, N, H), ("embed", "q_heads", "head_dim")),
      ParamSpec("wk", (D, K, H), ("embed", "kv_heads", "head_dim")),
      ParamSpec("wv", (D, K, H), ("embed", "kv_heads", "head_dim")),
      ParamSpec("wo", (N, H, D), ("q_heads", "head_dim", "embed")),
    ]
    if cfg.qkv_bias:
      out += [
        ParamSpec("bq", (N, H), ("q_heads", "head_dim")),
        ParamSpec("bk", (K, H), ("kv_heads", "head_dim")),
        ParamSpec("bv", (K, H), ("kv_heads", "head_dim")),
      ]
    if cfg.attn_out_bias:
      out.append(ParamSpec("bo", (D,), ("embed",)))
    if cfg.attention_sinks:
      out.append(ParamSpec("sinks", (N,), ("q_heads",)))
    if cfg.qk_norm and cfg.qk_norm_scope == "all_heads":
      out += [
        ParamSpec("q_norm", (N, H), ("q_heads", "head_dim")),
        ParamSpec("k_norm", (K, H), ("kv_heads", "head_dim")),
      ]
    elif cfg.qk_norm:
      out += [
        ParamSpec("q_norm/scale", (H,), ("head_dim",)),
        ParamSpec("k_norm/scale", (H,), ("head_dim",)),
      ]
    return out
  m = cfg.mla
  C, R, Hn, Hv = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
  if m.q_lora_rank is None:
    out = [ParamSpec("wq", (D, N, Hn + R), ("embed", "q_heads", "head_dim"))]
  else:
    Q = m.q_lora_rank
    out = [
      ParamSpec("wq_a", (D, Q), ("embed", "q_lora")),
      ParamSpec("q_norm/scale", (Q,), ("q_lora",)),
      ParamSpec("wq_b", (Q, N, Hn + R), ("q_lora", "q_heads", "head_dim")),
    ]
  return out + [
    ParamSpec("wkv_a", (D, C + R), ("embed", "kv_lora")),
    ParamSpec("kv_norm/scale", (C,), ("kv_lora",)),
    ParamSpec("wk_b", (C, N, Hn), ("kv_lora", "q_heads", "head_dim")),
    ParamSpec("wv_b", (C, N, Hv), ("kv_lora", "q_heads", "head_dim")),
    ParamSpec("wo", (N, Hv, D), ("q_heads", "head_dim", "embed")),
  ]


def _swiglu(prefix: str, D: int, F: int) -> list[ParamSpec]:
  return [
    ParamSpec(f"{prefix}/w_gate", (D, F), ("embed", "mlp")),
    ParamSpec(f"{prefix}/w_up", (D, F), ("embed", "mlp")),
    ParamSpec(f"{prefix}/w_down", (F, D), ("mlp", "embed")),
  ]


def _experts(cfg: ModelConfig) -> list[ParamSpec]:
  """An MoE layer's router, routed experts and shared experts (`atlas_jax.model.moe.MoE`)."""
  m, D = cfg.moe, cfg.d_model
  E, F = m.n_experts, m.expert_ffn_dim
  out = [ParamSpec("mlp/router", (D, E), ("embed", "experts"))]
  if m.router_bias:
    out.append(ParamSpec("mlp/router_bias", (E,), ("experts",)))
  if m.topk_method == "noaux_tc":
    out.append(ParamSpec("mlp/score_bias", (E,), ("experts",), trainable=False))
  out += [
    ParamSpec("mlp/w_gate", (E, D, F), ("experts", "embed", "expert_mlp")),
    ParamSpec("mlp/w_up", (E, D, F), ("experts", "embed", "expert_mlp")),
    ParamSpec("mlp/w_down", (E, F, D), ("experts", "expert_mlp", "embed")),
  ]
  if m.expert_bias:
    out += [
      ParamSpec("mlp/b_gate", (E, F), ("experts", "expert_mlp")),
      ParamSpec("mlp/b_up", (E, F), ("experts", "expert_mlp")),
      ParamSpec("mlp/b_down", (E, D), ("experts", "embed")),
    ]
  if m.shared_ffn_dim:
    out += _swiglu("mlp/shared", D, m.shared_ffn_dim)
  if m.shared_expert_gate:
    out.append(ParamSpec("mlp/shared_gate", (D,), ("embed",)))
  return out


def block(cfg: ModelConfig, sparse: bool = False) -> list[ParamSpec]:
  """One transformer block's parameters (no leading layer axis); `sparse`: an MoE layer."""
  D, F = cfg.d_model, cfg.ffn_dim
  attn = [dataclasses.replace(p, path=f"attn/{p.path}") for p in _attention(cfg)]
  # The norms before each sublayer (`pre_norms`) and on its output (`post_norms`).
  norms = lambda where: (
    ([ParamSpec(f"{where}_norm/scale", (D,), ("embed",))] if cfg.pre_norms else [])
    + ([ParamSpec(f"{where}_post_norm/scale", (D,), ("embed",))] if cfg.post_norms else [])
  )
  return [
    *norms("attn"),
    *attn,
    *norms("mlp"),
    *(_experts(cfg) if sparse else _swiglu("mlp", D, F)),
  ]


def _stack(prefix: str, axis: str, n: int, specs: list[ParamSpec]) -> list[ParamSpec]:
  return [
    dataclasses.replace(p, path=f"{prefix}/{p.path}", shape=(n, *p.shape), axes=(axis, *p.axes))
    for p in specs
  ]


def mtp_head(cfg: ModelConfig) -> list[ParamSpec]:
  """One multi-token-prediction head's parameters (no leading [J] axis); its block is of the
  kind layer n_layers would be (DeepSeek-V3's is an MoE layer)."""
  D = cfg.d_model
  sparse = cfg.moe is not None and cfg.moe.is_sparse(cfg.n_layers)
  inner = [dataclasses.replace(p, path=f"block/{p.path}") for p in block(cfg, sparse)]
  norm = ParamSpec("norm/scale", (D,), ("embed",))
  if cfg.mtp.kind == "parallel":
    return [*inner, norm]
  return [
    ParamSpec("enorm/scale", (D,), ("embed",)),
    ParamSpec("hnorm/scale", (D,), ("embed",)),
    ParamSpec("eh_proj", (2 * D, D), ("mtp_in", "embed")),
    *inner,
    norm,
  ]


def inventory(cfg: ModelConfig) -> list[ParamSpec]:
  """All parameters of the model `atlas_jax.model.build(cfg)` creates."""
  V, D = cfg.vocab_size, cfg.d_model
  specs = [ParamSpec("embed", (V, D), ("vocab", "embed"))]
  sparse_L = cfg.sparse_layers()
  main = any(sparse_L)  # `blocks` holds the MoE layers when there are any
  specs += _stack("blocks", "layers", sparse_L.count(main), block(cfg, main))
  if main and not all(sparse_L):
    specs += _stack("dense_blocks", "dense_layers", sparse_L.count(False), block(cfg))
  specs.append(ParamSpec("final_norm/scale", (D,), ("embed",)))
  if not cfg.tie_embeddings:
    specs.append(ParamSpec("lm_head", (D, V), ("embed", "vocab")))
  if cfg.mtp is not None:
    specs += _stack("mtp/heads", "mtp_heads", cfg.mtp.n_predict, mtp_head(cfg))
  return specs


# LoRA targets -> the weights they adapt and how many leading dims are the input
# (`atlas_jax.model.lora`: `a` [*in, A] with the weight's input axes, `b` [A, *out]).
_LORA_WEIGHTS = {
  "q_proj": (("attn/wq", 1),),
  "k_proj": (("attn/wk", 1),),
  "v_proj": (("attn/wv", 1),),
  "o_proj": (("attn/wo", 2),),
  "q_a_proj": (("attn/wq_a", 1),),
  "q_b_proj": (("attn/wq_b", 1),),
  "kv_a_proj": (("attn/wkv_a", 1),),
  "kv_b_proj": (("attn/wk_b", 1), ("attn/wv_b", 1)),
  "gate_proj": (("mlp/w_gate", 1),),
  "up_proj": (("mlp/w_up", 1),),
  "down_proj": (("mlp/w_down", 1),),
}


_BLOCK_STACKS = ("blocks/", "dense_blocks/", "mtp/heads/block/")


def lora_adapters(cfg: ModelConfig, rank: int, targets: frozenset[str]) -> list[ParamSpec]:
  """The adapters of every adapted projection of every block stack (the trunk's and the MTP
  heads'), for resolved target names (`atlas_jax.model.lora.resolve`)."""
  wanted = {path: n_in for t in sorted(targets) for path, n_in in _LORA_WEIGHTS[t]}
  specs = []
  for w in inventory(cfg):
    stack = next((s for s in _BLOCK_STACKS if w.path.startswith(s)), None)
    if stack is None or w.path.removeprefix(stack) not in wanted or w.is_routed_expert:
      continue
    n = 1 + wanted[w.path.removeprefix(stack)]  # the stacked axis, then the weight's input dims
    L = (w.shape[0],), (w.axes[0],)
    specs += [
      ParamSpec(f"{w.path}_lora/a", (*w.shape[:n], rank), (*w.axes[:n], "lora")),
      ParamSpec(f"{w.path}_lora/b", (*L[0], rank, *w.shape[n:]), (*L[1], "lora", *w.axes[n:])),
    ]
  return specs


@dataclasses.dataclass(frozen=True)
class ParamCounts:
  total: int  # every parameter the model trains (the router biases, not trained, left out)
  embed: int  # the input embedding table (a gather, no matmul)
  lm_head: int  # the output projection (the embedding table itself when tied)
  tied: bool  # the embedding table doubles as the output head
  blocks: int  # the L transformer blocks
  per_layer: int  # one block (the mean, when dense and MoE layers differ)
  mtp: int  # multi-token-prediction heads (training only; 0 without)
  norms: int  # RMSNorm scales (elementwise, no matmul)
  experts: int = 0  # the trunk's routed-expert weights (MoE layers)
  experts_active: int = 0  # of them, what one token runs: k / E
  mtp_experts: int = 0  # the MTP heads' routed-expert weights
  mtp_experts_active: int = 0

  @property
  def inference(self) -> int:
    """What plain decoding uses: everything but the MTP heads."""
    return self.total - self.mtp

  @property
  def active(self) -> int:
    """What one token uses in plain decoding: `inference` with only k of E routed experts."""
    return self.inference - self.experts + self.experts_active

  @property
  def matmul(self) -> int:
    """Parameters in the trunk's matmuls: all but the embedding gather and the MTP heads.

    With tied embeddings the table is the output head, so it counts once. (RMSNorm scales are
    elementwise but stay in, as in the PaLM count: they are a few parts per million.)
    """
    return self.inference - (0 if self.tied else self.embed)

  @property
  def matmul_active(self) -> int:
    """`matmul` with only the routed experts a token runs: the N of 6N for MoE models."""
    return self.matmul - self.experts + self.experts_active

  @property
  def mtp_active(self) -> int:
    return self.mtp - self.mtp_experts + self.mtp_experts_active


def counts(cfg: ModelConfig) -> ParamCounts:
  specs = [p for p in inventory(cfg) if p.trainable]
  group = lambda prefix: sum(p.size for p in specs if p.path.startswith(prefix))
  routed = lambda mtp: sum(
    p.size for p in specs if p.is_routed_expert and p.path.startswith("mtp/") == mtp
  )
  share = 0 if cfg.moe is None else cfg.moe.top_k / cfg.moe.n_experts
  V, D = cfg.vocab_size, cfg.d_model
  blocks = group("blocks/") + group("dense_blocks/")
  experts, mtp_experts = routed(False), routed(True)
  return ParamCounts(
    total=sum(p.size for p in specs),
    embed=V * D,
    lm_head=V * D,
    tied=cfg.tie_embeddings,
    blocks=blocks,
    per_layer=blocks // cfg.n_layers,
    mtp=group("mtp/"),
    norms=sum(p.size for p in specs if p.is_norm and not p.path.startswith("mtp/")),
    experts=experts,
    experts_active=round(experts * share),
    mtp_experts=mtp_experts,
    mtp_experts_active=round(mtp_experts * share),
  )
