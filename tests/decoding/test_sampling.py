"""Sampling: greedy is argmax, filters restrict support, seeds reproduce, rows are independent."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.decoding.sampling import SamplingArrays, SamplingParams, probabilities, sample

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


def test_top_k_keeps_ties_with_the_kth():
  logits = jnp.log(jnp.array([[0.4, 0.2, 0.2, 0.1, 0.1]], jnp.float32))
  assert set(draw(logits, 400, top_k_B=2).ravel()) == {0, 1, 2}


@pytest.mark.parametrize("top_k", [1, 7, 300])
def test_a_rows_draw_does_not_depend_on_its_neighbours_filters(top_k):
  """Row 0 (top-k alone) is filtered through lax.top_k when alone, and through the full sort when
  a neighbour uses top-p; bf16-rounded logits make ties at the k-th value likely. The same law
  and, with the same key, the same token either way."""
  logits = jax.random.normal(jax.random.key(3), (2, 1000)).astype(jnp.bfloat16).astype(jnp.float32)
  keys = jax.random.split(jax.random.key(4), 2)
  alone = SamplingArrays.from_params([SamplingParams(temperature=0.8, top_k=top_k)] * 2)
  mixed = SamplingArrays.from_params(
    [SamplingParams(temperature=0.8, top_k=top_k), SamplingParams(temperature=1.0, top_p=0.5)]
  )
  np.testing.assert_array_equal(probabilities(logits, alone)[0], probabilities(logits, mixed)[0])
  draws = lambda arrays: sample(
    logits,
    keys,
    temperature_B=arrays.temperature,
    top_k_B=arrays.top_k,
    top_p_B=arrays.top_p,
    min_p_B=arrays.min_p,
  )
  assert draws(alone)[0] == draws(mixed)[0]
  kept = int((probabilities(logits, alone)[0] > 0).sum())
  assert kept >= min(top_k, 1000)  # ties with the k-th are kept too
