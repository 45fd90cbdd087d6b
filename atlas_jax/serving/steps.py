"""The engine's device programs: one mixed step, a burst of decode steps, block copies.

Each is jitted once per bucket of shapes and donates the pool, so XLA updates it in place. The
host-side scheduler (`atlas_jax.serving.engine`) decides what runs; these only compute.

* `forward_sample`: one model call over rows of new tokens (prefill chunks right-padded, or one
  decode token), then one draw per row from its last real token.
* `decode_burst`: K decode iterations in one call, each sampled token fed straight back as the
  next input without leaving the device; the host reads all K tokens per row afterwards. Rows do
  not stop inside the burst: tokens past a stop are cut by the host, whose block reservation
  covered them.
* `speculative_round`: the draft model proposes k tokens per row, the target scores all of
  them in one pass, the rejection sampler keeps a prefix and draws the token after it. Split in
  `speculative_draft` and `speculative_verify` for guided rows, whose masks at each draft position
  the host computes from the drafts.
* `copy_blocks`: copy-on-write of pool blocks.
* `prompt_logprobs`: the model over one whole prompt (no pool), each position's log-probability
  of the token after it and the top ones (the API's `echo` with `logprobs`).

With a draft model, every program takes `states` and `pools` as (target, draft) pairs: the draft
runs over the same new tokens as the target into its own pool, indexed by the same block tables,
so it always holds K/V for every token the target does and a speculative round needs no
catch-up. Without one the draft halves are None.

MTP self-speculation (`draft_graphdef == MTP`): the draft half of the pools is the model's MTP
heads' own pool (the first k heads only: the others would draft tokens nobody verifies) plus the
trunk's hidden states per slot (final and last-block input, [P, Z, D] each). Every program runs
the heads over the window the target just computed (each position with the token after it), so
their pool keeps up; a round first re-runs them at the last computed position (an idempotent
rewrite) from the stored hidden states to draft, verifies, then runs them over the round's
window.

`programs(graphdef, draft_graphdef)` returns the jitted programs with the graphs bound in, made
once per pair: a step then hashes no graph, only its arrays' shapes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax.cache.paged import PagedCache
from atlas_jax.decoding.sampling import (
  MAX_LOGPROBS,
  SamplingArrays,
  mask_logits,
  probabilities,
  sample_rows,
  step_keys,
)
from atlas_jax.decoding.speculative import draw, heads_drafts, round_keys, round_tokens

Array = jax.Array
MTP = "mtp"  # `draft_graphdef` for self-speculation with the model's own MTP heads


def _slots(block_table_BM, positions_BT, block_size: int):
  """i32[B, T] each position's slot in a [P * Z] flattening of the pool; -1 where padding."""
  at_BT = jnp.maximum(positions_BT, 0)
  block_BT = jnp.take_along_axis(block_table_BM, at_BT // block_size, axis=1)
  return jnp.where(positions_BT >= 0, block_BT * block_size + at_BT % block_size, -1)


def _mtp_window(model, side, block_table_BM, lengths_B, positions_BT, next_BT, hidden, at_B):
  """The MTP heads over a window the target computed: its hidden states stored per slot, the
  heads' pool written, and their logits at window index `at_B`: (side, f32[J, B, V])."""
  m_pool, final_PZD, trunk_PZD = side
  P, Z, D = final_PZD.shape
  final_BTD, trunk_BTD = hidden
  slots_BT = _slots(block_table_BM, positions_BT, Z)
  slots_BT = jnp.where(slots_BT >= 0, slots_BT, P * Z)  # out of range: dropped

  def store(a_PZD, x_BTD):
    flat = a_PZD.reshape(P * Z, D).at[slots_BT].set(x_BTD.astype(a_PZD.dtype), mode="drop")
    return flat.reshape(P, Z, D)

  cache = PagedCache(pool=m_pool, block_table=block_table_BM, lengths=lengths_B)
  n_heads = jax.tree.leaves(m_pool)[0].shape[0]  # the engine pools the k heads it drafts with
  logits_JBV, cache = model.mtp.draft(
    cache,
    next_tokens_BT=next_BT,
    trunk_BTD=trunk_BTD,
    final_BTD=final_BTD,
    positions_BT=positions_BT,
    at_B=at_B,
    embed_VD=model.embed[...],
    head_DV=model._head_DV(),
    n_heads=n_heads,
  )
  return (cache.pool, store(final_PZD, final_BTD), store(trunk_PZD, trunk_BTD)), logits_JBV


def _next_tokens(tokens_BT, last_B, token_B):
  """i32[B, T] the token after each position: the row shifted left, then the drawn token."""
  t_1T = jnp.arange(tokens_BT.shape[1])[None, :]
  shifted_BT = jnp.roll(tokens_BT, -1, axis=1)
  return jnp.where(t_1T == last_B[:, None], token_B[:, None], shifted_BT)


def _draft_forward(d_graphdef, d_state, d_pool, tokens_BT, positions_BT, block_table_BM, lengths_B):
  """The draft over the target's new tokens, into its own pool; its logits are not needed."""
  if d_graphdef is None or d_graphdef == MTP:
    return d_pool
  draft = nnx.merge(d_graphdef, d_state)
  cache = PagedCache(pool=d_pool, block_table=block_table_BM, lengths=lengths_B)
  last_B = jnp.zeros(tokens_BT.shape[:1], jnp.int32)  # one position's head: the cheapest
  _, cache = draft(tokens_BT, positions_BT=positions_BT, cache=cache, logits_at_B=last_B)
  return cache.pool


def forward_sample(
  graphdef,
  d_graphdef,
  states,
  pools,
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
    (pools, i32[B] tokens, f32[B] logprobs, i32[B, 5] top tokens, f32[B, 5] top logprobs).
  """
  (state, d_state), (pool, d_pool) = states, pools
  model = nnx.merge(graphdef, state)
  cache = PagedCache(pool=pool, block_table=block_table_BM, lengths=lengths_B)
  mtp = d_graphdef == MTP
  logits_B1V, cache, *hidden = model(
    tokens_BT, positions_BT=positions_BT, cache=cache, logits_at_B=last_B, return_hidden=mtp
  )
  d_pool = _draft_forward(
    d_graphdef, d_state, d_pool, tokens_BT, positions_BT, block_table_BM, lengths_B
  )
  out = sample_rows(
    logits_B1V[:, 0],
    step_keys(seed_B, step_B),
    arrays,
    counts_BV=counts_BV if penalties else None,
    prompt_mask_BV=prompt_mask_BV if penalties else None,
  )
  if mtp:
    next_BT = _next_tokens(tokens_BT, last_B, out[0])
    d_pool, _ = _mtp_window(
      model, d_pool, block_table_BM, lengths_B, positions_BT, next_BT, hidden[0], last_B
    )
  return ((cache.pool, d_pool), *out)


def decode_burst(
  graphdef,
  d_graphdef,
  states,
  pools,
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
    (pools, i32[K, B] tokens, f32[K, B] logprobs, i32[K, B, 5] top ids, f32[K, B, 5] top logprobs,
    i32[B, V] counts after the burst, or None without penalties).
  """
  if arrays.allowed_bits is not None:
    raise ValueError("decode_burst: a guided row's mask needs the host after every token")
  (state, d_state) = states
  model = nnx.merge(graphdef, state)
  valid_B = lengths_B >= 0
  B = tokens_B.shape[0]

  def body(carry, k):
    (pool, d_pool), token_B, counts_BV = carry
    positions_B1 = jnp.where(valid_B, lengths_B + k, -1)[:, None]
    at_B = positions_B1[:, 0] + ~valid_B  # padding rows: 0
    cache = PagedCache(pool=pool, block_table=block_table_BM, lengths=at_B)
    mtp = d_graphdef == MTP
    logits_B1V, cache, *hidden = model(
      token_B[:, None], positions_BT=positions_B1, cache=cache, return_hidden=mtp
    )
    d_pool = _draft_forward(
      d_graphdef, d_state, d_pool, token_B[:, None], positions_B1, block_table_BM, at_B
    )
    out = sample_rows(
      logits_B1V[:, 0],
      step_keys(seed_B, step_B + k),
      arrays,
      counts_BV=counts_BV if penalties else None,
      prompt_mask_BV=prompt_mask_BV if penalties else None,
    )
    if mtp:
      zero_B = jnp.zeros_like(at_B)
      d_pool, _ = _mtp_window(
        model, d_pool, block_table_BM, at_B, positions_B1, out[0][:, None], hidden[0], zero_B
      )
    if penalties:
      counts_BV = counts_BV.at[jnp.arange(B), out[0]].add(1)
    return ((cache.pool, d_pool), out[0], counts_BV), out

  (pools, _, counts_BV), outs = jax.lax.scan(
    body, (pools, tokens_B, counts_BV), jnp.arange(n_steps)
  )
  return (pools, *outs, counts_BV)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundRows:
  """What a speculative round takes per row (B rows, padded to a power of two)."""

  tokens_B: Array  # i32[B] each row's pending token, at position lengths_B
  lengths_B: Array  # i32[B] tokens in the pool; -1: a padding row
  block_table_BM: Array  # i32[B, M] covering positions up to lengths + k
  seed_B: Array  # i32[B]
  step_B: Array  # i32[B] the index of the round's first emitted token: its keys are
  # `round_keys(seed, step)`, as in `generate`'s speculative loop
  arrays: SamplingArrays


def speculative_round(graphdef, d_graphdef, states, pools, rows: RoundRows, k: int):
  """One round of speculation for every row (`atlas_jax.decoding.speculative`): the draft half
  and the verify half in one program.

  The draft runs k + 1 single-token steps from each row's pending token (the last only writes
  d_k's K/V, so the draft pool keeps up with the target's); the target runs once over
  [pending, d_1..d_k]; `verify` keeps a_b drafts of row b and draws the token after them. Both
  pools then hold K/V for positions up to lengths + k; the host keeps lengths + 1 + a_b of them
  (cut at stops), and the next round overwrites the rest.

  Returns:
    (pools, i32[k+1, B] emitted tokens (row b's first a_b + 1 are real), f32[k+1, B] their target
    logprobs, i32[k+1, B, 5] top ids, f32[k+1, B, 5] top logprobs, i32[B] accepted drafts a_b).
  """
  pools, draft_BJ, q_BJV = speculative_draft(graphdef, d_graphdef, states, pools, rows, k)
  return speculative_verify(graphdef, d_graphdef, states, pools, rows, draft_BJ, q_BJV, None)


def speculative_draft(graphdef, d_graphdef, states, pools, rows: RoundRows, k: int):
  """The draft half of a round.

  With `rows.arrays.allowed_bits` (guided rows), each row's first draft is drawn under its
  current mask; later drafts are not masked, since their masks depend on the drafts before them:
  the host walks them through the grammar and `speculative_verify` masks the target there.

  Returns:
    (pools, i32[B, k] draft tokens, f32[B, k, V] the distributions they were drawn from).
  """
  (state, d_state), (pool, d_pool) = states, pools
  keys_BK = round_keys(rows.seed_B, rows.step_B, k + 1)
  if d_graphdef == MTP:
    drafts = _mtp_drafts(nnx.merge(graphdef, state), d_pool, rows, keys_BK, k)
  else:
    drafts = _model_drafts(nnx.merge(d_graphdef, d_state), d_pool, rows, keys_BK, k)
  d_pool, draft_BJ, q_BJV = drafts
  return (pool, d_pool), draft_BJ, q_BJV


def speculative_verify(
  graphdef, d_graphdef, states, pools, rows: RoundRows, draft_BJ, q_BJV, allowed_BTW
):
  """The verify half of a round: the target over [pending, d_1..d_k], the rejection sampler,
  and (MTP) the heads over the round's window. Returns what `speculative_round` returns.

  Args:
    draft_BJ, q_BJV: `speculative_draft`'s drafts and their distributions.
    allowed_BTW: i32[B, k+1, W] the allowed tokens at each of the k + 1 positions (guided rows'
      from their grammar after the drafts before it, all set for the others), or None. A draft
      the mask refuses has target probability 0, so it is rejected there: the law of every
      emitted token is the target's masked one, whatever the drafts were.
  """
  (state, _), (pool, d_pool) = states, pools
  model = nnx.merge(graphdef, state)
  k = draft_BJ.shape[1]
  tokens_B, lengths_B, block_table_BM = rows.tokens_B, rows.lengths_B, rows.block_table_BM
  valid_B = lengths_B >= 0
  start_B = jnp.where(valid_B, lengths_B, 0)
  keys_BK = round_keys(rows.seed_B, rows.step_B, k + 1)
  offsets_1T = jnp.arange(k + 1)[None, :]
  positions_BT = jnp.where(valid_B[:, None], lengths_B[:, None] + offsets_1T, -1)
  tokens_BT = jnp.concatenate([tokens_B[:, None], draft_BJ], axis=1)
  cache = PagedCache(pool=pool, block_table=block_table_BM, lengths=start_B)
  logits_BTV, cache, *hidden = model(
    tokens_BT, positions_BT=positions_BT, cache=cache, return_hidden=d_graphdef == MTP
  )
  a_B, _, new_BT, logp_BTV = round_tokens(
    logits_BTV, q_BJV, draft_BJ, keys_BK[:, k], rows.arrays, allowed_BTW
  )
  if d_graphdef == MTP:  # the heads over the round's window, each position with its next token
    d_pool, _ = _mtp_window(
      model, d_pool, block_table_BM, start_B, positions_BT, new_BT, hidden[0], a_B
    )
  lp_BT = jnp.take_along_axis(logp_BTV, new_BT[..., None], axis=-1)[..., 0]
  top_lp_BTK, top_ids_BTK = jax.lax.top_k(logp_BTV, min(MAX_LOGPROBS, logp_BTV.shape[-1]))
  return (
    (cache.pool, d_pool),
    new_BT.T,
    lp_BT.T,
    top_ids_BTK.astype(jnp.int32).transpose(1, 0, 2),
    top_lp_BTK.transpose(1, 0, 2),
    a_B,
  )


def _first_masked(logits_BV, arrays: SamplingArrays, j):
  """A guided row's first draft is drawn under its mask (`speculative_draft`)."""
  if arrays.allowed_bits is None:
    return logits_BV
  return jnp.where(j == 0, mask_logits(logits_BV, arrays.allowed_bits), logits_BV)


def _model_drafts(draft, d_pool, rows: RoundRows, keys_BK, k):
  """A draft model's k tokens per row and the distributions they were drawn from: (d_pool,
  i32[B, k], f32[B, k, V])."""
  lengths_B, block_table_BM, arrays = rows.lengths_B, rows.block_table_BM, rows.arrays
  valid_B = lengths_B >= 0

  def draft_step(carry, j):
    d_pool, x_B = carry
    positions_B1 = jnp.where(valid_B, lengths_B + j, -1)[:, None]
    at_B = jnp.where(valid_B, lengths_B + j, 0)
    cache = PagedCache(pool=d_pool, block_table=block_table_BM, lengths=at_B)
    logits_B1V, cache = draft(x_B[:, None], positions_BT=positions_B1, cache=cache)
    q_BV = probabilities(_first_masked(logits_B1V[:, 0], arrays, j), arrays)
    d_B = draw(keys_BK[:, j], q_BV)  # the last step's draw is not used
    return (cache.pool, d_B), (d_B, q_BV)

  (d_pool, _), (d_JB, q_JBV) = jax.lax.scan(draft_step, (d_pool, rows.tokens_B), jnp.arange(k + 1))
  return d_pool, d_JB[:k].T, q_JBV[:k].transpose(1, 0, 2)


def _mtp_drafts(model, side, rows: RoundRows, keys_BK, k):
  """The MTP heads' k tokens per row, drafted at the last computed position (its hidden states
  read back from their slots, the pending token as its next): (side, i32[B, k], f32[B, k, V])."""
  lengths_B, block_table_BM, arrays = rows.lengths_B, rows.block_table_BM, rows.arrays
  _, final_PZD, trunk_PZD = side
  P, Z, D = final_PZD.shape
  last_B1 = jnp.where(lengths_B >= 1, lengths_B - 1, -1)[:, None]
  slots_B1 = _slots(block_table_BM, last_B1, Z)
  read = lambda a_PZD: a_PZD.reshape(P * Z, D)[jnp.maximum(slots_B1, 0)]
  hidden = (read(final_PZD), read(trunk_PZD))
  at_B = jnp.zeros(lengths_B.shape, jnp.int32)
  start_B = jnp.maximum(last_B1[:, 0], 0)
  side, logits_JBV = _mtp_window(
    model, side, block_table_BM, start_B, last_B1, rows.tokens_B[:, None], hidden, at_B
  )
  logits_JBV = logits_JBV[:k].at[0].set(_first_masked(logits_JBV[0], arrays, 0))
  return side, *heads_drafts(logits_JBV, keys_BK, arrays)


def prompt_logprobs(graphdef, d_graphdef, states_target, tokens_1T):
  """Log-probabilities of a prompt's tokens under the model.

  Args:
    states_target: the model's state (the target half of `states`).
    tokens_1T: i32[1, T] the prompt, right-padded.

  Returns:
    (f32[T] at position t the logprob of token t + 1, i32[T, 5] the top tokens there, f32[T, 5]
    their logprobs); the last real position's and the padding's values are not used.
  """
  del d_graphdef  # the draft plays no part
  model = nnx.merge(graphdef, states_target)
  logp_TV = jax.nn.log_softmax(model(tokens_1T)[0].astype(jnp.float32), axis=-1)
  next_T = jnp.roll(tokens_1T[0], -1)
  lp_T = jnp.take_along_axis(logp_TV, next_T[:, None], axis=-1)[:, 0]
  top_lp_TK, top_ids_TK = jax.lax.top_k(logp_TV, min(MAX_LOGPROBS, logp_TV.shape[-1]))
  return lp_T, top_ids_TK.astype(jnp.int32), top_lp_TK


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_blocks(pool, src_N, dst_N):
  """Copies pool blocks src -> dst (i32[N] each) in every layer; the pool is donated."""
  return jax.tree.map(lambda a_LPZ_: a_LPZ_.at[:, dst_N].set(a_LPZ_[:, src_N]), pool)


@dataclasses.dataclass(frozen=True)
class Programs:
  """The jitted step programs of one model graph (the arguments after `graphdef`)."""

  forward_sample: Callable
  decode_burst: Callable
  speculative_round: Callable | None  # with a draft model only
  speculative_draft: Callable | None  # the round in two halves, for guided rows: the host
  speculative_verify: Callable | None  # walks the drafts through each grammar in between
  prompt_logprobs: Callable


@functools.cache
def programs(graphdef, draft_graphdef=None) -> Programs:
  """The step programs with the graphs bound, compiled lazily per shape; one set per pair.
  `draft_graphdef`: a draft model's graph, `MTP` for the model's own heads, or None."""
  bind = lambda f: functools.partial(f, graphdef, draft_graphdef)
  speculate = draft_graphdef is not None
  return Programs(
    forward_sample=jax.jit(bind(forward_sample), static_argnums=(10,), donate_argnums=(1,)),
    decode_burst=jax.jit(bind(decode_burst), static_argnums=(9, 10), donate_argnums=(1,)),
    speculative_round=jax.jit(bind(speculative_round), static_argnums=(3,), donate_argnums=(1,))
    if speculate
    else None,
    speculative_draft=jax.jit(bind(speculative_draft), static_argnums=(3,), donate_argnums=(1,))
    if speculate
    else None,
    speculative_verify=jax.jit(bind(speculative_verify), donate_argnums=(1,))
    if speculate
    else None,
    prompt_logprobs=jax.jit(bind(prompt_logprobs)),
  )
