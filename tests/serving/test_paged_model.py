"""The model gives the same logits on a paged pool as on its contiguous cache, for KV and MLA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax.cache.contiguous import KVCache, LatentCache
from atlas_jax.cache.paged import KVPool, LatentPool, PagedCache


@functools.partial(jax.jit, static_argnums=0)
def _call(graphdef, state, tokens_BT, positions_BT, cache):
  return nnx.merge(graphdef, state)(tokens_BT, positions_BT=positions_BT, cache=cache)


def paged_vs_contiguous(model, lens, steps=6, Z=4, M=8):
  cfg = model.cfg
  graphdef, state = nnx.split(model)
  call = lambda tokens, cache, positions=None: _call(graphdef, state, tokens, positions, cache)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, n) for n in lens]
  feed = rng.integers(0, cfg.vocab_size, (len(lens), steps))  # decode inputs, the same for both

  # Paged: all rows in one padded prefill call (positions -1 mark padding), over scattered,
  # interleaved blocks, then decode steps in lockstep.
  B = len(lens)
  perm = rng.permutation(B * M).reshape(B, M)
  paged = PagedCache(
    pool=model.init_pool(B * M, Z), block_table=jnp.asarray(perm), lengths=jnp.zeros(B, jnp.int32)
  )
  tokens = np.zeros((B, max(lens)), np.int32)
  positions = np.full((B, max(lens)), -1, np.int32)
  for b, p in enumerate(prompts):
    tokens[b, : len(p)] = p
    positions[b, : len(p)] = np.arange(len(p))
  prefill_p, paged = call(jnp.asarray(tokens), paged, jnp.asarray(positions))
  np.testing.assert_array_equal(paged.lengths, lens)
  decode_p = []
  for t in range(steps):
    logits, paged = call(jnp.asarray(feed[:, t : t + 1]), paged)
    decode_p.append(logits[:, 0])
  np.testing.assert_array_equal(paged.lengths, np.asarray(lens) + steps)

  # Contiguous: each row alone, unpadded.
  for b, p in enumerate(prompts):
    cache = model.init_cache(1, M * Z)
    prefill_c, cache = call(jnp.asarray(p[None], jnp.int32), cache)
    np.testing.assert_allclose(prefill_p[b, : len(p)], prefill_c[0], rtol=2e-5, atol=2e-5)
    for t in range(steps):
      logits, cache = call(jnp.asarray(feed[b : b + 1, t : t + 1]), cache)
      np.testing.assert_allclose(decode_p[t][b], logits[0, 0], rtol=2e-5, atol=2e-5)
  return paged


def test_paged_and_contiguous_caches_give_identical_logits(tiny_model):
  # Row 1 is shorter, so its part of the batched prefill is padding.
  paged = paged_vs_contiguous(tiny_model, [13, 5])
  assert isinstance(paged.pool, KVPool)
  assert isinstance(tiny_model.init_cache(1, 8), KVCache)


@pytest.mark.parametrize("lens", [[13, 5], [23, 9]], ids=["absorbed_prefill", "expanded_prefill"])
def test_mla_paged_latent_pool_matches_contiguous_latent_cache(mla_model, lens):
  # Prompts up to 16 tokens take the absorbed path even in prefill; longer ones the expanded one.
  paged = paged_vs_contiguous(mla_model, lens)
  m = mla_model.cfg.mla
  assert isinstance(paged.pool, LatentPool)
  assert paged.pool.c.shape[-1] == m.kv_lora_rank + m.qk_rope_head_dim
  assert isinstance(mla_model.init_cache(1, 8), LatentCache)
