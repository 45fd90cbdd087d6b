"""The caches' `attend` with a sliding window, a logit soft-cap and attention sinks, against
`attention_reference` over the same keys and values held densely."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from atlas_jax import kernels
from atlas_jax.cache.contiguous import KVCache, LatentCache
from atlas_jax.cache.paged import KVPool, PagedCache, PoolLayout
from atlas_jax.kernels import attention_reference

B, N, K, H = 2, 4, 2, 8
SINKS = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
OPTIONS = dict(sliding_window=5, soft_cap=2.0, sinks=SINKS)


def _kv(T, seed):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.normal(size=s) * 2, jnp.float32) for s in ((B, T, N, H), (B, T, K, H))]


def _fill_contiguous(S, T0):
  """A contiguous cache of capacity S holding T0 tokens per row, and those K/V densely."""
  cache = KVCache.init(n_layers=2, batch=B, max_len=S, n_kv_heads=K, head_dim=H)
  _, k = _kv(T0, 1)
  _, v = _kv(T0, 2)
  positions = jnp.broadcast_to(jnp.arange(T0), (B, T0))
  view = cache.layer(cache.layers, jnp.int32(1), positions).write(positions, k, v)
  return cache.advance(view.storage, positions), k, v


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_contiguous_decode_with_options_stays_on_the_paged_kernel(implementation, monkeypatch):
  cache, k0, v0 = _fill_contiguous(S=32, T0=13)
  q, k1 = _kv(1, 3)
  _, v1 = _kv(1, 4)
  positions = jnp.full((B, 1), 13)
  view = cache.layer(cache.layers, jnp.int32(1), positions).write(positions, k1, v1)

  def dense(*args, **kwargs):
    raise AssertionError("a windowed decode read the cache densely")

  monkeypatch.setattr(kernels, "attention", dense)
  got = view.attend(q, positions, implementation=implementation, **OPTIONS)
  k, v = jnp.concatenate([k0, k1], 1), jnp.concatenate([v0, v1], 1)
  want = attention_reference(q, k, v, causal=True, **OPTIONS)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_contiguous_prefill_with_options():
  cache = KVCache.init(n_layers=1, batch=B, max_len=16, n_kv_heads=K, head_dim=H)
  q, k = _kv(11, 5)
  _, v = _kv(11, 6)
  positions = jnp.broadcast_to(jnp.arange(11), (B, 11))
  view = cache.layer(cache.layers, jnp.int32(0), positions).write(positions, k, v)
  got = view.attend(q, positions, implementation="xla", **OPTIONS)
  want = attention_reference(q, k, v, causal=True, **OPTIONS)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


# One device under -m slow: the sharded case runs the same path on each device's heads.
@pytest.mark.parametrize("sharded", [pytest.param(False, marks=pytest.mark.slow), True])
def test_paged_attend_with_options(sharded):
  """The ragged kernel's path; on a (data 1, tensor 2) mesh each device holds half the heads
  and their sinks."""
  layout = None
  if sharded:
    mesh = Mesh(np.asarray(jax.devices()[:2]).reshape(1, 2), ("data", "tensor"))
    rules = {"batch": "data", "pages": "data", "q_heads": "tensor", "kv_heads": "tensor"}
    layout = PoolLayout(mesh, tuple(sorted(rules.items())))
  Z, T = 4, 11
  pool = KVPool.init(
    n_layers=1, n_blocks=8, block_size=Z, n_kv_heads=K, head_dim=H, dtype=jnp.float32
  )
  table = jnp.asarray([[5, 2, 7, 0], [1, 3, 6, 4]], jnp.int32)
  cache = PagedCache(pool, table, jnp.zeros((B,), jnp.int32), layout=layout)
  q, k = _kv(T, 7)
  _, v = _kv(T, 8)
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  view = cache.layer(cache.layers, jnp.int32(0), positions).write(positions, k, v)
  got = jax.jit(lambda view, q: view.attend(q, positions, implementation="xla", **OPTIONS))(view, q)
  want = attention_reference(q, k, v, causal=True, **OPTIONS)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_latent_layers_refuse_the_options():
  cache = LatentCache.init(n_layers=1, batch=1, max_len=8, kv_lora_rank=8, rope_dim=4)
  positions = jnp.zeros((1, 1), jnp.int32)
  view = cache.layer(cache.layers, jnp.int32(0), positions)
  q = jnp.zeros((1, 1, 2, 12))
  for name, value in (("soft_cap", 2.0), ("sinks", jnp.zeros(2)), ("sliding_window", 4)):
    with pytest.raises(ValueError, match=f"LatentLayer.attend: MLA has no {name}"):
      view.attend(q, positions, **{name: value})
