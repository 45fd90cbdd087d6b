"""One decoder block (pre-norm attention, then the feed-forward: a SwiGLU MLP or a mixture of
experts) and the attention it uses: GQA or MLA, as the config says. The trunk's layer scan and
the MTP heads both build their blocks here."""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from atlas_jax.config import ModelConfig
from atlas_jax.model.attention import Attention
from atlas_jax.model.layers import MLP, PLAIN, Ops, RMSNorm
from atlas_jax.model.lora import Adapters
from atlas_jax.model.mla import MLA
from atlas_jax.model.moe import MoE, RouterStats


def attention_class(cfg: ModelConfig) -> type[Attention] | type[MLA]:
  """The attention module a config calls for: MLA when `cfg.mla` is set, else GQA."""
  return Attention if cfg.mla is None else MLA


class Block(nnx.Module):
  """x + attn(x), then x + ffn(x), each sublayer with its RMSNorms where the config puts them:
  on its input (`pre_norms`, Llama: x + attn(norm(x))), on its output (`post_norms`, OLMo 2:
  x + norm(attn(x))) or both (Gemma 2/3). The feed-forward is a mixture of experts when `sparse`
  (`ModelConfig.sparse_layers`), else the dense gated MLP."""

  def __init__(
    self,
    cfg: ModelConfig,
    *,
    rngs: nnx.Rngs,
    implementation: str | None = None,
    sparse: bool = False,
    adapters: Adapters | None = None,
    ops: Ops = PLAIN,
  ):
    pdt = jnp.dtype(cfg.param_dtype)
    norm = lambda on: RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt) if on else None
    self.attn_norm = norm(cfg.pre_norms)
    self.attn = attention_class(cfg)(
      cfg, rngs=rngs, implementation=implementation, adapters=adapters, ops=ops
    )
    self.attn_post_norm = norm(cfg.post_norms)
    self.mlp_norm = norm(cfg.pre_norms)
    self.mlp_post_norm = norm(cfg.post_norms)
    if sparse:  # LoRA adapts no expert: `atlas_jax.model.lora.resolve` refuses MLP targets
      self.mlp = MoE(cfg, rngs=rngs, ops=ops)
    else:
      self.mlp = MLP(
        cfg.d_model,
        cfg.ffn_dim,
        init_std=cfg.init_std,
        out_std=cfg.init_std / math.sqrt(2 * cfg.n_layers),
        rngs=rngs,
        param_dtype=pdt,
        adapters=adapters,
        ops=ops,
        activation=cfg.mlp_activation,
      )

  def __call__(
    self, x_BTD, positions_BT, *, segment_ids_BT=None, cache=None, kind=None
  ) -> tuple[jnp.ndarray, object, RouterStats | None]:
    """(x [B, T, D], the updated layer cache or None, the router's stats or None when dense).

    `kind`: the layer's attention kind (`atlas_jax.model.attention.layer_kinds`), where the
    model's layers differ."""
    h_BTD, cache = self.attn(
      _norm(self.attn_norm, x_BTD),
      positions_BT,
      segment_ids_BT=segment_ids_BT,
      cache=cache,
      kind=kind,
    )
    x_BTD = x_BTD + _norm(self.attn_post_norm, h_BTD)
    stats = None
    if isinstance(self.mlp, MoE):
      # A cached call (generation, serving) is always dropless: a token's output never depends
      # on the rest of its batch.
      h_BTD, stats = self.mlp(_norm(self.mlp_norm, x_BTD), dropless=cache is not None)
    else:
      h_BTD = self.mlp(_norm(self.mlp_norm, x_BTD))
    return x_BTD + _norm(self.mlp_post_norm, h_BTD), cache, stats


def _norm(norm: RMSNorm | None, x_BTD):
  return x_BTD if norm is None else norm(x_BTD)
