"""The decoder-only transformer (Llama, Mistral, Qwen2, Qwen3 families).

Layers are stored stacked (every block parameter has a leading [L] axis) and run with
`jax.lax.scan`, so compile time does not grow with depth.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax.cache.contiguous import KVCache
from atlas_jax.cache.paged_view import PagedKVCache, PagedLayerCache
from atlas_jax.config import ModelConfig
from atlas_jax.model.attention import Attention
from atlas_jax.model.layers import MLP, RMSNorm, normal
from atlas_jax.model.mla import MLA
from atlas_jax.training.remat import scan_blocks

Array = jax.Array


class Block(nnx.Module):
  """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); MLA when `cfg.mla` is set."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, implementation: str | None = None):
    pdt = jnp.dtype(cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt)
    attn_cls = Attention if cfg.mla is None else MLA
    self.attn = attn_cls(cfg, rngs=rngs, implementation=implementation)
    self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt)
    self.mlp = MLP(
      cfg.d_model,
      cfg.ffn_dim,
      init_std=cfg.init_std,
      out_std=cfg.init_std / math.sqrt(2 * cfg.n_layers),
      rngs=rngs,
      param_dtype=pdt,
    )

  def __call__(self, x_BTD, positions_BT, *, segment_ids_BT=None, cache=None):
    h_BTD, cache = self.attn(
      self.attn_norm(x_BTD), positions_BT, segment_ids_BT=segment_ids_BT, cache=cache
    )
    x_BTD = x_BTD + h_BTD
    x_BTD = x_BTD + self.mlp(self.mlp_norm(x_BTD))
    return x_BTD, cache


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs, implementation: str | None) -> Block:
  """One Block whose parameters carry a leading [L] axis, initialised independently per layer."""
  keys = jax.random.split(rngs.params(), cfg.n_layers)
  graphdef = nnx.graphdef(
    nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0), implementation=implementation))
  )
  state = jax.vmap(
    lambda key: nnx.state(Block(cfg, rngs=nnx.Rngs(key), implementation=implementation))
  )(keys)
  return nnx.merge(graphdef, state)


def default_positions(tokens_BT: Array, cache) -> Array:
  """i32[B, T]: 0..T-1, or continuing from each sequence's cache length."""
  B, T = tokens_BT.shape
  start_B = jnp.zeros((B,), jnp.int32) if cache is None else cache.lengths
  return start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]


def scan_kv_cache(
  graphdef, block_state, x_BTD: Array, positions_BT: Array, cache: KVCache
) -> tuple[Array, KVCache]:
  """Runs the stacked blocks over a contiguous KVCache, one layer's [B, S, K, H] slice a step."""

  def body(x_BTD, layer):
    state, k_BSKH, v_BSKH = layer
    x_BTD, (k_BSKH, v_BSKH) = nnx.merge(graphdef, state)(
      x_BTD, positions_BT, cache=(k_BSKH, v_BSKH, cache.lengths)
    )
    return x_BTD, (k_BSKH, v_BSKH)

  x_BTD, (k_LBSKH, v_LBSKH) = jax.lax.scan(body, x_BTD, (block_state, cache.k, cache.v))
  T = x_BTD.shape[1]
  return x_BTD, cache.replace(k=k_LBSKH, v=v_LBSKH, lengths=cache.lengths + T)


class Transformer(nnx.Module):
  def __init__(
    self,
    cfg: ModelConfig,
    *,
    rngs: nnx.Rngs,
    implementation: str | None = None,
    remat: str = "none",
    remat_every: int | None = None,
    unroll_layers: bool = False,
  ):
    V, D = cfg.vocab_size, cfg.d_model
    pdt = jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    # Training-time activation checkpointing (static). unroll_layers is for FLOP measurement only.
    self.remat = (remat, remat_every, unroll_layers)
    self.embed = nnx.Param(normal(rngs, (V, D), cfg.init_std, pdt))  # [V, D]
    self.blocks = _stacked_blocks(cfg, rngs, implementation)  # every parameter [L, ...]
    self.final_norm = RMSNorm(D, eps=cfg.norm_eps, param_dtype=pdt)
    self.lm_head = (
      None
      if cfg.tie_embeddings
      else nnx.Param(
        normal(rngs, (D, V), cfg.init_std, pdt)  # [D, V]
      )
    )

  def __call__(
    self,
    tokens_BT: Array,
    *,
    positions_BT: Array | None = None,
    segment_ids_BT: Array | None = None,
    cache: KVCache | PagedKVCache | None = None,
    logits_at_B: Array | None = None,
  ):
    """Next-token logits.

    Args:
      tokens_BT: i32[B, T].
      positions_BT: i32[B, T]; default 0..T-1, or continuing from `cache.lengths`.
      segment_ids_BT: i32[B, T] document ids of packed sequences (no cache).
      cache: a KVCache; the tokens are appended at each sequence's length.
        Or a PagedKVCache over the block pool; positions < 0 mark padding tokens (not written).
      logits_at_B: i32[B]; compute logits only at this index of each row (then T = 1 in the
        result): prefill needs only each prompt's last position.

    Returns:
      f32[B, T, V] logits; with a cache, (logits, cache) where cache.lengths grew by T.
    """
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    if positions_BT is None:
      positions_BT = default_positions(tokens_BT, cache)
    x_BTD = jnp.take(self.embed[...], tokens_BT, axis=0).astype(dtype)

    graphdef, block_state = nnx.split(self.blocks)

    if cache is None:

      def block_fn(x_BTD, state):
        block = nnx.merge(graphdef, state)
        return block(x_BTD, positions_BT, segment_ids_BT=segment_ids_BT)[0]

      policy, every, unroll = self.remat
      x_BTD = scan_blocks(block_fn, x_BTD, block_state, policy=policy, every=every, unroll=unroll)
      new_cache = None
    elif isinstance(cache, PagedKVCache):
      # Rows may add different numbers of tokens (chunked prefill): padding has position < 0.
      kv_lengths_B = cache.lengths + jnp.sum(positions_BT >= 0, axis=1, dtype=jnp.int32)

      def body(x_BTD, layer):
        state, k_PZKH, v_PZKH = layer
        view = PagedLayerCache(k_PZKH, v_PZKH, cache.block_table, kv_lengths_B)
        x_BTD, view = nnx.merge(graphdef, state)(x_BTD, positions_BT, cache=view)
        return x_BTD, (view.k, view.v)

      x_BTD, (k_LPZKH, v_LPZKH) = jax.lax.scan(
        body, x_BTD, (block_state, cache.pool.k, cache.pool.v)
      )
      new_cache = cache.replace(
        pool=dataclasses.replace(cache.pool, k=k_LPZKH, v=v_LPZKH), lengths=kv_lengths_B
      )
    else:
      x_BTD, new_cache = scan_kv_cache(graphdef, block_state, x_BTD, positions_BT, cache)

    if logits_at_B is not None:
      # Only the rows' chosen positions reach the head: [B, 1, V] logits, not [B, T, V].
      x_BTD = jnp.take_along_axis(x_BTD, logits_at_B[:, None, None], axis=1)
    x_BTD = self.final_norm(x_BTD)
    head_DV = self.embed[...].T if self.lm_head is None else self.lm_head[...]
    logits_BTV = jnp.einsum(
      "BTD,DV->BTV", x_BTD, head_DV.astype(dtype), preferred_element_type=jnp.float32
    )
    return logits_BTV if cache is None else (logits_BTV, new_cache)

  def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
    cfg = self.cfg
    return KVCache.init(
      n_layers=cfg.n_layers,
      batch=batch,
      max_len=max_len,
      n_kv_heads=cfg.n_kv_heads,
      head_dim=cfg.head_dim,
      dtype=jnp.dtype(cfg.dtype) if dtype is None else dtype,
    )
