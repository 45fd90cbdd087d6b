"""Multi-head Latent Attention (DeepSeek-V2/V3).

Keys and values of all N heads are decompressed from one latent per token,

    c_kv = RMSNorm(x @ W_DKV)                  [C]      (kv_lora_rank)
    k_nope[n] = c_kv @ W_UK[n],  v[n] = c_kv @ W_UV[n]  [Hn], [Hv]
    k_rope = RoPE(x @ W_KR)                    [R]      shared by every head

and the query is q[n] = [q_nope[n], RoPE(q_rope[n])], optionally through its own low-rank
bottleneck (q_lora_rank). So the cache needs only c_kv and k_rope per token (C + R numbers, see
`atlas_jax.cache.contiguous.LatentCache`).

Two paths compute the same attention:

* expanded (training, prefill): reconstruct K [S, N, Hn + R] and V [S, N, Hv] and call the
  FlashAttention dispatcher `atlas_jax.kernels.attention`; V is zero-padded to the query/key head
  dim (the dispatcher takes one head dim) and the output sliced back;
* absorbed (decoding): fold W_UK into the query, q_nope[n] @ W_UK[n]^T [C], attend over the latent
  cache directly (the cache's `attend`: `atlas_jax.kernels.mla_decode` on the contiguous or paged
  layout), then apply W_UV to the weighted latent. No per-head K or V is ever materialised, so
  each decode step reads C + R numbers per cached token.

RoPE uses the rotate-half layout; Hugging Face's interleaved DeepSeek weights are permuted at
import (`atlas_jax.hf.deepseek`). The softmax scale is (Hn + R) ** -0.5, times YaRN's
mscale(factor, mscale_all_dim) ** 2 when YaRN scaling is set, and YaRN's attention factor
multiplies the rotated rope parts, as in DeepSeek's reference code.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from atlas_jax import kernels
from atlas_jax.cache.contiguous import LatentCache
from atlas_jax.cache.paged import LatentPool
from atlas_jax.cache.protocol import LayerCache
from atlas_jax.config import ModelConfig
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
from atlas_jax.model.lora import Adapters, adapted, adapter, plus
from atlas_jax.model.rope import (
  apply_rope,
  inverse_frequencies,
  yarn_attention_factor,
  yarn_inverse_frequencies,
  yarn_mscale,
)
from atlas_jax.quant import dequantized

Array = jax.Array

# DeepSeek's latent norms (q_a_layernorm, kv_a_layernorm) use a fixed eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_rope(cfg: ModelConfig):
  """(inv_freq f32[R/2], attention_factor, softmax scale) for an MLA config."""
  m = cfg.mla
  scaling = cfg.rope_scaling
  scale = m.qk_head_dim**-0.5
  if scaling is not None and scaling.type == "yarn":
    inv_freq = yarn_inverse_frequencies(m.qk_rope_head_dim, cfg.rope_theta, scaling)
    factor = yarn_attention_factor(scaling)
    if scaling.mscale_all_dim:
      scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return inv_freq, factor, scale
  return inverse_frequencies(m.qk_rope_head_dim, cfg.rope_theta, scaling), 1.0, scale


class MLA(nnx.Module):
  """Multi-head Latent Attention with a training/prefill path and an absorbed decode path."""

  def __init__(
    self,
    cfg: ModelConfig,
    *,
    rngs: nnx.Rngs,
    implementation: str | None = None,
    absorb_max_tokens: int = 16,
    adapters: Adapters | None = None,
    ops: Ops = PLAIN,
  ):
    self.ops = ops  # static
    m = cfg.mla
    D, N = cfg.d_model, cfg.n_heads
    C, R, Hn, Hv = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
    pdt = jnp.dtype(cfg.param_dtype)
    std = cfg.init_std
    if m.q_lora_rank is None:
      # [D, N, Hn + R]
      self.wq = param(normal(rngs, (D, N, Hn + R), std, pdt), ("embed", "q_heads", "head_dim"))
      self.wq_a = self.q_norm = self.wq_b = None
    else:
      A = m.q_lora_rank
      self.wq = None
      self.wq_a = param(normal(rngs, (D, A), std, pdt), ("embed", "q_lora"))  # [D, A]
      self.q_norm = RMSNorm(A, eps=LATENT_NORM_EPS, axis="q_lora", param_dtype=pdt)
      # [A, N, Hn + R]
      self.wq_b = param(normal(rngs, (A, N, Hn + R), std, pdt), ("q_lora", "q_heads", "head_dim"))
    # [D, C + R]: latent, rope key
    self.wkv_a = param(normal(rngs, (D, C + R), std, pdt), ("embed", "kv_lora"))
    self.kv_norm = RMSNorm(C, eps=LATENT_NORM_EPS, axis="kv_lora", param_dtype=pdt)
    # [C, N, Hn]: W_UK and [C, N, Hv]: W_UV
    self.wk_b = param(normal(rngs, (C, N, Hn), std, pdt), ("kv_lora", "q_heads", "head_dim"))
    self.wv_b = param(normal(rngs, (C, N, Hv), std, pdt), ("kv_lora", "q_heads", "head_dim"))
    out_std = std / math.sqrt(2 * cfg.n_layers)
    # [N, Hv, D]
    self.wo = param(normal(rngs, (N, Hv, D), out_std, pdt), ("q_heads", "head_dim", "embed"))
    # LoRA adapters (None where not adapted); kv_b_proj is W_UK and W_UV, an adapter each.
    full_q = self.wq is not None
    self.wq_lora = adapter(adapters, "q_proj", self.wq, 1, rngs=rngs) if full_q else None
    self.wq_a_lora = None if full_q else adapter(adapters, "q_a_proj", self.wq_a, 1, rngs=rngs)
    self.wq_b_lora = None if full_q else adapter(adapters, "q_b_proj", self.wq_b, 1, rngs=rngs)
    self.wkv_a_lora = adapter(adapters, "kv_a_proj", self.wkv_a, 1, rngs=rngs)
    self.wk_b_lora = adapter(adapters, "kv_b_proj", self.wk_b, 1, rngs=rngs)
    self.wv_b_lora = adapter(adapters, "kv_b_proj", self.wv_b, 1, rngs=rngs)
    self.wo_lora = adapter(adapters, "o_proj", self.wo, 2, rngs=rngs)
    self.dims = (C, R, Hn, Hv)  # static
    self.cfg = cfg
    self.implementation = implementation
    self.absorb_max_tokens = absorb_max_tokens

  # The caches this attention reads: one latent of C + R numbers per token and layer.
  cache_type, pool_type = LatentCache, LatentPool

  @staticmethod
  def cache_dims(cfg: ModelConfig) -> dict[str, int]:
    return dict(kv_lora_rank=cfg.mla.kv_lora_rank, rope_dim=cfg.mla.qk_rope_head_dim)

  def _rope(self, x, positions_BT):
    inv_freq, factor, _ = mla_rope(self.cfg)
    x = apply_rope(x, positions_BT, inv_freq, by_product=self.ops.rope_tables_by_product)
    return x if factor == 1.0 else x * jnp.asarray(factor, x.dtype)

  def project(self, x_BTD: Array, positions_BT: Array) -> tuple[Array, Array, Array]:
    """(q_nope [B, T, N, Hn], rotated q_rope [B, T, N, R], latent [B, T, C + R]).

    The latent is what the cache stores: the normalised c_kv, then the rotated shared rope key.
    """
    C, R, Hn, _ = self.dims
    dtype = x_BTD.dtype
    # Matmul outputs are named so that remat policies can keep them (atlas_jax.model.scan).
    if self.wq is not None:
      q_BTNH = dense(x_BTD, self.wq[...].astype(dtype), 1, self.ops)
      q_BTNH = plus(q_BTNH, self.wq_lora, x_BTD)
    else:
      cq_BTA = dense(x_BTD, self.wq_a[...].astype(dtype), 1, self.ops)
      cq_BTA = checkpoint_name(plus(cq_BTA, self.wq_a_lora, x_BTD), "q_lora_proj")
      cq_BTA = self.q_norm(cq_BTA)
      q_BTNH = dense(cq_BTA, self.wq_b[...].astype(dtype), 1, self.ops)
      q_BTNH = plus(q_BTNH, self.wq_b_lora, cq_BTA)
    q_BTNH = checkpoint_name(q_BTNH, "q_proj")
    q_nope_BTNh, q_rope_BTNR = q_BTNH[..., :Hn], q_BTNH[..., Hn:]
    q_rope_BTNR = self._rope(q_rope_BTNR, positions_BT)
    kv_BTY = dense(x_BTD, self.wkv_a[...].astype(dtype), 1, self.ops)
    kv_BTY = checkpoint_name(plus(kv_BTY, self.wkv_a_lora, x_BTD), "kv_lora_proj")
    c_BTC = rms_norm(kv_BTY[..., :C], self.kv_norm.scale[...], LATENT_NORM_EPS)
    k_rope_BTR = self._rope(kv_BTY[:, :, None, C:], positions_BT)[:, :, 0]
    return q_nope_BTNh, q_rope_BTNR, jnp.concatenate([c_BTC, k_rope_BTR], axis=-1)

  def attend_expanded(
    self, q_nope_BTNh: Array, q_rope_BTNR: Array, latent_BSY: Array, **masking
  ) -> Array:
    """Reconstructs K and V from the latents and runs the attention dispatcher: [B, T, N, Hv]."""
    C, R, Hn, Hv = self.dims
    _, _, scale = mla_rope(self.cfg)
    dtype = q_nope_BTNh.dtype
    N = q_nope_BTNh.shape[2]
    c_BSC, k_rope_BSR = latent_BSY[..., :C], latent_BSY[..., C:]
    k_nope_BSNh = dense(c_BSC, self.wk_b[...].astype(dtype), 1, self.ops)
    k_nope_BSNh = checkpoint_name(plus(k_nope_BSNh, self.wk_b_lora, c_BSC), "k_proj")
    v_BSNv = dense(c_BSC, self.wv_b[...].astype(dtype), 1, self.ops)
    v_BSNv = checkpoint_name(plus(v_BSNv, self.wv_b_lora, c_BSC), "v_proj")
    k_rope_BSNR = jnp.broadcast_to(k_rope_BSR[:, :, None, :], (*k_rope_BSR.shape[:2], N, R))
    q_BTNH = jnp.concatenate([q_nope_BTNh, q_rope_BTNR], axis=-1)
    k_BSNH = jnp.concatenate([k_nope_BSNh, k_rope_BSNR], axis=-1)
    # The dispatcher takes one head dim for q, k and v: zero-pad the narrower side. Zero query/key
    # dims add nothing to a score and zero value dims are sliced off the output.
    H = max(Hn + R, Hv)
    pad = lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, H - x.shape[-1]),))
    with jax.named_scope("attention_core"):  # as in `Attention`: named for step profiles
      out_BTNH = kernels.attention(
        pad(q_BTNH),
        pad(k_BSNH),
        pad(v_BSNv),
        scale=scale,
        implementation=self.implementation,
        **masking,
      )
    return out_BTNH[..., :Hv]

  def attend_absorbed(
    self, q_nope_BTNh: Array, q_rope_BTNR: Array, cache: LayerCache, positions_BT: Array
  ) -> Array:
    """Attends over the cached latents with W_UK folded into the query: [B, T, N, Hv]."""
    _, _, scale = mla_rope(self.cfg)
    dtype = q_nope_BTNh.dtype
    # W_UK and W_UV are folded into the query and the output, so their adapters are folded into
    # them first (the update as a [C, N, H] weight: small beside the cache this path reads).
    w_uk_CNh = dequantized(adapted(self.wk_b, self.wk_b_lora)).astype(dtype)
    w_uv_CNv = dequantized(adapted(self.wv_b, self.wv_b_lora)).astype(dtype)
    q_lat_BTNC = jnp.einsum("BTNh,CNh->BTNC", q_nope_BTNh, w_uk_CNh)
    q_BTNY = jnp.concatenate([q_lat_BTNC, q_rope_BTNR], axis=-1)
    with jax.named_scope("attention_core"):  # the latent attention only, not the folds
      o_lat_BTNC = cache.attend(
        q_BTNY, positions_BT, scale=scale, implementation=self.implementation
      )
    return jnp.einsum("BTNC,CNv->BTNv", o_lat_BTNC, w_uv_CNv)

  def __call__(
    self,
    x_BTD: Array,
    positions_BT: Array,
    *,
    segment_ids_BT: Array | None = None,
    cache: LayerCache | None = None,
    kind: Array | None = None,
  ) -> tuple[Array, LayerCache | None]:
    """Self-attention over x, or over the latent cache after writing x's latents into it.

    Args:
      x_BTD: [B, T, D] activations.
      positions_BT: i32[B, T] absolute positions (RoPE and the causal mask).
      segment_ids_BT: i32[B, T] packed-document ids (no cache).
      cache: this layer's view of a latent cache; the new tokens' latents are written at their
        positions. Up to `absorb_max_tokens` new tokens use the absorbed path, longer chunks
        (prefill) reconstruct K and V from the cached latents, except over a cache that attends
        in place (a paged pool), which stays absorbed: more FLOPs per query (scores over C + R,
        sums over C), no dense copy of any sequence's latents.

    Returns:
      [B, T, D] and the updated layer cache (None without).
    """
    q_nope_BTNh, q_rope_BTNR, latent_BTY = self.project(x_BTD, positions_BT)
    T = x_BTD.shape[1]
    if cache is None:
      out_BTNv = self.attend_expanded(
        q_nope_BTNh,
        q_rope_BTNR,
        latent_BTY,
        causal=True,
        q_segment_ids=segment_ids_BT,
        kv_segment_ids=segment_ids_BT,
      )
    else:
      with jax.named_scope("kv_cache_write"):  # named for step profiles
        cache = cache.write(positions_BT, latent_BTY)
      # A paged view reads the latents in place for any number of tokens, so it stays absorbed:
      # the expanded path would copy every sequence's latents out densely first.
      if T <= self.absorb_max_tokens or getattr(cache, "attends_in_place", False):
        out_BTNv = self.attend_absorbed(q_nope_BTNh, q_rope_BTNR, cache, positions_BT)
      else:
        (latent_BSY,) = cache.read()
        out_BTNv = self.attend_expanded(
          q_nope_BTNh,
          q_rope_BTNR,
          latent_BSY.astype(x_BTD.dtype),
          causal=True,
          q_positions=jnp.maximum(positions_BT, 0),  # padding (-1) is clamped, then discarded
          kv_lengths=cache.kv_lengths,
        )
    out_BTNv = checkpoint_name(out_BTNv, "attn_out")
    out_BTD = output_projection(
      out_BTNv, self.wo[...].astype(x_BTD.dtype), serving=cache is not None, ops=self.ops
    )
    out_BTD = checkpoint_name(plus(out_BTD, self.wo_lora, out_BTNv), "o_proj")
    return out_BTD, cache
