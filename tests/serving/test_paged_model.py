"""The model's cache path gives the same logits on the paged pool as on the contiguous cache."""

import jax
import jax.numpy as jnp
import numpy as np

from atlas_jax.cache.paged import init_kv_pool
from atlas_jax.cache.paged_view import PagedKVCache


def test_paged_and_contiguous_caches_give_identical_logits(tiny_model):
  cfg = tiny_model.cfg
  Z, M = 4, 8
  rng = np.random.default_rng(0)
  lens = [13, 5]  # prompt lengths; row 1 is shorter, so its chunk is right-padded
  prompts = [rng.integers(0, cfg.vocab_size, n) for n in lens]
  # Scattered, interleaved blocks: a sequence's pages need not be contiguous or ordered.
  perm = rng.permutation(2 * M)
  table = jnp.asarray(np.stack([perm[:M], perm[M:]]), jnp.int32)
  pool = init_kv_pool(n_layers=cfg.n_layers, n_blocks=2 * M, block_size=Z,
                      n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, dtype=jnp.float32)
  paged = PagedKVCache(pool=pool, block_table=table, lengths=jnp.zeros(2, jnp.int32))
  contiguous = tiny_model.init_cache(2, M * Z)

  # Prefill both rows in one padded call (positions -1 mark the padding of row 1).
  T = max(lens)
  tokens = np.zeros((2, T), np.int32)
  positions = np.full((2, T), -1, np.int32)
  for b, p in enumerate(prompts):
    tokens[b, : len(p)] = p
    positions[b, : len(p)] = np.arange(len(p))
  logits_p, paged = tiny_model(jnp.asarray(tokens), positions_BT=jnp.asarray(positions),
                               cache=paged)
  np.testing.assert_array_equal(paged.lengths, lens)
  for b, p in enumerate(prompts):  # contiguous: one row at a time, no padding
    one = jax.tree.map(lambda x: x[:, b : b + 1] if x.ndim == 5 else x[b : b + 1], contiguous)
    logits_c, _ = tiny_model(jnp.asarray(p[None], jnp.int32), cache=one)
    np.testing.assert_allclose(logits_p[b, : len(p)], logits_c[0], rtol=1e-5, atol=1e-5)

  # Decode steps in lockstep from both rows' own lengths.
  contiguous = contiguous.replace(lengths=jnp.asarray(lens, jnp.int32))
  for b, p in enumerate(prompts):
    _, filled = tiny_model(jnp.asarray(tokens[b : b + 1]), cache=jax.tree.map(
      lambda x: x[:, b : b + 1] if x.ndim == 5 else x[b : b + 1], tiny_model.init_cache(2, M * Z)))
    contiguous = contiguous.replace(k=contiguous.k.at[:, b].set(filled.k[:, 0]),
                                    v=contiguous.v.at[:, b].set(filled.v[:, 0]))
  token = jnp.asarray([[1], [2]], jnp.int32)
  for _ in range(6):
    logits_p, paged = tiny_model(token, cache=paged)
    logits_c, contiguous = tiny_model(token, cache=contiguous)
    np.testing.assert_allclose(logits_p, logits_c, rtol=1e-5, atol=1e-5)
    token = jnp.argmax(logits_p[:, -1:], axis=-1).astype(jnp.int32)
  np.testing.assert_array_equal(paged.lengths, contiguous.lengths)
