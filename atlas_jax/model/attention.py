"""Grouped-query self-attention (MHA when K == N, GQA when N is a multiple of K, MQA when K == 1).

K and V keep their K heads all the way into the attention kernel, which maps each query head to its
kv head; repeated K/V are never materialised.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from atlas_jax import kernels
from atlas_jax.cache.contiguous import write_layer
from atlas_jax.cache.paged import gather_kv, slot_mapping, write_kv
from atlas_jax.cache.paged_view import PagedLayerCache
from atlas_jax.config import ModelConfig
from atlas_jax.model.layers import RMSNorm, normal, rms_norm
from atlas_jax.model.rope import apply_rope, inverse_frequencies

Array = jax.Array


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, implementation: str | None = None):
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pdt = jnp.dtype(cfg.param_dtype)
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    self.wq = nnx.Param(normal(rngs, (D, N, H), cfg.init_std, pdt))  # [D, N, H]
    self.wk = nnx.Param(normal(rngs, (D, K, H), cfg.init_std, pdt))  # [D, K, H]
    self.wv = nnx.Param(normal(rngs, (D, K, H), cfg.init_std, pdt))  # [D, K, H]
    self.wo = nnx.Param(normal(rngs, (N, H, D), out_std, pdt))  # [N, H, D]
    if cfg.qkv_bias:
      self.bq = nnx.Param(jnp.zeros((N, H), pdt))  # [N, H]
      self.bk = nnx.Param(jnp.zeros((K, H), pdt))  # [K, H]
      self.bv = nnx.Param(jnp.zeros((K, H), pdt))  # [K, H]
    else:
      self.bq = self.bk = self.bv = None
    if cfg.qk_norm:
      self.q_norm = RMSNorm(H, eps=cfg.norm_eps, param_dtype=pdt)
      self.k_norm = RMSNorm(H, eps=cfg.norm_eps, param_dtype=pdt)
    else:
      self.q_norm = self.k_norm = None
    self.rope = (H, cfg.rope_theta, cfg.rope_scaling)  # static; frequencies built at trace time
    self.sliding_window = cfg.sliding_window
    self.implementation = implementation

  def __call__(
    self,
    x_BTD: Array,
    positions_BT: Array,
    *,
    segment_ids_BT: Array | None = None,
    cache: tuple[Array, Array, Array] | PagedLayerCache | None = None,
  ) -> tuple[Array, tuple[Array, Array] | PagedLayerCache | None]:
    """Self-attention over x, or over the cache after writing x's K/V into it.

    Args:
      x_BTD: [B, T, D] activations.
      positions_BT: i32[B, T] absolute positions (RoPE and the causal mask).
      segment_ids_BT: i32[B, T] packed-document ids; attention stays inside a document.
      cache: (k [B, S, K, H], v [B, S, K, H], lengths i32[B]) for this layer; the new tokens are
        written at offsets `lengths` and attend to everything before them. Or a PagedLayerCache:
        the new tokens are written to the pool slots of their positions (negative = padding, not
        written) and attend to the sequence's pages.

    Returns:
      [B, T, D] and the updated (k, v) cache, or PagedLayerCache, of this layer (None without).
    """
    dtype = x_BTD.dtype
    # Named so remat policies can keep matmul outputs and recompute the cheap elementwise rest.
    q_BTNH = checkpoint_name(
      jnp.einsum("BTD,DNH->BTNH", x_BTD, self.wq[...].astype(dtype)), "q_proj"
    )
    k_BTKH = checkpoint_name(
      jnp.einsum("BTD,DKH->BTKH", x_BTD, self.wk[...].astype(dtype)), "k_proj"
    )
    v_BTKH = checkpoint_name(
      jnp.einsum("BTD,DKH->BTKH", x_BTD, self.wv[...].astype(dtype)), "v_proj"
    )
    if self.bq is not None:
      q_BTNH += self.bq[...].astype(dtype)
      k_BTKH += self.bk[...].astype(dtype)
      v_BTKH += self.bv[...].astype(dtype)
    if self.q_norm is not None:
      q_BTNH = rms_norm(q_BTNH, self.q_norm.scale[...], self.q_norm.eps)
      k_BTKH = rms_norm(k_BTKH, self.k_norm.scale[...], self.k_norm.eps)
    inv_freq = inverse_frequencies(*self.rope)
    q_BTNH = apply_rope(q_BTNH, positions_BT, inv_freq)
    k_BTKH = apply_rope(k_BTKH, positions_BT, inv_freq)

    if cache is None:
      # The causal mask follows the index in the row; packed documents restart their RoPE
      # positions, and the segment ids keep them apart.
      out_BTNH = kernels.attention(
        q_BTNH,
        k_BTKH,
        v_BTKH,
        causal=True,
        q_segment_ids=segment_ids_BT,
        kv_segment_ids=segment_ids_BT,
        sliding_window=self.sliding_window,
        implementation=self.implementation,
      )
      new_cache = None
    elif isinstance(cache, PagedLayerCache):
      out_BTNH, new_cache = self._paged(q_BTNH, k_BTKH, v_BTKH, positions_BT, cache)
    else:
      cache_k_BSKH, cache_v_BSKH, lengths_B = cache
      T = x_BTD.shape[1]
      cache_k_BSKH, cache_v_BSKH = write_layer(
        cache_k_BSKH, cache_v_BSKH, k_BTKH, v_BTKH, lengths_B
      )
      # Queries see the cache up to their own position; slots past lengths + T hold stale data.
      out_BTNH = kernels.attention(
        q_BTNH,
        cache_k_BSKH.astype(dtype),
        cache_v_BSKH.astype(dtype),
        causal=True,
        sliding_window=self.sliding_window,
        q_positions=positions_BT,
        kv_lengths=lengths_B + T,
        implementation=self.implementation,
      )
      new_cache = (cache_k_BSKH, cache_v_BSKH)
    out_BTNH = checkpoint_name(out_BTNH, "attn_out")
    out_BTD = checkpoint_name(
      jnp.einsum("BTNH,NHD->BTD", out_BTNH, self.wo[...].astype(dtype)), "o_proj"
    )
    return out_BTD, new_cache

  def _paged(self, q_BTNH, k_BTKH, v_BTKH, positions_BT, cache: PagedLayerCache):
    """Writes the new K/V into the pool, then attends over each sequence's pages."""
    dtype = q_BTNH.dtype
    Z = cache.k.shape[1]
    slots_BT = slot_mapping(cache.block_table, positions_BT, block_size=Z)
    pool_k_PZKH, pool_v_PZKH = write_kv(cache.k, cache.v, slots_BT, k_BTKH, v_BTKH)
    if q_BTNH.shape[1] == 1 and self.sliding_window is None:
      # Decoding: the query is the last token held (bottom-right aligned), the paged kernel's
      # contract; it reads pages in place on GPU. Padding rows have kv_lengths 0 and give zeros.
      paged_impl = self.implementation if self.implementation in ("pallas", "xla") else None
      out_BNH = kernels.paged_attention(
        q_BTNH[:, 0],
        pool_k_PZKH.astype(dtype),
        pool_v_PZKH.astype(dtype),
        cache.block_table,
        cache.kv_lengths,
        implementation=paged_impl,
      )
      out_BTNH = out_BNH[:, None]
    else:
      # Prefill chunks (rows of different lengths, right-padded): gather the pages densely and
      # mask by absolute position. Padding queries (position -1) are clamped; their rows are
      # discarded by the caller.
      k_BSKH, v_BSKH = gather_kv(pool_k_PZKH, pool_v_PZKH, cache.block_table, cache.kv_lengths)
      out_BTNH = kernels.attention(
        q_BTNH,
        k_BSKH.astype(dtype),
        v_BSKH.astype(dtype),
        causal=True,
        sliding_window=self.sliding_window,
        q_positions=jnp.maximum(positions_BT, 0),
        kv_lengths=cache.kv_lengths,
        implementation=self.implementation,
      )
    return out_BTNH, dataclasses.replace(cache, k=pool_k_PZKH, v=pool_v_PZKH)
