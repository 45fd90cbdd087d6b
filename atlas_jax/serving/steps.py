"""The engine's device programs: one mixed step, a burst of decode steps, block copies.

Each is jitted once per bucket of shapes and donates the pool, so XLA updates it in place. The
host-side scheduler (`atlas_jax.serving.engine`) decides what runs; these only compute.

* `forward_sample`: one model call over rows of new tokens (prefill chunks right-padded, or one
  decode token), then one draw per row from its last real token.
* `decode_burst`: K decode iterations in one call, each sampled token fed straight back as the
  next input without leaving the device; the host reads all K tokens per row afterwards. Rows do
  not stop inside the burst: tokens past a stop are cut by the host, whose block reservation
  covered them.
* `copy_blocks`: copy-on-write of pool blocks.

`programs(graphdef)` returns the jitted programs with the model's graph bound in, made once per
graph: a step then hashes no graph, only its arrays' shapes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax.cache.paged import PagedCache
from atlas_jax.decoding.sampling import SamplingArrays, sample_rows, step_keys

Array = jax.Array


def forward_sample(
  graphdef,
  state,
  pool,
  tokens_BT,
  positions_BT,
  block_table_BM,
  lengths_B,
  last_B,
  seed_B,
  step_B,
  arrays: SamplingArrays,
  penalties: bool,
  counts_BV,
  prompt_mask_BV,
):
  """One model call over the pool (donated), then one draw per row from its last real token.

  Args:
    tokens_BT: i32[B, T] new tokens, right-padded; positions_BT i32[B, T] (-1 for padding).
    block_table_BM: i32[B, M]; lengths_B i32[B] tokens in the pool before this call.
    last_B: i32[B] index in T of each row's last real token.
    seed_B, step_B: i32[B] each row's seed and the index of the token it samples.

  Returns:
    (pool, i32[B] tokens, f32[B] logprobs, i32[B, 5] top tokens, f32[B, 5] top logprobs).
  """
  model = nnx.merge(graphdef, state)
  cache = PagedCache(pool=pool, block_table=block_table_BM, lengths=lengths_B)
  logits_B1V, cache = model(tokens_BT, positions_BT=positions_BT, cache=cache, logits_at_B=last_B)
  out = sample_rows(
    logits_B1V[:, 0],
    step_keys(seed_B, step_B),
    arrays,
    counts_BV=counts_BV if penalties else None,
    prompt_mask_BV=prompt_mask_BV if penalties else None,
  )
  return (cache.pool, *out)


def decode_burst(
  graphdef,
  state,
  pool,
  tokens_B,
  lengths_B,
  block_table_BM,
  seed_B,
  step_B,
  arrays: SamplingArrays,
  counts_BV,
  n_steps: int,
  penalties: bool,
  prompt_mask_BV,
):
  """`n_steps` decode iterations: compute each row's pending token, sample the next, repeat.

  Args:
    tokens_B: i32[B] each row's pending token (sampled, not yet in the pool).
    lengths_B: i32[B] tokens in the pool; the pending token goes at this position. Padding rows
      have length -1 and write nothing.
    block_table_BM: i32[B, M] covering positions up to lengths + n_steps - 1.
    seed_B, step_B: i32[B] seeds, and the index of the first token this burst samples.
    counts_BV: i32[B, V] output token counts so far (penalties), updated on the device.

  Returns:
    (pool, i32[K, B] tokens, f32[K, B] logprobs, i32[K, B, 5] top ids, f32[K, B, 5] top logprobs,
    i32[B, V] counts after the burst, or None without penalties).
  """
  if arrays.allowed_bits is not None:
    raise ValueError("decode_burst: a guided row's mask needs the host after every token")
  model = nnx.merge(graphdef, state)
  valid_B = lengths_B >= 0
  B = tokens_B.shape[0]

  def body(carry, k):
    pool, token_B, counts_BV = carry
    positions_B1 = jnp.where(valid_B, lengths_B + k, -1)[:, None]
    cache = PagedCache(pool=pool, block_table=block_table_BM, lengths=positions_B1[:, 0] + ~valid_B)
    logits_B1V, cache = model(token_B[:, None], positions_BT=positions_B1, cache=cache)
    out = sample_rows(
      logits_B1V[:, 0],
      step_keys(seed_B, step_B + k),
      arrays,
      counts_BV=counts_BV if penalties else None,
      prompt_mask_BV=prompt_mask_BV if penalties else None,
    )
    if penalties:
      counts_BV = counts_BV.at[jnp.arange(B), out[0]].add(1)
    return (cache.pool, out[0], counts_BV), out

  (pool, _, counts_BV), outs = jax.lax.scan(body, (pool, tokens_B, counts_BV), jnp.arange(n_steps))
  return (pool, *outs, counts_BV)


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_blocks(pool, src_N, dst_N):
  """Copies pool blocks src -> dst (i32[N] each) in every layer; the pool is donated."""
  return jax.tree.map(lambda a_LPZ_: a_LPZ_.at[:, dst_N].set(a_LPZ_[:, src_N]), pool)


@dataclasses.dataclass(frozen=True)
class Programs:
  """The jitted step programs of one model graph (the arguments after `graphdef`)."""

  forward_sample: Callable
  decode_burst: Callable


@functools.cache
def programs(graphdef) -> Programs:
  """The step programs with `graphdef` bound, compiled lazily per shape; one set per graph."""
  return Programs(
    forward_sample=jax.jit(
      functools.partial(forward_sample, graphdef), static_argnums=(10,), donate_argnums=(1,)
    ),
    decode_burst=jax.jit(
      functools.partial(decode_burst, graphdef), static_argnums=(9, 10), donate_argnums=(1,)
    ),
  )
