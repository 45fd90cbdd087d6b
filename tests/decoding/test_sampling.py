"""Sampling: greedy is argmax, filters restrict support, seeds reproduce, rows are independent."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.decoding.sampling import sample

LOGITS = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.07, 0.03]] * 1, jnp.float32))


def draw(logits, n, **kw):
  B = logits.shape[0]
  params = dict(temperature_B=jnp.ones(B), top_k_B=jnp.zeros(B, jnp.int32), top_p_B=jnp.ones(B))
  params.update({k: jnp.broadcast_to(jnp.asarray(v), (B,)) for k, v in kw.items()})
  keys = jax.random.split(jax.random.key(0), n)
  f = jax.jit(jax.vmap(lambda k: sample(logits, jax.random.split(k, B), **params)))
  return np.asarray(f(keys))


def test_greedy_is_argmax():
  logits = jax.random.normal(jax.random.key(1), (4, 50))
  out = draw(logits, 3, temperature_B=0.0)
  assert (out == np.argmax(logits, -1)).all()


def test_top_k_and_top_p_restrict_support():
  assert set(draw(LOGITS, 400, top_k_B=2).ravel()) == {0, 1}
  # Exclusive cumulative probabilities are 0, .5, .75, .9: p=0.7 keeps the first two tokens.
  assert set(draw(LOGITS, 400, top_p_B=0.7).ravel()) == {0, 1}
  assert set(draw(LOGITS, 400, top_k_B=1).ravel()) == {0}


def test_temperature_one_follows_the_distribution():
  counts = np.bincount(draw(LOGITS, 4000).ravel(), minlength=5) / 4000
  np.testing.assert_allclose(counts, [0.5, 0.25, 0.15, 0.07, 0.03], atol=0.03)


def test_same_seed_same_draw_and_rows_are_independent():
  logits = jnp.zeros((3, 1000))
  params = dict(temperature_B=jnp.ones(3), top_k_B=jnp.zeros(3, jnp.int32), top_p_B=jnp.ones(3))
  keys = jnp.stack([jax.random.key(7), jax.random.key(8), jax.random.key(7)])
  a = sample(logits, keys, **params)
  b = sample(logits, keys, **params)
  np.testing.assert_array_equal(a, b)
  assert a[0] == a[2]  # same seed, same token, whatever the neighbours


@pytest.mark.parametrize("B", [1, 3])
def test_mixed_rows(B):
  logits = jax.random.normal(jax.random.key(2), (B, 30))
  out = sample(
    logits,
    jax.random.split(jax.random.key(0), B),
    temperature_B=jnp.zeros(B),
    top_k_B=jnp.full((B,), 5, jnp.int32),
    top_p_B=jnp.full((B,), 0.9),
  )
  assert (np.asarray(out) == np.argmax(logits, -1)).all()
