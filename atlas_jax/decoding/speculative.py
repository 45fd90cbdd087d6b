"""Speculative decoding: a cheap draft proposes k tokens, the target checks them in one pass.

Each round, per row: the draft samples d_1..d_k autoregressively from its distributions q_j; the
target runs once over [pending, d_1..d_k] and gives its distributions p_0..p_k; draft token d_j is
accepted with probability min(1, p_{j-1}(d_j) / q_j(d_j)) while every earlier one was; at the first
rejection a token is drawn from the residual max(p - q, 0) renormalised, and when all k are
accepted a bonus token is drawn from p_k. So every round emits between 1 and k + 1 tokens, and
each is distributed exactly as the target's own next token (Leviathan et al. 2023, Chen et al.
2023): speculation changes the speed, never the law. Sampling controls (temperature, top-k,
top-p, min-p) shape p and q identically (`sampling.probabilities`); a greedy row has one-hot p and
q, so it accepts while the argmaxes agree and emits exactly the plain greedy tokens.

Drafts come from a drafter (`atlas_jax.decoding.drafters`): another model with the same
vocabulary, "mtp", the target's own multi-token-prediction heads, or "ngram", prompt lookup (a
deterministic proposal: q one-hot, so x is accepted with probability p(x); a position proposing
nothing has q = 0 and is never accepted, its residual p itself). The round is written once
here (`verify_drafts`, `round_tokens`) for `generate`'s static loop below and the serving
engine's rounds (`atlas_jax.serving.steps`).

Rejected positions are rolled back by resetting each cache's lengths: entries past a row's
length are never read, and the next round overwrites them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from atlas_jax.decoding import batching
from atlas_jax.decoding.drafters import (
  DraftCache,
  Drafter,
  MTPDrafter,
  NGramDrafter,
  Window,
  hidden_store,
  make_drafter,
)
from atlas_jax.decoding.sampling import (
  MAX_LOGPROBS,
  SamplingArrays,
  SamplingParams,
  mask_logits,
  probabilities,
  sample_rows,
  step_keys,
)

Array = jax.Array


# -- the rejection sampler -----------------------------------------------------------------------


def acceptance_probability(p_V: Array, q_V: Array) -> Array:
  """f32[V]: the chance a draft token x ~ q is accepted, min(1, p(x) / q(x)) (1 where q = 0)."""
  return jnp.where(q_V > 0, jnp.minimum(1.0, p_V / jnp.where(q_V > 0, q_V, 1.0)), 1.0)


def residual(p_V: Array, q_V: Array) -> Array:
  """f32[V]: the law of the replacement token after a rejection, max(p - q, 0) normalised.

  Where the residual vanishes (p = q), rejection cannot happen; p is returned so the draw stays
  well defined.
  """
  r_V = jnp.maximum(p_V - q_V, 0.0)
  total = r_V.sum(-1, keepdims=True)
  return jnp.where(total > 0, r_V / jnp.where(total > 0, total, 1.0), p_V)


def verify(p_BJV: Array, q_BJV: Array, draft_BJ: Array, key_B: Array) -> tuple[Array, Array]:
  """The rejection sampler, vectorised over rows.

  Args:
    p_BJV: f32[B, J + 1, V] the target's distributions at the pending token and each draft token.
    q_BJV: f32[B, J, V] the draft's distributions each draft token was drawn from (one-hot for a
      deterministic proposal; all zeros where nothing was proposed).
    draft_BJ: i32[B, J] the draft tokens (J draft positions).
    key_B: [B] one key per row.

  Returns:
    (i32[B] accepted drafts a, i32[B] the token after them: the residual draw at the first
    rejection, or the bonus draw from p_J when all J were accepted).
  """
  B, J = draft_BJ.shape
  k_accept, k_next = jax.vmap(lambda k: jax.random.split(k, 2))(key_B).transpose(1, 0)
  u_BJ = jax.vmap(lambda k: jax.random.uniform(k, (J,)))(k_accept)
  p_at_BJ = jnp.take_along_axis(p_BJV[:, :J], draft_BJ[..., None], axis=-1)[..., 0]
  q_at_BJ = jnp.take_along_axis(q_BJV, draft_BJ[..., None], axis=-1)[..., 0]
  # u < p / q without the division; q > 0 for a token drawn from q. A position where q is all
  # zeros proposed nothing (a prompt-lookup row with fewer than J drafts): never accepted, and
  # its residual max(p - 0, 0) is p, the plain draw.
  accept_BJ = (u_BJ * q_at_BJ < p_at_BJ) & (q_at_BJ > 0)
  a_B = jnp.sum(jnp.cumprod(accept_BJ, axis=1), axis=1).astype(jnp.int32)
  # A zero row after the last draft makes the bonus case the residual of p_J against nothing.
  q_pad_BJV = jnp.concatenate([q_BJV, jnp.zeros_like(q_BJV[:, :1])], axis=1)
  take_a = lambda x: jnp.take_along_axis(x, a_B[:, None, None], axis=1)[:, 0]
  r_BV = residual(take_a(p_BJV), take_a(q_pad_BJV))
  next_B = jax.vmap(jax.random.categorical)(k_next, jnp.log(r_BV)).astype(jnp.int32)
  return a_B, next_B


def round_keys(seed_B: Array, step_B: Array, n: int) -> Array:
  """[B, n] keys for the round whose first emitted token is the row's `step_B`-th."""
  base_B = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seed_B, step_B)
  # Plain decoding uses the base key itself for its draw; speculation branches off it.
  return jax.vmap(lambda k: jax.random.split(jax.random.fold_in(k, 0x5EC), n))(base_B)


def probabilities_per_position(logits_BJV: Array, arrays: SamplingArrays) -> Array:
  """`probabilities` at every position: f32[B, J, V]."""
  B, J, V = logits_BJV.shape
  rep = jax.tree.map(lambda a: jnp.repeat(a, J, axis=0), arrays)
  return probabilities(logits_BJV.reshape(B * J, V), rep).reshape(B, J, V)


def round_tokens(
  logits_BTV: Array,
  q_BJV: Array,
  draft_BJ: Array,
  key_B: Array,
  arrays: SamplingArrays,
  allowed_BTW: Array | None = None,
):
  """The target's side of a round: its distributions at the k + 1 positions (masked by
  `allowed_BTW`, i32[B, k+1, W] packed allowed tokens, when given), the rejection sampler, the
  emitted tokens.

  Returns:
    (i32[B] accepted drafts a; i32[B] the token after them; i32[B, k+1] the accepted drafts, then
    that token, then filler; f32[B, k+1, V] the target's log-probabilities, unmasked, as logprobs
    are reported).
  """
  B, T, V = logits_BTV.shape
  p_logits_BTV = logits_BTV
  if allowed_BTW is not None:
    p_logits_BTV = mask_logits(logits_BTV.reshape(B * T, V), allowed_BTW.reshape(B * T, -1))
    p_logits_BTV = p_logits_BTV.reshape(B, T, V)
  a_B, next_B = verify(probabilities_per_position(p_logits_BTV, arrays), q_BJV, draft_BJ, key_B)
  drafts_BT = jnp.concatenate([draft_BJ, jnp.zeros_like(draft_BJ[:, :1])], axis=1)
  new_BT = jnp.where(jnp.arange(T)[None, :] < a_B[:, None], drafts_BT, next_B[:, None])
  return a_B, next_B, new_BT, jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verified:
  """What the target's pass over a round's [pending, d_1..d_k] gives."""

  cache: object  # the target's cache, holding k + 1 more positions per row
  accepted_B: Array  # i32[B] drafts accepted, a
  new_BT: Array  # i32[B, k+1] the a accepted drafts, the token after them, then filler
  logp_BTV: Array  # f32[B, k+1, V] the target's log-probabilities, unmasked (as reported)
  window: Window  # the round's positions, for the drafter's `follow`


def verify_drafts(
  target, cache, pending_B, lengths_B, draft_BJ, q_BJV, key_B, arrays, *, hidden, allowed_BTW=None
) -> Verified:
  """The target over [pending, d_1..d_k] at positions lengths.., then the rejection sampler.

  Args:
    cache: the target's cache holding `lengths_B` tokens per row (-1: a padding row, which
      writes nothing).
    key_B: each row's key for the sampler (`round_keys(...)[:, k]`).
    hidden: also keep the target's hidden states in the window (an MTP drafter follows them).
    allowed_BTW: i32[B, k+1, W] allowed tokens at each position (guided rows), or None.
  """
  k = draft_BJ.shape[1]
  valid_B = lengths_B >= 0
  start_B = jnp.where(valid_B, lengths_B, 0)
  positions_BT = jnp.where(valid_B[:, None], lengths_B[:, None] + jnp.arange(k + 1)[None, :], -1)
  tokens_BT = jnp.concatenate([pending_B[:, None], draft_BJ], axis=1)
  logits_BTV, cache, *states = target(
    tokens_BT, positions_BT=positions_BT, cache=cache.replace(lengths=start_B), return_hidden=hidden
  )
  a_B, _, new_BT, logp_BTV = round_tokens(logits_BTV, q_BJV, draft_BJ, key_B, arrays, allowed_BTW)
  first_B = jnp.where(valid_B, jnp.arange(valid_B.shape[0]) * (k + 1), -1)
  hidden_states = states[0] if hidden else None
  window = Window(tokens_BT, positions_BT, start_B, new_BT, a_B, hidden_states, first_B)
  return Verified(cache, a_B, new_BT, logp_BTV, window)


def top_logprobs(logp_BTV: Array, tokens_BT: Array):
  """(f32[B, T] each token's logprob, i32[B, T, 5] the top ids, f32[B, T, 5] their logprobs)."""
  lp_BT = jnp.take_along_axis(logp_BTV, tokens_BT[..., None], axis=-1)[..., 0]
  top_lp_BTk, top_ids_BTk = jax.lax.top_k(logp_BTV, min(MAX_LOGPROBS, logp_BTV.shape[-1]))
  return lp_BT, top_ids_BTk.astype(jnp.int32), top_lp_BTk


# -- the static-batch loop -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SpeculativeStats:
  """What a speculative generation did, summed over rows."""

  rounds: int  # target forward passes in the decode loop (batched: one per round)
  row_rounds: int  # rounds counted per live row: the target passes each row needed
  emitted: int  # tokens emitted by the decode loop (the first token comes from the prefill)
  drafted: int  # draft positions offered to the target: k per live row and round (prompt lookup
  # may fill fewer of them; an empty one is never accepted)
  accepted: int  # of those, accepted

  @property
  def mean_acceptance_length(self) -> float:
    """Tokens emitted per target pass of a row: accepted drafts + 1 (cut at stops)."""
    return self.emitted / max(self.row_rounds, 1)


def _emit(out_BO, logp_BO, i_B, new_BJ, newlp_BJ, n_B):
  """Writes each row's first n_B[b] new tokens at its offset i_B[b]."""
  B, J = new_BJ.shape
  cols_BJ = i_B[:, None] + jnp.arange(J)[None, :]
  cols_BJ = jnp.where(jnp.arange(J)[None, :] < n_B[:, None], cols_BJ, out_BO.shape[1])  # dropped
  rows_BJ = jnp.broadcast_to(jnp.arange(B)[:, None], (B, J))
  out_BO = out_BO.at[rows_BJ, cols_BJ].set(new_BJ, mode="drop")
  logp_BO = logp_BO.at[rows_BJ, cols_BJ].set(newlp_BJ, mode="drop")
  return out_BO, logp_BO


def _cut(new_BJ, n_B, i_B, limits_B, stop_Bs, done_B):
  """Cuts each row's new tokens at its first stop token or its limit: (n_B, done_B)."""
  J = new_BJ.shape[1]
  j_1J = jnp.arange(J)[None, :]
  is_stop_BJ = jnp.any(new_BJ[..., None] == stop_Bs[:, None, :], axis=-1) & (j_1J < n_B[:, None])
  first_stop_B = jnp.where(is_stop_BJ.any(1), jnp.argmax(is_stop_BJ, axis=1), J)
  n_B = jnp.minimum(n_B, first_stop_B + 1)
  n_B = jnp.minimum(n_B, limits_B - i_B)
  n_B = jnp.where(done_B, 0, n_B)
  done_B = done_B | is_stop_BJ.any(1) | (i_B + n_B >= limits_B)
  return n_B, done_B


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundCarry:
  """The static loop's state between rounds."""

  rounds: Array  # i32[] rounds run
  t_cache: object  # the target's cache: each row's prompt and emitted tokens but the pending one
  dcache: DraftCache  # the drafter's, at the same lengths
  pending_B: Array  # i32[B] each row's last emitted token, in no cache yet
  i_B: Array  # i32[B] tokens emitted per row
  out_BO: Array  # i32[B, O] emitted tokens (O: max_new + k + 1, past a row's end: dropped)
  logp_BO: Array  # f32[B, O] their target logprobs
  done_B: Array  # bool[B] rows that stopped
  stats: Array  # i32[5] the SpeculativeStats counts


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _loop(
  t_graphdef,
  drafter: Drafter,
  max_new: int,
  k: int,
  t_state,
  d_params,
  t_cache,
  dcache,
  first_B,
  seed_B,
  arrays: SamplingArrays,
  limits_B,
  stop_Bs,
):
  """Rounds of propose-then-verify until every row stops.

  Returns:
    (i32[B, max_new] tokens, f32[B, max_new] target logprobs, i32[5] the SpeculativeStats
    counts).
  """
  target = nnx.merge(t_graphdef, t_state)
  B = first_B.shape[0]
  width = max_new + k + 1

  def cond(c: RoundCarry):
    return ~jnp.all(c.done_B) & (c.rounds < max_new)

  def body(c: RoundCarry):
    keys_BT = round_keys(seed_B, c.i_B, k + 1)
    base_B = c.t_cache.lengths
    dcache, draft_BJ, q_BJV = drafter.propose(
      d_params, target, c.dcache, c.pending_B, base_B, keys_BT, arrays, k
    )
    v = verify_drafts(
      target,
      c.t_cache,
      c.pending_B,
      base_B,
      draft_BJ,
      q_BJV,
      keys_BT[:, k],
      arrays,
      hidden=drafter.needs_hidden,
    )
    newlp_BT = jnp.take_along_axis(v.logp_BTV, v.new_BT[..., None], axis=-1)[..., 0]
    n_B, done_B = _cut(v.new_BT, v.accepted_B + 1, c.i_B, limits_B, stop_Bs, c.done_B)
    out_BO, logp_BO = _emit(c.out_BO, c.logp_BO, c.i_B, v.new_BT, newlp_BT, n_B)
    dcache = drafter.follow(d_params, target, dcache, v.window, in_round=True)
    # Roll back both caches to the pending token and the accepted drafts; a finished row stays
    # where it was (its later rounds are discarded), so no cache ever runs past its capacity.
    kept_B = jnp.where(~c.done_B, base_B + 1 + v.accepted_B, base_B)
    live_B = ~c.done_B
    n_live = jnp.sum(live_B)
    accepted = jnp.sum(jnp.where(live_B, v.accepted_B, 0))
    stats = jnp.stack([1, n_live, jnp.sum(n_B), k * n_live, accepted]).astype(jnp.int32)
    next_B = jnp.take_along_axis(v.new_BT, v.accepted_B[:, None], axis=1)[:, 0]
    return RoundCarry(
      rounds=c.rounds + 1,
      t_cache=v.cache.replace(lengths=kept_B),
      dcache=dcache.at(kept_B),
      pending_B=next_B,
      i_B=c.i_B + n_B,
      out_BO=out_BO,
      logp_BO=logp_BO,
      done_B=done_B,
      stats=c.stats + stats,
    )

  carry = RoundCarry(
    rounds=jnp.int32(0),
    t_cache=t_cache,
    dcache=dcache,
    pending_B=first_B,
    i_B=jnp.ones((B,), jnp.int32),
    out_BO=jnp.zeros((B, width), jnp.int32).at[:, 0].set(first_B),
    logp_BO=jnp.zeros((B, width), jnp.float32),
    done_B=jnp.any(first_B[:, None] == stop_Bs, axis=1) | (limits_B <= 1),
    stats=jnp.zeros((5,), jnp.int32),
  )
  carry = jax.lax.while_loop(cond, body, carry)
  return carry.out_BO[:, :max_new], carry.logp_BO[:, :max_new], carry.stats


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(4, 5))
def _start(
  t_graphdef,
  drafter: Drafter,
  t_state,
  d_params,
  t_cache,
  dcache,
  tokens_BT,
  lengths_B,
  seed_B,
  arrays,
):
  """The prompts through the target, the first token drawn as plain decoding draws it, and the
  drafter caught up: (first_B, its logprob, both caches at the prompts' lengths)."""
  logits_BV, t_cache, *hidden = batching.prefill(
    t_graphdef, t_state, tokens_BT, t_cache, lengths_B, drafter.needs_hidden
  )
  first_B, first_lp_B, _, _ = sample_rows(
    logits_BV, step_keys(seed_B, jnp.zeros_like(seed_B)), arrays
  )
  target = nnx.merge(t_graphdef, t_state)
  B, T = tokens_BT.shape
  last_B = lengths_B - 1
  # The token after each prompt position: the prompt shifted, then the first generated token.
  t_1T = jnp.arange(T)[None, :]
  next_BT = jnp.where(t_1T == last_B[:, None], first_B[:, None], jnp.roll(tokens_BT, -1, axis=1))
  window = Window(
    tokens_BT=tokens_BT,
    positions_BT=jnp.broadcast_to(t_1T, (B, T)),
    lengths_B=jnp.zeros_like(lengths_B),
    next_BT=next_BT,
    at_B=last_B,
    hidden=hidden[0] if hidden else None,
  )
  dcache = drafter.follow(d_params, target, dcache, window)
  return first_B, first_lp_B, t_cache, dcache.at(lengths_B)


def speculative_generate(
  model,
  draft,
  prompts: Sequence[Sequence[int]],
  per_row: Sequence[SamplingParams],
  *,
  stops: list[list[int]],
  k: int,
) -> tuple[np.ndarray, np.ndarray, SpeculativeStats]:
  """Speculative decoding of a static batch; `generate(..., draft=...)` calls this.

  Returns:
    (i32[B, max_new] tokens, f32[B, max_new] their target logprobs, the statistics); row b's
    output ends at its first stop token or its max_new_tokens.
  """
  drafter = make_drafter(model, draft, k)
  B = len(prompts)
  max_new = max(p.max_new_tokens for p in per_row)
  tokens_BT, lengths_B = batching.pad_prompts(prompts)
  capacity = tokens_BT.shape[1] + batching.bucket(max_new + k + 1)
  arrays = SamplingArrays.from_params(per_row)
  seed_B = jnp.asarray([p.seed for p in per_row], jnp.int32)
  t_graphdef, t_state = nnx.split(model)
  d_params = None
  if isinstance(drafter, MTPDrafter):  # the model's own heads, and the hidden states they read
    cfg = model.cfg
    cache = model.mtp.init_cache(cfg, B, capacity, jnp.dtype(cfg.dtype), n_heads=drafter.n_heads)
    store = hidden_store(cfg, B, capacity, cfg.dtype)
    dcache = DraftCache(cache, jnp.zeros(store.shape, store.dtype))
  elif isinstance(drafter, NGramDrafter):  # the rows' tokens, looked up on the device
    dcache = DraftCache(drafter.init_cache(B, capacity))
  else:
    d_params = nnx.state(draft)
    dcache = DraftCache(draft.init_cache(B, capacity))
  first_B, first_lp_B, t_cache, dcache = _start(
    t_graphdef,
    drafter,
    t_state,
    d_params,
    model.init_cache(B, capacity),
    dcache,
    jnp.asarray(tokens_BT),
    jnp.asarray(lengths_B),
    seed_B,
    arrays,
  )
  out_BO, logp_BO, stats = _loop(
    t_graphdef,
    drafter,
    max_new,
    k,
    t_state,
    d_params,
    t_cache,
    dcache,
    first_B,
    seed_B,
    arrays,
    jnp.asarray([p.max_new_tokens for p in per_row], jnp.int32),
    jnp.asarray(batching.stop_table(stops)),
  )
  logp_BO = logp_BO.at[:, 0].set(first_lp_B)
  return np.asarray(out_BO), np.asarray(logp_BO), SpeculativeStats(*map(int, np.asarray(stats)))
