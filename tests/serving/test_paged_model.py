"""The model's cache path gives the same logits on the paged pool as on the contiguous cache."""

import jax.numpy as jnp
import numpy as np

from atlas_jax.cache.paged import init_kv_pool
from atlas_jax.cache.paged_view import PagedKVCache


def test_paged_and_contiguous_caches_give_identical_logits(tiny_model):
  cfg = tiny_model.cfg
  Z, M, steps = 4, 8, 6
  rng = np.random.default_rng(0)
  lens = [13, 5]  # row 1 is shorter, so its part of the batched prefill is padding
  prompts = [rng.integers(0, cfg.vocab_size, n) for n in lens]
  feed = rng.integers(0, cfg.vocab_size, (2, steps))  # decode inputs, the same for both caches

  # Paged: both rows in one padded prefill call (positions -1 mark padding), over scattered,
  # interleaved blocks, then decode steps in lockstep.
  perm = rng.permutation(2 * M)
  pool = init_kv_pool(
    n_layers=cfg.n_layers,
    n_blocks=2 * M,
    block_size=Z,
    n_kv_heads=cfg.n_kv_heads,
    head_dim=cfg.head_dim,
    dtype=jnp.float32,
  )
  paged = PagedKVCache(
    pool=pool,
    block_table=jnp.asarray(np.stack([perm[:M], perm[M:]])),
    lengths=jnp.zeros(2, jnp.int32),
  )
  tokens = np.zeros((2, max(lens)), np.int32)
  positions = np.full((2, max(lens)), -1, np.int32)
  for b, p in enumerate(prompts):
    tokens[b, : len(p)] = p
    positions[b, : len(p)] = np.arange(len(p))
  prefill_p, paged = tiny_model(
    jnp.asarray(tokens), positions_BT=jnp.asarray(positions), cache=paged
  )
  np.testing.assert_array_equal(paged.lengths, lens)
  decode_p = []
  for t in range(steps):
    logits, paged = tiny_model(jnp.asarray(feed[:, t : t + 1]), cache=paged)
    decode_p.append(logits[:, 0])
  np.testing.assert_array_equal(paged.lengths, np.asarray(lens) + steps)

  # Contiguous: each row alone, unpadded.
  for b, p in enumerate(prompts):
    cache = tiny_model.init_cache(1, M * Z)
    prefill_c, cache = tiny_model(jnp.asarray(p[None], jnp.int32), cache=cache)
    np.testing.assert_allclose(prefill_p[b, : len(p)], prefill_c[0], rtol=1e-5, atol=1e-5)
    for t in range(steps):
      logits, cache = tiny_model(jnp.asarray(feed[b : b + 1, t : t + 1]), cache=cache)
      np.testing.assert_allclose(decode_p[t][b], logits[0, 0], rtol=1e-5, atol=1e-5)
