"""Every parameter a config builds, with its shape and logical axes, from the config alone.

`inventory(cfg)` lists the parameters `atlas_jax.model.build` creates (stacked layers carry a
leading [L] axis, multi-token-prediction heads a leading [J] axis), each with the logical axis
names that sharding rules map onto mesh axes. Counting, sharding and FLOP figures all start here.

Logical axes are the ones the model declares on each parameter (`atlas_jax.model.layers.param`):
vocab, embed (D), q_heads (N), kv_heads (K), head_dim, mlp (F), q_lora (Q), kv_lora (C; also the
C + R latent projection's output), mtp_in (2D, the MTP projection's input), and the stacking
axis layers (L, or J for the MTP heads). `tests/plan` checks them against the real ones.
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

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def is_norm(self) -> bool:
    return self.path.endswith("/scale")


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
    if cfg.qk_norm:
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


def block(cfg: ModelConfig) -> list[ParamSpec]:
  """One transformer block's parameters (no leading layer axis)."""
  D, F = cfg.d_model, cfg.ffn_dim
  attn = [dataclasses.replace(p, path=f"attn/{p.path}") for p in _attention(cfg)]
  return [
    ParamSpec("attn_norm/scale", (D,), ("embed",)),
    *attn,
    ParamSpec("mlp_norm/scale", (D,), ("embed",)),
    ParamSpec("mlp/w_gate", (D, F), ("embed", "mlp")),
    ParamSpec("mlp/w_up", (D, F), ("embed", "mlp")),
    ParamSpec("mlp/w_down", (F, D), ("mlp", "embed")),
  ]


def _stack(prefix: str, axis: str, n: int, specs: list[ParamSpec]) -> list[ParamSpec]:
  return [ParamSpec(f"{prefix}/{p.path}", (n, *p.shape), (axis, *p.axes)) for p in specs]


def mtp_head(cfg: ModelConfig) -> list[ParamSpec]:
  """One multi-token-prediction head's parameters (no leading [J] axis)."""
  D = cfg.d_model
  inner = [dataclasses.replace(p, path=f"block/{p.path}") for p in block(cfg)]
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
  specs += _stack("blocks", "layers", cfg.n_layers, block(cfg))
  specs.append(ParamSpec("final_norm/scale", (D,), ("embed",)))
  if not cfg.tie_embeddings:
    specs.append(ParamSpec("lm_head", (D, V), ("embed", "vocab")))
  if cfg.mtp is not None:
    specs += _stack("mtp/heads", "layers", cfg.mtp.n_predict, mtp_head(cfg))
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


def lora_adapters(cfg: ModelConfig, rank: int, targets: frozenset[str]) -> list[ParamSpec]:
  """The adapters of every adapted projection of every block (the trunk's and the MTP heads'),
  for resolved target names (`atlas_jax.model.lora.resolve`)."""
  weights = {p.path: p for p in block(cfg)}
  one = []
  for target in sorted(targets):
    for path, n_in in _LORA_WEIGHTS[target]:
      w = weights[path]
      one += [
        ParamSpec(f"{path}_lora/a", (*w.shape[:n_in], rank), (*w.axes[:n_in], "lora")),
        ParamSpec(f"{path}_lora/b", (rank, *w.shape[n_in:]), ("lora", *w.axes[n_in:])),
      ]
  specs = _stack("blocks", "layers", cfg.n_layers, one)
  if cfg.mtp is not None:
    inner = [dataclasses.replace(p, path=f"block/{p.path}") for p in one]
    specs += _stack("mtp/heads", "layers", cfg.mtp.n_predict, inner)
  return specs


@dataclasses.dataclass(frozen=True)
class ParamCounts:
  total: int  # everything the model holds
  embed: int  # the input embedding table (a gather, no matmul)
  lm_head: int  # the output projection (the embedding table itself when tied)
  tied: bool  # the embedding table doubles as the output head
  blocks: int  # the L transformer blocks
  per_layer: int  # one block
  mtp: int  # multi-token-prediction heads (training only; 0 without)
  norms: int  # RMSNorm scales (elementwise, no matmul)

  @property
  def inference(self) -> int:
    """What plain decoding uses: everything but the MTP heads."""
    return self.total - self.mtp

  @property
  def matmul(self) -> int:
    """Parameters in the trunk's matmuls: all but the embedding gather and the MTP heads.

    With tied embeddings the table is the output head, so it counts once. (RMSNorm scales are
    elementwise but stay in, as in the PaLM count: they are a few parts per million.)
    """
    return self.inference - (0 if self.tied else self.embed)


def counts(cfg: ModelConfig) -> ParamCounts:
  specs = inventory(cfg)
  group = lambda prefix: sum(p.size for p in specs if p.path.startswith(prefix))
  V, D = cfg.vocab_size, cfg.d_model
  blocks = group("blocks/")
  return ParamCounts(
    total=sum(p.size for p in specs),
    embed=V * D,
    lm_head=V * D,
    tied=cfg.tie_embeddings,
    blocks=blocks,
    per_layer=blocks // cfg.n_layers,
    mtp=group("mtp/"),
    norms=sum(p.size for p in specs if p.is_norm and not p.path.startswith("mtp/")),
  )
