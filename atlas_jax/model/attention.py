"""Grouped-query self-attention (MHA when K == N, GQA when N is a multiple of K, MQA when K == 1).

K and V keep their K heads all the way into the attention kernel, which maps each query head to its
kv head; repeated K/V are never materialised.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax import kernels
from atlas_jax.cache.contiguous import write_layer
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
    cache: tuple[Array, Array, Array] | None = None,
  ) -> tuple[Array, tuple[Array, Array] | None]:
    """Self-attention over x, or over the cache after writing x's K/V into it.

    Args:
      x_BTD: [B, T, D] activations.
      positions_BT: i32[B, T] absolute positions (RoPE and the causal mask).
      segment_ids_BT: i32[B, T] packed-document ids; attention stays inside a document.
      cache: (k [B, S, K, H], v [B, S, K, H], lengths i32[B]) for this layer; the new tokens are
        written at offsets `lengths` and attend to everything before them.

    Returns:
      [B, T, D] and the updated (k, v) cache of this layer (None without a cache).
    """
    dtype = x_BTD.dtype
    q_BTNH = jnp.einsum("BTD,DNH->BTNH", x_BTD, self.wq[...].astype(dtype))
    k_BTKH = jnp.einsum("BTD,DKH->BTKH", x_BTD, self.wk[...].astype(dtype))
    v_BTKH = jnp.einsum("BTD,DKH->BTKH", x_BTD, self.wv[...].astype(dtype))
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
    out_BTD = jnp.einsum("BTNH,NHD->BTD", out_BTNH, self.wo[...].astype(dtype))
    return out_BTD, new_cache
