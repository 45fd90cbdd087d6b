"""Token sampling, vectorised over the batch with per-row parameters.

Every row has its own temperature (0 = greedy), top-k (0 = off) and top-p (1 = off), so requests
with different settings share one jitted decode step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def sample(
  logits_BV: Array, key_B: Array, *, temperature_B: Array, top_k_B: Array, top_p_B: Array
) -> Array:
  """Draws one token per row.

  Args:
    logits_BV: f32[B, V].
    key_B: [B] per-row PRNG keys (so a row's draw does not depend on its batch neighbours).
    temperature_B: f32[B]; 0 picks the argmax.
    top_k_B: i32[B]; keep the k most likely tokens, 0 keeps all.
    top_p_B: f32[B]; keep the smallest set whose probability reaches p (nucleus), 1 keeps all.

  Returns:
    i32[B] tokens.
  """
  logits_BV = logits_BV.astype(jnp.float32)
  V = logits_BV.shape[-1]
  greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  scaled_BV = logits_BV / jnp.maximum(temperature_B, 1e-6)[:, None]
  # Filter in sorted order: rank < k for top-k, and exclusive cumulative probability < p for top-p
  # (the most likely token always survives).
  order_BV = jnp.argsort(-scaled_BV, axis=-1)
  sorted_BV = jnp.take_along_axis(scaled_BV, order_BV, axis=-1)
  rank_1V = jnp.arange(V)[None, :]
  k_B1 = jnp.where(top_k_B > 0, top_k_B, V)[:, None]
  probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
  cum_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
  keep_BV = (rank_1V < k_B1) & (cum_before_BV < top_p_B[:, None])
  sorted_BV = jnp.where(keep_BV, sorted_BV, -jnp.inf)
  choice_B = jax.vmap(jax.random.categorical)(key_B, sorted_BV)
  sampled_B = jnp.take_along_axis(order_BV, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)
  return jnp.where(temperature_B > 0, sampled_B, greedy_B)
