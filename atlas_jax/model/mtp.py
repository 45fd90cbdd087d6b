"""Multi-token prediction heads: extra heads that predict tokens t+2 .. t+1+J from position t.

Two published forms, chosen by `MTPConfig.kind`; both end in a per-head RMSNorm and the model's
shared output head, and both return logits [J, B, T, V] where head j (1-based) at position t
predicts token t + 1 + j:

* `parallel` (Gloeckle et al. 2024, "Better & Faster Large Language Models via Multi-token
  Prediction"): J independent transformer blocks read the shared trunk's hidden state, here the
  input to the model's last block (whose output is the ordinary next-token head), so the heads
  run side by side and the main model is unchanged.
* `sequential` (DeepSeek-V3): module j combines the previous depth's hidden state h^{j-1} (h^0:
  the main model's final, normalised hidden state) with the embedding of token t + j:
  h^j = Block(W_proj [RMSNorm(Emb(t_{t+j})); RMSNorm(h^{j-1})]). Embedding first, as in the
  released checkpoints (the paper writes the hidden state first; the order only permutes W_proj).
  Module j's tokens sit at positions t + j.

Heads are stacked on a leading [J] axis and run under `jax.lax.scan`, like the model's layers.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax.config import ModelConfig
from atlas_jax.model.block import attention_class
from atlas_jax.model.layers import RMSNorm, normal, param
from atlas_jax.model.scan import stacked

Array = jax.Array
# A block: (x [B, T, D], positions i32[B, T], segment_ids=, cache=) -> (x [B, T, D], cache,
# router stats or None); the heads keep no router stats.
BlockFactory = Callable[[nnx.Rngs], nnx.Module]


class SequentialHead(nnx.Module):
  """One DeepSeek-V3 MTP module: enorm, hnorm, eh_proj, a transformer block, its output norm."""

  def __init__(self, cfg: ModelConfig, make_block: BlockFactory, *, rngs: nnx.Rngs):
    D = cfg.d_model
    pdt = jnp.dtype(cfg.param_dtype)
    self.enorm = RMSNorm(D, eps=cfg.norm_eps, param_dtype=pdt)
    self.hnorm = RMSNorm(D, eps=cfg.norm_eps, param_dtype=pdt)
    self.eh_proj = param(
      normal(rngs, (2 * D, D), cfg.init_std, pdt), ("mtp_in", "embed")
    )  # [2D, D]
    self.block = make_block(rngs)
    self.norm = RMSNorm(D, eps=cfg.norm_eps, param_dtype=pdt)  # HF: shared_head.norm

  def __call__(self, emb_BTD, h_BTD, positions_BT, segment_ids_BT, cache=None):
    """(the module's hidden state [B, T, D] for the next depth, its normalised output, the
    updated layer cache or None)."""
    both = jnp.concatenate([self.enorm(emb_BTD), self.hnorm(h_BTD)], axis=-1)  # [B, T, 2D]
    x_BTD = both @ self.eh_proj[...].astype(both.dtype)
    x_BTD, cache, _ = self.block(x_BTD, positions_BT, segment_ids_BT=segment_ids_BT, cache=cache)
    out_BTD = self.norm(x_BTD)
    # Hugging Face's MtpModel chains the normalised output into the next depth.
    return out_BTD, out_BTD, cache


class ParallelHead(nnx.Module):
  """One Gloeckle et al. head: a transformer block on the trunk, then its own RMSNorm."""

  def __init__(self, cfg: ModelConfig, make_block: BlockFactory, *, rngs: nnx.Rngs):
    self.block = make_block(rngs)
    self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=jnp.dtype(cfg.param_dtype))

  def __call__(self, trunk_BTD, positions_BT, segment_ids_BT, cache=None):
    """(the head's normalised output [B, T, D], the updated layer cache or None)."""
    x_BTD, cache, _ = self.block(
      trunk_BTD, positions_BT, segment_ids_BT=segment_ids_BT, cache=cache
    )
    return self.norm(x_BTD), cache


class MTPHeads(nnx.Module):
  """The J extra heads of `cfg.mtp`, stacked; `__call__` returns their logits [J, B, T, V]."""

  def __init__(self, cfg: ModelConfig, make_block: BlockFactory, *, rngs: nnx.Rngs):
    self.kind = cfg.mtp.kind
    self.n_predict = cfg.mtp.n_predict
    head_cls = SequentialHead if self.kind == "sequential" else ParallelHead
    # Their own stacking axis: the heads run after the trunk, never split into pipeline stages.
    self.heads = stacked(
      lambda r: head_cls(cfg, make_block, rngs=r), self.n_predict, rngs, axis="mtp_heads"
    )

  def __call__(
    self,
    *,
    tokens_BT: Array,
    trunk_BTD: Array,
    final_BTD: Array,
    positions_BT: Array,
    segment_ids_BT: Array | None,
    embed_VD: Array,
    head_DV: Array | None,
  ) -> Array:
    """Logits f32[J, B, T, V] of the extra heads (head_DV None: their normalised hidden states
    [J, B, T, D] in the compute dtype, for a loss that applies the head itself).

    Args:
      tokens_BT: i32[B, T] the model's input tokens.
      trunk_BTD: [B, T, D] input to the model's last block (parallel heads read it).
      final_BTD: [B, T, D] the model's final normalised hidden state (h^0 of sequential heads).
      positions_BT, segment_ids_BT: as given to the model.
      embed_VD: [V, D] the shared embedding; head_DV: [D, V] the shared output head or None.
    """
    graphdef, state = nnx.split(self.heads)
    dtype = final_BTD.dtype
    head_DV = None if head_DV is None else head_DV.astype(dtype)

    def logits(x_BTD):
      if head_DV is None:
        return x_BTD
      return jnp.einsum("BTD,DV->BTV", x_BTD, head_DV, preferred_element_type=jnp.float32)

    if self.kind == "parallel":

      def body(carry, state):
        out_BTD, _ = nnx.merge(graphdef, state)(trunk_BTD, positions_BT, segment_ids_BT)
        return carry, logits(out_BTD)

      _, logits_JBTV = jax.lax.scan(body, None, state)
      return logits_JBTV

    def body(h_BTD, layer):
      state, j = layer
      # Depth j embeds token t + j; rows whose t + j runs past T wrap around and are never
      # scored (their targets do not exist), so a roll keeps the shapes static.
      emb_BTD = jnp.take(embed_VD, jnp.roll(tokens_BT, -j, axis=1), axis=0).astype(dtype)
      h_BTD, out_BTD, _ = nnx.merge(graphdef, state)(
        emb_BTD, h_BTD, positions_BT + j, segment_ids_BT
      )
      return h_BTD, logits(out_BTD)

    depths = jnp.arange(1, self.n_predict + 1, dtype=jnp.int32)
    _, logits_JBTV = jax.lax.scan(body, final_BTD, (state, depths))
    return logits_JBTV

  # -- drafting (self-speculation) ---------------------------------------------------------------

  @property
  def n_draft_heads(self) -> int:
    """Heads that draft with a cache: every head. Parallel heads draft side by side from the
    trunk, one token each; sequential heads chain (head i drafts token i + 1 from head i - 1's
    output and draft), and past the last one the first runs again on the chain's own draft, as
    vLLM drafts k > 1 tokens from DeepSeek-V3's single module."""
    return self.n_predict

  def init_cache(
    self, cfg: ModelConfig, batch: int, max_len: int, dtype, n_heads: int | None = None
  ):
    """A contiguous cache for the drafting heads' blocks: one "layer" per head, for the first
    `n_heads` (default all)."""
    attn = attention_class(cfg)
    return attn.cache_type.init(
      n_layers=self.n_draft_heads if n_heads is None else n_heads,
      batch=batch,
      max_len=max_len,
      dtype=dtype,
      **attn.cache_dims(cfg),
    )

  def init_pool(
    self, cfg: ModelConfig, n_blocks: int, block_size: int, dtype, n_heads: int | None = None
  ):
    """A paged pool for the drafting heads' blocks: one "layer" per head, for the first `n_heads`
    (default all: a server drafting k < J tokens needs only k)."""
    attn = attention_class(cfg)
    return attn.pool_type.init(
      n_layers=self.n_draft_heads if n_heads is None else n_heads,
      n_blocks=n_blocks,
      block_size=block_size,
      dtype=dtype,
      **attn.cache_dims(cfg),
    )

  def draft(
    self,
    cache,
    *,
    next_tokens_BT: Array,
    trunk_BTD: Array,
    final_BTD: Array,
    positions_BT: Array,
    at_B: Array,
    embed_VD: Array,
    head_DV: Array,
    n_heads: int | None = None,
  ):
    """Runs the drafting heads over a window of verified positions, extending their cache, and
    returns each head's logits at window index `at_B`.

    Sequential heads chain as in training: head i (0-based) at position t reads head i - 1's
    output there and the token t + 1 + i, here `next_tokens_BT` shifted by i within the window.
    Where that token lies past the window (a deeper head's last i positions) it is not known
    yet: those entries are approximate, which costs draft quality, never correctness (the
    verifier decides every token), and `MTPHeads.draft_step` rewrites the one a round drafts at.

    Args:
      cache: from `init_cache`; holds the heads' entries for every position before the window.
      next_tokens_BT: i32[B, T] the token after each window position (t + 1).
      trunk_BTD, final_BTD: the model's last-block input and final hidden state at the window.
      positions_BT: i32[B, T] the window's positions.
      at_B: i32[B] the window index of each row's last verified position.
      n_heads: run only the first n_heads (static; default every drafting head): a round that
        drafts k < J tokens need not pay for the other heads' blocks.

    Returns:
      (f32[J, B, V] logits: head j's prediction of the token j + 1 past the one after `at_B`,
      the cache grown by T; the caller rolls it back to the verified positions).
    """
    graphdef, state = nnx.split(self.heads)
    dtype = final_BTD.dtype
    head_DV = head_DV.astype(dtype)
    J = self.n_draft_heads if n_heads is None else n_heads
    if not 1 <= J <= self.n_draft_heads:
      raise ValueError(f"n_heads={n_heads} must be in [1, {self.n_draft_heads}]")
    state = jax.tree.map(lambda a: a[:J], state)
    take = lambda x_BTD: jnp.take_along_axis(x_BTD, at_B[:, None, None], axis=1)[:, 0]

    def body(carry, layer):
      storage, h_BTD = carry
      state, j = layer
      view = cache.layer(storage, j, positions_BT)
      head = nnx.merge(graphdef, state)
      if self.kind == "parallel":
        out_BTD, view = head(trunk_BTD, positions_BT, None, cache=view)
      else:
        tokens_BT = jnp.roll(next_tokens_BT, -j, axis=1)
        emb_BTD = jnp.take(embed_VD, tokens_BT, axis=0).astype(dtype)
        # Training places module i at positions t + 1 + i; RoPE sees only differences, so the
        # cache keeps the window's own positions (they also order its causal mask).
        h_BTD, out_BTD, view = head(emb_BTD, h_BTD, positions_BT, None, cache=view)
      logits_BV = jnp.einsum(
        "BD,DV->BV", take(out_BTD), head_DV, preferred_element_type=jnp.float32
      )
      return (view.storage, h_BTD), logits_BV

    layers = (state, jnp.arange(J, dtype=jnp.int32))
    (storage, _), logits_JBV = jax.lax.scan(body, (cache.layers, final_BTD), layers)
    return logits_JBV, cache.advance(storage, positions_BT)

  def draft_step(
    self,
    cache,
    *,
    head: Array,
    token_B: Array,
    h_BD: Array,
    trunk_BD: Array,
    position_B: Array,
    embed_VD: Array,
    head_DV: Array,
  ):
    """One drafting head at one position per row: a link of a round's drafting chain.

    Head `head` (i32[], traced) writes its cache entry at `position_B` and predicts from it: a
    parallel head from the trunk `trunk_BD`, a sequential one from `h_BD` (the trunk's final
    state, or the previous link's output) and the embedding of `token_B`, the token after
    `position_B` (the pending token, or the previous link's draft).

    Args:
      cache: from `init_cache` / `init_pool`, its entries before `position_B` written.
      position_B: i32[B]; -1 marks a padding row, which writes nothing.

    Returns:
      (f32[B, V] logits, [B, D] the head's output (the next link's `h_BD`), the cache).
    """
    graphdef, state = nnx.split(self.heads)
    dtype = h_BD.dtype
    module = nnx.merge(graphdef, jax.tree.map(lambda a: a[head], state))
    positions_B1 = position_B[:, None]
    cache = cache.replace(lengths=jnp.maximum(position_B, 0))
    view = cache.layer(cache.layers, head, positions_B1)
    if self.kind == "parallel":
      out_B1D, view = module(trunk_BD[:, None], positions_B1, None, cache=view)
    else:
      emb_B1D = jnp.take(embed_VD, token_B[:, None], axis=0).astype(dtype)
      _, out_B1D, view = module(emb_B1D, h_BD[:, None], positions_B1, None, cache=view)
    logits_BV = jnp.einsum(
      "BD,DV->BV", out_B1D[:, 0], head_DV.astype(dtype), preferred_element_type=jnp.float32
    )
    return logits_BV, out_B1D[:, 0], cache.advance(view.storage, positions_B1)
