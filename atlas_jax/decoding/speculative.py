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

Drafts: another model with the same vocabulary (its own contiguous cache, rolled back like the
target's), or "mtp", the target's own multi-token-prediction heads (`atlas_jax.model.mtp`),
which draft from the target's last hidden states with no second model.

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

from atlas_jax.decoding.sampling import (
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
    q_BJV: f32[B, J, V] the draft's distributions each draft token was drawn from.
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
  # u < p / q without the division; q > 0 for a token drawn from q.
  accept_BJ = u_BJ * q_at_BJ < p_at_BJ
  a_B = jnp.sum(jnp.cumprod(accept_BJ, axis=1), axis=1).astype(jnp.int32)
  # A zero row after the last draft makes the bonus case the residual of p_J against nothing.
  q_pad_BJV = jnp.concatenate([q_BJV, jnp.zeros_like(q_BJV[:, :1])], axis=1)
  take_a = lambda x: jnp.take_along_axis(x, a_B[:, None, None], axis=1)[:, 0]
  r_BV = residual(take_a(p_BJV), take_a(q_pad_BJV))
  next_B = jax.vmap(jax.random.categorical)(k_next, jnp.log(r_BV)).astype(jnp.int32)
  return a_B, next_B


def draw(key_B: Array, probs_BV: Array) -> Array:
  """i32[B]: one token per row from its distribution (the argmax of a one-hot, exactly)."""
  return jax.vmap(jax.random.categorical)(key_B, jnp.log(probs_BV)).astype(jnp.int32)


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


def heads_drafts(logits_JBV: Array, keys_BK: Array, arrays: SamplingArrays):
  """Drafts from J heads' next-token logits at once (MTP heads do not read each other's draws):
  (i32[B, J] one draw from each head's distribution, with the round's keys; f32[B, J, V] those
  distributions)."""
  J = logits_JBV.shape[0]
  q_BJV = jax.vmap(lambda logits_BV: probabilities(logits_BV, arrays))(logits_JBV)
  q_BJV = q_BJV.transpose(1, 0, 2)
  draft_BJ = jnp.stack([draw(keys_BK[:, j], q_BJV[:, j]) for j in range(J)], axis=1)
  return draft_BJ, q_BJV


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


# -- the round -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SpeculativeStats:
  """What a speculative generation did, summed over rows."""

  rounds: int  # target forward passes in the decode loop (batched: one per round)
  row_rounds: int  # rounds counted per live row: the target passes each row needed
  emitted: int  # tokens emitted by the decode loop (the first token comes from the prefill)
  drafted: int  # draft tokens proposed to the target, over live rows
  accepted: int  # of those, accepted

  @property
  def mean_acceptance_length(self) -> float:
    """Tokens emitted per target pass of a row: accepted drafts + 1 (cut at stops)."""
    return self.emitted / max(self.row_rounds, 1)


def _emit(out_BN, logp_BN, i_B, new_BJ, newlp_BJ, n_B):
  """Writes each row's first n_B[b] new tokens at its offset i_B[b]."""
  B, J = new_BJ.shape
  cols_BJ = i_B[:, None] + jnp.arange(J)[None, :]
  cols_BJ = jnp.where(jnp.arange(J)[None, :] < n_B[:, None], cols_BJ, out_BN.shape[1])  # dropped
  rows_BJ = jnp.broadcast_to(jnp.arange(B)[:, None], (B, J))
  out_BN = out_BN.at[rows_BJ, cols_BJ].set(new_BJ, mode="drop")
  logp_BN = logp_BN.at[rows_BJ, cols_BJ].set(newlp_BJ, mode="drop")
  return out_BN, logp_BN


def _cut(new_BJ, n_B, i_B, limits_B, stop_BS, done_B):
  """Cuts each row's new tokens at its first stop token or its limit: (n_B, done_B)."""
  J = new_BJ.shape[1]
  j_1J = jnp.arange(J)[None, :]
  is_stop_BJ = jnp.any(new_BJ[..., None] == stop_BS[:, None, :], axis=-1) & (j_1J < n_B[:, None])
  first_stop_B = jnp.where(is_stop_BJ.any(1), jnp.argmax(is_stop_BJ, axis=1), J)
  n_B = jnp.minimum(n_B, first_stop_B + 1)
  n_B = jnp.minimum(n_B, limits_B - i_B)
  n_B = jnp.where(done_B, 0, n_B)
  done_B = done_B | is_stop_BJ.any(1) | (i_B + n_B >= limits_B)
  return n_B, done_B


def _settle(new_BT, a_B, logp_BTV, i_B, limits_B, stop_BS, done_B, out_BN, logp_BN):
  """A round's emitted tokens (`round_tokens`), cut at stops and limits and written out:
  (n_B, out_BN, logp_BN, done_B)."""
  newlp_BT = jnp.take_along_axis(logp_BTV, new_BT[..., None], axis=-1)[..., 0]
  n_B, done_B = _cut(new_BT, a_B + 1, i_B, limits_B, stop_BS, done_B)
  out_BN, logp_BN = _emit(out_BN, logp_BN, i_B, new_BT, newlp_BT, n_B)
  return n_B, out_BN, logp_BN, done_B


def _round_stats(done_B, a_B, n_B, k):
  """i32[5]: rounds, row rounds, emitted, drafted, accepted, for the rows live this round."""
  live_B = ~done_B
  n_live = jnp.sum(live_B)
  accepted = jnp.sum(jnp.where(live_B, a_B, 0))
  return jnp.stack([1, n_live, jnp.sum(n_B), k * n_live, accepted]).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 1, 11, 12))
def _draft_model_loop(
  t_graphdef,
  d_graphdef,
  t_state,
  d_state,
  t_cache,
  d_cache,
  first_B,
  seed_B,
  arrays: SamplingArrays,
  limits_B,
  stop_BS,
  max_new: int,
  k: int,
):
  """Rounds of draft-then-verify until every row stops.

  Both caches hold each row's prompt and emitted tokens except the pending (last) one.

  Returns:
    (i32[B, max_new] tokens, f32[B, max_new] target logprobs, i32[5] the SpeculativeStats
    counts).
  """
  B = first_B.shape[0]
  width = max_new + k + 1
  out_BN = jnp.zeros((B, width), jnp.int32).at[:, 0].set(first_B)
  logp_BN = jnp.zeros((B, width), jnp.float32)
  done_B = jnp.any(first_B[:, None] == stop_BS, axis=1) | (limits_B <= 1)

  def cond(carry):
    return ~jnp.all(carry[-2]) & (carry[0] < max_new)

  def body(carry):
    rounds, t_cache, d_cache, pending_B, i_B, out_BN, logp_BN, done_B, stats = carry
    keys_BK = round_keys(seed_B, i_B, k + 1)
    draft = nnx.merge(d_graphdef, d_state)
    base_B = t_cache.lengths

    def draft_step(carry, j):
      d_cache, x_B = carry
      logits_B1V, d_cache = draft(x_B[:, None], cache=d_cache)
      q_BV = probabilities(logits_B1V[:, 0], arrays)
      d_B = draw(keys_BK[:, j], q_BV)
      return (d_cache, d_B), (d_B, q_BV)

    # k + 1 draft steps: the last one only feeds d_k in, so the draft cache holds every draft.
    (d_cache, _), (d_JB, q_JBV) = jax.lax.scan(draft_step, (d_cache, pending_B), jnp.arange(k + 1))
    draft_BJ, q_BJV = d_JB[:k].T, q_JBV[:k].transpose(1, 0, 2)
    target = nnx.merge(t_graphdef, t_state)
    tokens_BT = jnp.concatenate([pending_B[:, None], draft_BJ], axis=1)
    logits_BTV, t_cache = target(tokens_BT, cache=t_cache)
    a_B, next_B, new_BT, logp_BTV = round_tokens(logits_BTV, q_BJV, draft_BJ, keys_BK[:, k], arrays)
    n_B, out_BN, logp_BN, done2_B = _settle(
      new_BT, a_B, logp_BTV, i_B, limits_B, stop_BS, done_B, out_BN, logp_BN
    )
    # Roll back both caches to the pending token and the accepted drafts; a finished row stays
    # where it was (its later rounds are discarded), so no cache ever runs past its capacity.
    kept_B = jnp.where(~done_B, base_B + 1 + a_B, base_B)
    t_cache, d_cache = t_cache.replace(lengths=kept_B), d_cache.replace(lengths=kept_B)
    stats = stats + _round_stats(done_B, a_B, n_B, k)
    return rounds + 1, t_cache, d_cache, next_B, i_B + n_B, out_BN, logp_BN, done2_B, stats

  i_B = jnp.ones((B,), jnp.int32)
  stats = jnp.zeros((5,), jnp.int32)
  carry = (0, t_cache, d_cache, first_B, i_B, out_BN, logp_BN, done_B, stats)
  carry = jax.lax.while_loop(cond, body, carry)
  return carry[5][:, :max_new], carry[6][:, :max_new], carry[-1]


def _mtp_draft(model, m_cache, new_BT, hidden, positions_BT, a_B, keys_BK, arrays, k):
  """The MTP heads over the round's window: drafts for the next round and the grown cache."""
  final_BTD, trunk_BTD = hidden
  logits_JBV, m_cache = model.mtp.draft(
    m_cache,
    next_tokens_BT=new_BT,
    trunk_BTD=trunk_BTD,
    final_BTD=final_BTD,
    positions_BT=positions_BT,
    at_B=a_B,
    embed_VD=model.embed[...],
    head_DV=model._head_DV(),
    n_heads=k,  # heads past the k-th would draft tokens nobody verifies
  )
  return *heads_drafts(logits_JBV, keys_BK, arrays), m_cache


@functools.partial(jax.jit, static_argnums=(0, 8))
def _mtp_prefill(graphdef, state, tokens_BT, lengths_B, t_cache, m_cache, seed_B, arrays, k):
  """The prompt through the model and its MTP heads: (first token and its logprob, both caches,
  the first round's drafts and their distributions)."""
  model = nnx.merge(graphdef, state)
  B, T = tokens_BT.shape
  logits_BTV, t_cache, hidden = model(tokens_BT, cache=t_cache, return_hidden=True)
  last_B = lengths_B - 1
  logits_BV = jnp.take_along_axis(logits_BTV, last_B[:, None, None], axis=1)[:, 0]
  first_B, first_lp_B, _, _ = sample_rows(
    logits_BV, step_keys(seed_B, jnp.zeros_like(seed_B)), arrays
  )
  # The token after each prompt position: the prompt shifted, then the first generated token.
  t_1T = jnp.arange(T)[None, :]
  next_BT = jnp.where(t_1T == last_B[:, None], first_B[:, None], jnp.roll(tokens_BT, -1, axis=1))
  positions_BT = jnp.broadcast_to(t_1T, (B, T))
  keys_BK = round_keys(seed_B, jnp.ones_like(seed_B), k + 1)
  draft_BJ, q_BJV, m_cache = _mtp_draft(
    model, m_cache, next_BT, hidden, positions_BT, last_B, keys_BK, arrays, k
  )
  t_cache, m_cache = t_cache.replace(lengths=lengths_B), m_cache.replace(lengths=lengths_B)
  return first_B, first_lp_B, t_cache, m_cache, draft_BJ, q_BJV


@functools.partial(jax.jit, static_argnums=(0, 10, 11))
def _mtp_loop(
  graphdef,
  state,
  t_cache,
  m_cache,
  first_B,
  drafts_BJ,
  q_BJV,
  seed_B,
  arrays: SamplingArrays,
  limits_B,
  max_new: int,
  k: int,
  stop_BS,
):
  """Self-speculation: each round verifies the MTP heads' drafts and, from the same pass's
  hidden states, drafts the next round's."""
  model = nnx.merge(graphdef, state)
  B = first_B.shape[0]
  width = max_new + k + 1
  out_BN = jnp.zeros((B, width), jnp.int32).at[:, 0].set(first_B)
  logp_BN = jnp.zeros((B, width), jnp.float32)
  done_B = jnp.any(first_B[:, None] == stop_BS, axis=1) | (limits_B <= 1)

  def cond(carry):
    return ~jnp.all(carry[-2]) & (carry[0] < max_new)

  def body(carry):
    rounds, t_cache, m_cache, pending_B, draft_BJ, q_BJV, i_B, out_BN, logp_BN, done_B, stats = (
      carry
    )
    keys_BK = round_keys(seed_B, i_B, k + 1)
    base_B = t_cache.lengths
    tokens_BT = jnp.concatenate([pending_B[:, None], draft_BJ], axis=1)
    logits_BTV, t_cache, hidden = model(tokens_BT, cache=t_cache, return_hidden=True)
    a_B, next_B, new_BT, logp_BTV = round_tokens(logits_BTV, q_BJV, draft_BJ, keys_BK[:, k], arrays)
    n_B, out_BN, logp_BN, done2_B = _settle(
      new_BT, a_B, logp_BTV, i_B, limits_B, stop_BS, done_B, out_BN, logp_BN
    )
    positions_BT = base_B[:, None] + jnp.arange(k + 1)[None, :]
    next_keys_BK = round_keys(seed_B, i_B + n_B, k + 1)
    draft_BJ, q_BJV, m_cache = _mtp_draft(
      model, m_cache, new_BT, hidden, positions_BT, a_B, next_keys_BK, arrays, k
    )
    kept_B = jnp.where(~done_B, base_B + 1 + a_B, base_B)
    t_cache, m_cache = t_cache.replace(lengths=kept_B), m_cache.replace(lengths=kept_B)
    stats = stats + _round_stats(done_B, a_B, n_B, k)
    return (
      rounds + 1,
      t_cache,
      m_cache,
      next_B,
      draft_BJ,
      q_BJV,
      i_B + n_B,
      out_BN,
      logp_BN,
      done2_B,
      stats,
    )

  i_B = jnp.ones((B,), jnp.int32)
  stats = jnp.zeros((5,), jnp.int32)
  carry = (0, t_cache, m_cache, first_B, drafts_BJ, q_BJV, i_B, out_BN, logp_BN, done_B, stats)
  carry = jax.lax.while_loop(cond, body, carry)
  return carry[7][:, :max_new], carry[8][:, :max_new], carry[-1]


def check_draft(model, draft, k: int) -> None:
  """Raises ValueError naming the argument when a draft cannot serve `model`."""
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"num_speculative_tokens={k!r} must be a positive int")
  if isinstance(draft, str):
    if draft != "mtp":
      raise ValueError(f"draft={draft!r}: expected a model or 'mtp'")
    if model.mtp is None:
      raise ValueError("draft='mtp': the model has no MTP heads (model.mtp is null)")
    if k > model.mtp.n_draft_heads:
      raise ValueError(
        f"num_speculative_tokens={k} with draft='mtp' must be <= {model.mtp.n_draft_heads}: "
        f"each {model.mtp.kind} MTP head drafts one token"
        + (" (only the first sequential head drafts)" if model.mtp.kind == "sequential" else "")
      )
    return
  if not hasattr(draft, "init_cache") or not hasattr(draft, "cfg"):
    raise ValueError(f"draft must be a model (atlas_jax.model.Transformer) or 'mtp', got {draft!r}")
  if draft.cfg.vocab_size != model.cfg.vocab_size:
    raise ValueError(
      f"draft vocab_size={draft.cfg.vocab_size} != the model's vocab_size="
      f"{model.cfg.vocab_size}: speculation needs one vocabulary"
    )


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
  from atlas_jax.decoding.generate import _bucket, _prefill

  B = len(prompts)
  max_new = max(p.max_new_tokens for p in per_row)
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  T = _bucket(int(lengths.max()))
  capacity = T + _bucket(max_new + k + 1)
  tokens = np.zeros((B, T), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, : len(p)] = p
  stop_BS = np.full((B, max(1, max(len(s) for s in stops))), -1, np.int32)
  for b, s in enumerate(stops):
    stop_BS[b, : len(s)] = s
  arrays = SamplingArrays.from_params(per_row)
  seed_B = jnp.asarray([p.seed for p in per_row], jnp.int32)

  limits_B = jnp.asarray([p.max_new_tokens for p in per_row], jnp.int32)
  t_graphdef, t_state = nnx.split(model)
  tokens_BT, lengths_B = jnp.asarray(tokens), jnp.asarray(lengths)
  if isinstance(draft, str):  # "mtp": the model's own heads
    m_cache = model.mtp.init_cache(model.cfg, B, capacity, jnp.dtype(model.cfg.dtype))
    first_B, first_lp_B, t_cache, m_cache, drafts_BJ, q_BJV = _mtp_prefill(
      t_graphdef,
      t_state,
      tokens_BT,
      lengths_B,
      model.init_cache(B, capacity),
      m_cache,
      seed_B,
      arrays,
      k,
    )
    out_BN, logp_BN, stats = _mtp_loop(
      t_graphdef,
      t_state,
      t_cache,
      m_cache,
      first_B,
      drafts_BJ,
      q_BJV,
      seed_B,
      arrays,
      limits_B,
      max_new,
      k,
      jnp.asarray(stop_BS),
    )
  else:
    d_graphdef, d_state = nnx.split(draft)
    t_logits_BV, t_cache = _prefill(
      t_graphdef, t_state, tokens_BT, model.init_cache(B, capacity), lengths_B
    )
    _, d_cache = _prefill(d_graphdef, d_state, tokens_BT, draft.init_cache(B, capacity), lengths_B)
    # The first token comes from the prefill, drawn exactly as plain decoding draws it.
    first_B, first_lp_B, _, _ = _first_token(t_logits_BV, seed_B, arrays)
    out_BN, logp_BN, stats = _draft_model_loop(
      t_graphdef,
      d_graphdef,
      t_state,
      d_state,
      t_cache,
      d_cache,
      first_B,
      seed_B,
      arrays,
      limits_B,
      jnp.asarray(stop_BS),
      max_new,
      k,
    )
  logp_BN = logp_BN.at[:, 0].set(first_lp_B)
  return np.asarray(out_BN), np.asarray(logp_BN), SpeculativeStats(*map(int, np.asarray(stats)))


@jax.jit
def _first_token(logits_BV, seed_B, arrays):
  return sample_rows(logits_BV, step_keys(seed_B, jnp.zeros_like(seed_B)), arrays)
