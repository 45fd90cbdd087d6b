"""A DeepSeek-style decoder: MLA attention (or GQA), SwiGLU MLPs, optional multi-token prediction.

Same call contract as `atlas_jax.model.transformer.Transformer`: `model(tokens_BT)` returns f32
logits [B, T, V]; with `cache=` it returns (logits, cache), where the cache is a
`LatentCache` for MLA configs (C + R numbers per token and layer) and a `KVCache` otherwise.
`model.forward_mtp(tokens_BT)` also returns the MTP heads' logits for training.

Layers are stacked (leading [L] axis) and run under `jax.lax.scan`. Mixture-of-experts layers are
not implemented: every layer is dense (DeepSeek's first_k_dense_replace >= n_layers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax.cache.contiguous import KVCache
from atlas_jax.cache.latent import LatentCache
from atlas_jax.config import ModelConfig
from atlas_jax.model.layers import RMSNorm, normal
from atlas_jax.model.mtp import MTPHeads, stacked
from atlas_jax.model.transformer import Block, default_positions, scan_kv_cache
from atlas_jax.training.remat import scan_blocks

Array = jax.Array


class DeepSeek(nnx.Module):
  def __init__(
    self,
    cfg: ModelConfig,
    *,
    rngs: nnx.Rngs,
    implementation: str | None = None,
    remat: str = "none",
    remat_every: int | None = None,
  ):
    V, D = cfg.vocab_size, cfg.d_model
    pdt = jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.remat = (remat, remat_every)  # training-time activation checkpointing, static

    def make_block(r):
      return Block(cfg, rngs=r, implementation=implementation)

    self.embed = nnx.Param(normal(rngs, (V, D), cfg.init_std, pdt))  # [V, D]
    self.blocks = stacked(make_block, cfg.n_layers, rngs)  # every parameter [L, ...]
    self.final_norm = RMSNorm(D, eps=cfg.norm_eps, param_dtype=pdt)
    self.lm_head = (
      None if cfg.tie_embeddings else nnx.Param(normal(rngs, (D, V), cfg.init_std, pdt))  # [D, V]
    )
    self.mtp = None if cfg.mtp is None else MTPHeads(cfg, make_block, rngs=rngs)  # [J, ...]

  def _head_DV(self) -> Array:
    return self.embed[...].T if self.lm_head is None else self.lm_head[...]

  def _trunk(self, tokens_BT, positions_BT, segment_ids_BT, cache):
    """(input to the last block [B, T, D], final normalised hidden [B, T, D], new cache)."""
    cfg = self.cfg
    B, T = tokens_BT.shape
    dtype = jnp.dtype(cfg.dtype)
    x_BTD = jnp.take(self.embed[...], tokens_BT, axis=0).astype(dtype)
    graphdef, block_state = nnx.split(self.blocks)

    if cache is None:

      def block_fn(carry, state):
        x_BTD, _ = carry
        y_BTD, _ = nnx.merge(graphdef, state)(x_BTD, positions_BT, segment_ids_BT=segment_ids_BT)
        # Carry each block's input too: the last one is the parallel MTP heads' trunk.
        return y_BTD, x_BTD

      policy, every = self.remat
      x_BTD, trunk_BTD = scan_blocks(
        block_fn, (x_BTD, x_BTD), block_state, policy=policy, every=every
      )
      new_cache = None
    elif isinstance(cache, LatentCache):

      def body(x_BTD, layer):
        state, c_BSE = layer
        x_BTD, c_BSE = nnx.merge(graphdef, state)(x_BTD, positions_BT, cache=(c_BSE, cache.lengths))
        return x_BTD, c_BSE

      x_BTD, c_LBSE = jax.lax.scan(body, x_BTD, (block_state, cache.c))
      new_cache, trunk_BTD = cache.replace(c=c_LBSE, lengths=cache.lengths + T), None
    else:
      x_BTD, new_cache = scan_kv_cache(graphdef, block_state, x_BTD, positions_BT, cache)
      trunk_BTD = None
    return trunk_BTD, self.final_norm(x_BTD), new_cache

  def __call__(
    self,
    tokens_BT: Array,
    *,
    positions_BT: Array | None = None,
    segment_ids_BT: Array | None = None,
    cache: LatentCache | KVCache | None = None,
    logits_at_B: Array | None = None,
  ):
    """Next-token logits.

    Args:
      tokens_BT: i32[B, T].
      positions_BT: i32[B, T]; default 0..T-1, or continuing from `cache.lengths`.
      segment_ids_BT: i32[B, T] document ids of packed sequences (no cache).
      cache: from `init_cache`; the tokens are appended at each sequence's length.
      logits_at_B: i32[B]; compute logits only at this index of each row (T = 1 in the result).

    Returns:
      f32[B, T, V] logits; with a cache, (logits, cache) where cache.lengths grew by T.
    """
    positions_BT = positions_BT if positions_BT is not None else default_positions(tokens_BT, cache)
    _, h_BTD, new_cache = self._trunk(tokens_BT, positions_BT, segment_ids_BT, cache)
    if logits_at_B is not None:
      h_BTD = jnp.take_along_axis(h_BTD, logits_at_B[:, None, None], axis=1)
    logits_BTV = jnp.einsum(
      "BTD,DV->BTV", h_BTD, self._head_DV().astype(h_BTD.dtype), preferred_element_type=jnp.float32
    )
    return logits_BTV if cache is None else (logits_BTV, new_cache)

  def forward_mtp(
    self,
    tokens_BT: Array,
    *,
    positions_BT: Array | None = None,
    segment_ids_BT: Array | None = None,
  ) -> tuple[Array, Array]:
    """(next-token logits f32[B, T, V], MTP logits f32[J, B, T, V]) for training.

    MTP head j (1-based) at position t predicts token t + 1 + j.
    """
    if self.mtp is None:
      raise ValueError("forward_mtp: the model has no MTP heads (model.mtp is null)")
    positions_BT = positions_BT if positions_BT is not None else default_positions(tokens_BT, None)
    trunk_BTD, h_BTD, _ = self._trunk(tokens_BT, positions_BT, segment_ids_BT, None)
    head_DV = self._head_DV()
    logits_BTV = jnp.einsum(
      "BTD,DV->BTV", h_BTD, head_DV.astype(h_BTD.dtype), preferred_element_type=jnp.float32
    )
    mtp_JBTV = self.mtp(
      tokens_BT=tokens_BT,
      trunk_BTD=trunk_BTD,
      final_BTD=h_BTD,
      positions_BT=positions_BT,
      segment_ids_BT=segment_ids_BT,
      embed_VD=self.embed[...],
      head_DV=head_DV,
    )
    return logits_BTV, mtp_JBTV

  def init_cache(self, batch: int, max_len: int, dtype=None) -> LatentCache | KVCache:
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype) if dtype is None else dtype
    if cfg.mla is None:
      return KVCache.init(
        n_layers=cfg.n_layers,
        batch=batch,
        max_len=max_len,
        n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        dtype=dtype,
      )
    return LatentCache.init(
      n_layers=cfg.n_layers,
      batch=batch,
      max_len=max_len,
      kv_lora_rank=cfg.mla.kv_lora_rank,
      rope_dim=cfg.mla.qk_rope_head_dim,
      dtype=dtype,
    )


def build(cfg: ModelConfig, rngs: nnx.Rngs, **kwargs) -> nnx.Module:
  """The model class a config calls for: DeepSeek for MLA or MTP configs, else Transformer.

  `kwargs` (implementation, remat, remat_every) go to the model's constructor.
  """
  if cfg.mla is None and cfg.mtp is None:
    from atlas_jax.model.transformer import Transformer

    return Transformer(cfg, rngs=rngs, **kwargs)
  return DeepSeek(cfg, rngs=rngs, **kwargs)
