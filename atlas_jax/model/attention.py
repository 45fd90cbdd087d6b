"""Grouped-query self-attention (MHA when K == N, GQA when N is a multiple of K, MQA when K == 1).

K and V keep their K heads all the way into the attention kernel, which maps each query head to its
kv head; repeated K/V are never materialised. With a cache (`atlas_jax.cache.protocol`), the new
tokens' K/V are written into it and the queries attend over everything it holds, whatever its
kind (contiguous or paged).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from atlas_jax import kernels
from atlas_jax.cache.contiguous import KVCache
from atlas_jax.cache.paged import KVPool
from atlas_jax.cache.protocol import LayerCache
from atlas_jax.config import ModelConfig
from atlas_jax.model import context_parallel
from atlas_jax.model.layers import (
  PLAIN,
  Ops,
  RMSNorm,
  dense,
  normal,
  output_projection,
  param,
  rms_norm,
)
from atlas_jax.model.lora import Adapters, adapter, plus
from atlas_jax.model.rope import Rope

Array = jax.Array


class Attention(nnx.Module):
  def __init__(
    self,
    cfg: ModelConfig,
    *,
    rngs: nnx.Rngs,
    implementation: str | None = None,
    adapters: Adapters | None = None,
    ops: Ops = PLAIN,
  ):
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    self.ops = ops  # static
    pdt = jnp.dtype(cfg.param_dtype)
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
    self.wq = param(
      normal(rngs, (D, N, H), std, pdt), ("embed", "q_heads", "head_dim")
    )  # [D, N, H]
    self.wk = param(
      normal(rngs, (D, K, H), std, pdt), ("embed", "kv_heads", "head_dim")
    )  # [D, K, H]
    self.wv = param(
      normal(rngs, (D, K, H), std, pdt), ("embed", "kv_heads", "head_dim")
    )  # [D, K, H]
    self.wo = param(normal(rngs, (N, H, D), out_std, pdt), ("q_heads", "head_dim", "embed"))
    if cfg.qkv_bias:
      # Biases are not decayed, like norm scales.
      self.bq = param(jnp.zeros((N, H), pdt), ("q_heads", "head_dim"), decay=False)  # [N, H]
      self.bk = param(jnp.zeros((K, H), pdt), ("kv_heads", "head_dim"), decay=False)  # [K, H]
      self.bv = param(jnp.zeros((K, H), pdt), ("kv_heads", "head_dim"), decay=False)  # [K, H]
    else:
      self.bq = self.bk = self.bv = None
    self.bo = (  # [D]
      param(jnp.zeros((D,), pdt), ("embed",), decay=False) if cfg.attn_out_bias else None
    )
    # One logit per query head, joining its softmax denominator (the kernels' `sinks=`); kept in
    # float32 like the kernels' scores.
    self.sinks = (  # [N]
      param(jnp.zeros((N,), jnp.float32), ("q_heads",), decay=False)
      if cfg.attention_sinks
      else None
    )
    self.qk_norm_scope = cfg.qk_norm_scope  # static
    if cfg.qk_norm and cfg.qk_norm_scope == "all_heads":
      # OLMoE: one RMSNorm over all heads of q (of k), a scale per head and dim.
      ones = lambda n, axis: param(jnp.ones((n, H), pdt), (axis, "head_dim"), decay=False)
      self.q_norm, self.k_norm = ones(N, "q_heads"), ones(K, "kv_heads")  # [N, H], [K, H]
    elif cfg.qk_norm:
      self.q_norm = RMSNorm(H, eps=cfg.norm_eps, axis="head_dim", param_dtype=pdt)
      self.k_norm = RMSNorm(H, eps=cfg.norm_eps, axis="head_dim", param_dtype=pdt)
    else:
      self.q_norm = self.k_norm = None
    self.norm_eps = cfg.norm_eps
    # LoRA adapters (None where not adapted): x -> [N, H] / [K, H], and [N, H] -> D.
    self.wq_lora = adapter(adapters, "q_proj", self.wq, 1, rngs=rngs)
    self.wk_lora = adapter(adapters, "k_proj", self.wk, 1, rngs=rngs)
    self.wv_lora = adapter(adapters, "v_proj", self.wv, 1, rngs=rngs)
    self.wo_lora = adapter(adapters, "o_proj", self.wo, 2, rngs=rngs)
    # Static. Each layer's kind (`ModelConfig.attention_kinds`) is data the layer reads, so the
    # layers stay one scan; a kind picks its RoPE and its mask (window, chunk) by
    # `jax.lax.switch` among the distinct ones (one branch runs), each branch static: a window or
    # a chunk skips the kernel's tiles outside it, exactly as a model with one kind does.
    # `windows` holds (sliding_window, attention_chunk) pairs.
    self.ropes, self.windows = _branches(cfg)
    self.scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar**-0.5
    self.soft_cap = cfg.attn_logit_softcapping
    self.implementation = implementation

  # The caches this attention reads: K and V, K heads of H dims each, per token and layer.
  cache_type, pool_type = KVCache, KVPool

  @staticmethod
  def cache_dims(cfg: ModelConfig) -> dict[str, int]:
    return dict(n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim)

  def __call__(
    self,
    x_BTD: Array,
    positions_BT: Array,
    *,
    segment_ids_BT: Array | None = None,
    cache: LayerCache | None = None,
    kind: Array | None = None,
  ) -> tuple[Array, LayerCache | None]:
    """Self-attention over x, or over the cache after writing x's K/V into it.

    Args:
      x_BTD: [B, T, D] activations.
      positions_BT: i32[B, T] absolute positions (RoPE and the causal mask).
      segment_ids_BT: i32[B, T] packed-document ids; attention stays inside a document.
      cache: this layer's view of a cache; the new tokens are written at their positions and
        attend to everything held before them.
      kind: i32[2] this layer's (RoPE, window) among `self.ropes` and `self.windows`
        (`layer_kinds`), or the same as a tuple of ints where the layer is unrolled; None when
        the model has one of each.

    Returns:
      [B, T, D] and the updated layer cache (None without).
    """
    dtype = x_BTD.dtype
    # Named so remat policies can keep matmul outputs and recompute the cheap elementwise rest.
    q_BTNH = checkpoint_name(
      plus(dense(x_BTD, self.wq[...].astype(dtype), 1, self.ops), self.wq_lora, x_BTD),
      "q_proj",
    )
    k_BTKH = checkpoint_name(
      plus(dense(x_BTD, self.wk[...].astype(dtype), 1, self.ops), self.wk_lora, x_BTD),
      "k_proj",
    )
    v_BTKH = checkpoint_name(
      plus(dense(x_BTD, self.wv[...].astype(dtype), 1, self.ops), self.wv_lora, x_BTD),
      "v_proj",
    )
    if self.bq is not None:
      q_BTNH += self.bq[...].astype(dtype)
      k_BTKH += self.bk[...].astype(dtype)
      v_BTKH += self.bv[...].astype(dtype)
    if self.q_norm is not None and self.qk_norm_scope == "all_heads":
      q_BTNH = _norm_all_heads(q_BTNH, self.q_norm[...], self.norm_eps)
      k_BTKH = _norm_all_heads(k_BTKH, self.k_norm[...], self.norm_eps)
    elif self.q_norm is not None:
      q_BTNH = rms_norm(q_BTNH, self.q_norm.scale[...], self.q_norm.eps)
      k_BTKH = rms_norm(k_BTKH, self.k_norm.scale[...], self.k_norm.eps)
    q_BTNH, k_BTKH = _switch(
      kind,
      0,
      [functools.partial(self._rotate, rope=r) for r in self.ropes],
      q_BTNH,
      k_BTKH,
      positions_BT,
    )

    if cache is None:
      # The causal mask follows the index in the row; packed documents restart their RoPE
      # positions, and the segment ids keep them apart.
      # Named, so a step's profile (`bench/step_profile.py`) can tell attention's own
      # work (scores, softmax, weighted sum) from the projections around it.
      with jax.named_scope("attention_core"):
        out_BTNH = _switch(
          kind,
          1,
          [functools.partial(self._attend, sliding_window=w, chunk=c) for w, c in self.windows],
          q_BTNH,
          k_BTKH,
          v_BTKH,
          segment_ids_BT,
        )
    else:
      with jax.named_scope("kv_cache_write"):
        cache = cache.write(positions_BT, k_BTKH, v_BTKH)
      with jax.named_scope("attention_core"):
        # The cache goes into the branches as an operand they only read.
        out_BTNH = _switch(
          kind,
          1,
          [
            functools.partial(self._attend_cache, sliding_window=w, chunk=c)
            for w, c in self.windows
          ],
          q_BTNH,
          positions_BT,
          cache,
        )
    out_BTNH = checkpoint_name(out_BTNH, "attn_out")
    out_BTD = checkpoint_name(
      plus(
        output_projection(
          out_BTNH, self.wo[...].astype(dtype), serving=cache is not None, ops=self.ops
        ),
        self.wo_lora,
        out_BTNH,
      ),
      "o_proj",
    )
    if self.bo is not None:
      out_BTD += self.bo[...].astype(dtype)
    return out_BTD, cache

  def _rotate(self, q_BTNH, k_BTKH, positions_BT, *, rope):
    if rope.theta is None:  # a layer without RoPE (SmolLM3)
      return q_BTNH, k_BTKH
    by_product = self.ops.rope_tables_by_product
    return rope(q_BTNH, positions_BT, by_product=by_product), rope(
      k_BTKH, positions_BT, by_product=by_product
    )

  def _options(self) -> dict:
    """The kernels' scoring options this attention sets (none for a Llama): scale, soft-cap,
    and the sinks f32[N], which the kernels add to each query's softmax denominator as
    exp(sink) (transformers' gpt-oss concatenates them to the scores as one more column)."""
    out = {} if self.scale is None else {"scale": self.scale}
    if self.sinks is not None:
      out["sinks"] = self.sinks[...].astype(jnp.float32)
    return out if self.soft_cap is None else {**out, "soft_cap": self.soft_cap}

  def _attend(self, q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, *, sliding_window, chunk):
    context_mode = context_parallel.active()
    if context_mode is not None:  # a striped sequence split over the mesh's `context`
      return context_parallel.context_attention(
        q_BTNH,
        k_BTKH,
        v_BTKH,
        segment_ids_BT=segment_ids_BT,
        sliding_window=sliding_window,
        implementation=self.implementation,
        mode=context_mode,
        **self._options(),
        **_chunk(chunk),
      )
    return kernels.attention(
      q_BTNH,
      k_BTKH,
      v_BTKH,
      causal=True,
      q_segment_ids=segment_ids_BT,
      kv_segment_ids=segment_ids_BT,
      sliding_window=sliding_window,
      implementation=self.implementation,
      **self._options(),
      **_chunk(chunk),
    )

  def _attend_cache(self, q_BTNH, positions_BT, cache, *, sliding_window, chunk):
    return cache.attend(
      q_BTNH,
      positions_BT,
      sliding_window=sliding_window,
      implementation=self.implementation,
      **self._options(),
      **_chunk(chunk),
    )


def _chunk(chunk: int | None) -> dict:
  """The chunk option of a chunked layer's attention; none for the others, so caches and kernels
  that take no chunks are called as before."""
  return {} if chunk is None else {"attention_chunk": chunk}


def _distinct(items: list) -> tuple:
  return tuple(dict.fromkeys(items))


def _switch(kind: Array | tuple | None, which: int, branches: list, *operands):
  """`branches[kind[which]](*operands)`: the only branch when there is one; the one a static
  kind names (a tuple: a layer the program holds on its own, unrolled); else the one this
  layer's kind picks in the scan (`jax.lax.switch` runs that branch alone)."""
  if len(branches) == 1:
    return branches[0](*operands)
  if kind is None:
    raise ValueError(f"attention: this model has {len(branches)} kinds of layer; pass kind=")
  if isinstance(kind, tuple):
    return branches[kind[which]](*operands)
  return jax.lax.switch(kind[which], branches, *operands)


def _rope_of(cfg: ModelConfig, kind) -> Rope:
  return Rope(cfg.head_dim, kind.rope_theta, kind.rope_scaling, cfg.rotary_dim)


def _branches(cfg: ModelConfig) -> tuple[tuple[Rope, ...], tuple[int | None, ...]]:
  """The distinct RoPEs and masks (sliding_window, attention_chunk) of the model's attention
  kinds, in first-use order: the branches an attention switches among."""
  kinds, _ = cfg.attention_kinds()
  return _distinct([_rope_of(cfg, k) for k in kinds]), _distinct([_mask_of(k) for k in kinds])


def _mask_of(kind) -> tuple[int | None, int | None]:
  return kind.sliding_window, kind.attention_chunk


def layer_kinds(cfg: ModelConfig) -> np.ndarray:
  """i32[L, 2]: each layer's (RoPE, mask) index into its attention's `ropes` and `windows`."""
  kinds, index_L = cfg.attention_kinds()
  ropes, windows = _branches(cfg)
  slots = [(ropes.index(_rope_of(cfg, k)), windows.index(_mask_of(k))) for k in kinds]
  return np.array([slots[i] for i in index_L], np.int32).reshape(cfg.n_layers, 2)


def _norm_all_heads(x_BT__: Array, scale__: Array, eps: float) -> Array:
  """RMSNorm over the last two axes together ([B, T, heads, H] with a [heads, H] scale)."""
  B, T, n, H = x_BT__.shape
  return rms_norm(x_BT__.reshape(B, T, n * H), scale__.reshape(n * H), eps).reshape(B, T, n, H)
