"""Drafters: what proposes tokens for speculative decoding, one interface for every draft.

`generate(..., draft=)`'s static loop and the serving engine's rounds both speak to a drafter
through two calls, over a `DraftCache` that they roll back with the target's:

* `follow(params, target, dcache, window, in_round=)`: the target has computed a `Window` of
  positions (a prompt, a prefill chunk, decode steps, a round's verification); the drafter
  catches up with it, so it never needs a catch-up pass of its own.
* `propose(params, target, dcache, pending_B, lengths_B, keys_BT, arrays, k)`: k draft tokens
  per row from its pending token (drawn, not yet in any cache, at position `lengths_B`), and the
  distributions they were drawn from.

Two drafters:

* `DraftModel`: a smaller model with the target's vocabulary and its own cache (contiguous, or
  a paged pool indexed by the target's block tables). `follow` runs it over the window's tokens;
  `propose` runs k + 1 single-token steps (the last only writes d_k, so its cache holds every
  draft, and a round's `follow` has nothing left to do).
* `MTPDrafter`: the target's own multi-token-prediction heads (`atlas_jax.model.mtp`). Their
  cache holds the heads' blocks; beside it, `DraftCache.hidden` keeps the target's hidden
  states per slot of that cache (the final one and the last block's input). `follow` runs the
  heads over the window from the target's hidden states and stores them; `propose` re-runs the
  heads at each row's last computed position from the stored states (an idempotent rewrite of
  that position's entry), with the pending token as its next, and draws from their logits.

Either way every cache entry a round reads was written by `follow` or `propose` from verified
tokens, and entries past a row's length are never read, so rolling back lengths rolls back the
drafter too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax.decoding.sampling import SamplingArrays, mask_logits, probabilities

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftCache:
  """A drafter's cache: the draft model's or the MTP heads' (contiguous or paged), and for MTP
  the target's hidden states per slot of it."""

  cache: Any  # a cache following `atlas_jax.cache.protocol`
  # MTP: [2, X, Y, D] the final hidden state and the last block's input at every slot of
  # `cache` ([B, S] rows of a contiguous cache, [P, Z] blocks of a pool); None for a model.
  hidden: Array | None = None

  def replace(self, **fields) -> DraftCache:
    return dataclasses.replace(self, **fields)

  def at(self, lengths_B: Array) -> DraftCache:
    """The cache rolled back (or forward) to `lengths_B` tokens per row."""
    return self.replace(cache=self.cache.replace(lengths=lengths_B))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Window:
  """Positions the target has just computed, as a drafter needs them."""

  tokens_BT: Array  # i32[B, T] the tokens the target took
  positions_BT: Array  # i32[B, T] their positions; -1: padding
  lengths_B: Array  # i32[B] tokens held before the window (0 for a padding row)
  next_BT: Array  # i32[B, T] the token after each position (the next input, or the one drawn)
  at_B: Array  # i32[B] window index of each row's last position whose next token is verified
  hidden: tuple[Array, Array] | None = None  # (final, last block's input) [B, T, D]: MTP only


def first_masked(logits_BV: Array, arrays: SamplingArrays, j) -> Array:
  """A guided row's first draft is drawn under its current mask; later drafts are not (their
  masks depend on the drafts before them: the verifier masks the target there instead)."""
  if arrays.allowed_bits is None:
    return logits_BV
  return jnp.where(j == 0, mask_logits(logits_BV, arrays.allowed_bits), logits_BV)


def draw(key_B: Array, probs_BV: Array) -> Array:
  """i32[B]: one token per row from its distribution (the argmax of a one-hot, exactly)."""
  return jax.vmap(jax.random.categorical)(key_B, jnp.log(probs_BV)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class DraftModel:
  """A smaller model drafting for the target (static: its graph; its weights are `params`)."""

  graphdef: Any
  needs_hidden = False  # the target's hidden states are not needed

  def follow(self, params, target, dcache: DraftCache, window: Window, *, in_round=False):
    """The draft over the window's tokens, into its own cache; its logits are not needed."""
    del target
    if in_round:
      return dcache  # `propose` fed it the pending token and every draft
    draft = nnx.merge(self.graphdef, params)
    cache = dcache.cache.replace(lengths=window.lengths_B)
    head_at_B = jnp.zeros(window.tokens_BT.shape[:1], jnp.int32)  # one position: the cheapest
    _, cache = draft(
      window.tokens_BT, positions_BT=window.positions_BT, cache=cache, logits_at_B=head_at_B
    )
    return dcache.replace(cache=cache)

  def propose(self, params, target, dcache, pending_B, lengths_B, keys_BT, arrays, k):
    """(dcache, i32[B, k] drafts, f32[B, k, V] their distributions); padding rows (length -1)
    write nothing."""
    del target
    draft = nnx.merge(self.graphdef, params)
    valid_B = lengths_B >= 0

    def step(carry, j):
      cache, x_B = carry
      positions_B1 = jnp.where(valid_B, lengths_B + j, -1)[:, None]
      cache = cache.replace(lengths=jnp.where(valid_B, lengths_B + j, 0))
      logits_B1V, cache = draft(x_B[:, None], positions_BT=positions_B1, cache=cache)
      q_BV = probabilities(first_masked(logits_B1V[:, 0], arrays, j), arrays)
      d_B = draw(keys_BT[:, j], q_BV)  # the last step's draw is not used
      return (cache, d_B), (d_B, q_BV)

    (cache, _), (d_JB, q_JBV) = jax.lax.scan(step, (dcache.cache, pending_B), jnp.arange(k + 1))
    return dcache.replace(cache=cache), d_JB[:k].T, q_JBV[:k].transpose(1, 0, 2)


@dataclasses.dataclass(frozen=True)
class MTPDrafter:
  """The target's MTP heads drafting for it; `n_heads` (k) of them run, one draft each."""

  n_heads: int
  needs_hidden = True  # the heads draft from the target's hidden states

  def _heads(self, target, dcache: DraftCache, window: Window, store: bool):
    """The heads over the window: (dcache with their entries written and, with `store`, the
    window's hidden states kept per slot; f32[J, B, V] their logits at `window.at_B`)."""
    final_BTD, trunk_BTD = window.hidden
    cache = dcache.cache.replace(lengths=window.lengths_B)
    hidden = dcache.hidden
    if store:
      _, X, Y, D = hidden.shape
      slots_BT = cache.slots(window.positions_BT)
      slots_BT = jnp.where(slots_BT >= 0, slots_BT, X * Y)  # out of range: dropped
      new_2BTD = jnp.stack([final_BTD, trunk_BTD]).astype(hidden.dtype)
      flat = hidden.reshape(2, X * Y, D).at[:, slots_BT].set(new_2BTD, mode="drop")
      hidden = flat.reshape(hidden.shape)
    logits_JBV, cache = target.mtp.draft(
      cache,
      next_tokens_BT=window.next_BT,
      trunk_BTD=trunk_BTD,
      final_BTD=final_BTD,
      positions_BT=window.positions_BT,
      at_B=window.at_B,
      embed_VD=target.embed[...],
      head_DV=target._head_DV(),
      n_heads=self.n_heads,
    )
    return DraftCache(cache, hidden), logits_JBV

  def follow(self, params, target, dcache: DraftCache, window: Window, *, in_round=False):
    del params, in_round  # a round's window is new to the heads: they run over it
    return self._heads(target, dcache, window, store=True)[0]

  def propose(self, params, target, dcache, pending_B, lengths_B, keys_BT, arrays, k):
    """(dcache, i32[B, k] drafts, f32[B, k, V] their distributions), from the heads at each
    row's last computed position (lengths - 1), its hidden states read back from their slot."""
    del params
    last_B1 = jnp.where(lengths_B >= 1, lengths_B - 1, -1)[:, None]
    _, X, Y, D = dcache.hidden.shape
    slots_B1 = jnp.maximum(dcache.cache.slots(last_B1), 0)
    final_B1D, trunk_B1D = dcache.hidden.reshape(2, X * Y, D)[:, slots_B1]
    window = Window(
      tokens_BT=pending_B[:, None],
      positions_BT=last_B1,
      lengths_B=jnp.maximum(last_B1[:, 0], 0),
      next_BT=pending_B[:, None],
      at_B=jnp.zeros_like(lengths_B),
      hidden=(final_B1D, trunk_B1D),
    )
    dcache, logits_JBV = self._heads(target, dcache, window, store=False)
    logits_JBV = logits_JBV[:k].at[0].set(first_masked(logits_JBV[0], arrays, 0))
    # The heads do not read each other's draws: every draft comes from one pass.
    q_BJV = jax.vmap(lambda logits_BV: probabilities(logits_BV, arrays))(logits_JBV)
    q_BJV = q_BJV.transpose(1, 0, 2)
    draft_BJ = jnp.stack([draw(keys_BT[:, j], q_BJV[:, j]) for j in range(k)], axis=1)
    return dcache, draft_BJ, q_BJV


Drafter = DraftModel | MTPDrafter


def check_k(k) -> None:
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"num_speculative_tokens={k!r} is not allowed: must be a positive int")


def make_drafter(model, draft, k: int, *, max_len: int | None = None) -> Drafter:
  """The drafter for `draft` ("mtp", or a model with `model`'s vocabulary) proposing k tokens.

  Raises:
    ValueError naming the argument: a draft that is neither, another vocabulary, too short a
    context (`max_len`, the served one), no MTP heads or fewer than k drafting ones.
  """
  check_k(k)
  if isinstance(draft, str):
    if draft != "mtp":
      raise ValueError(f"draft={draft!r} is not allowed: expected a model or 'mtp'")
    if model.mtp is None:
      raise ValueError("draft='mtp': the model has no MTP heads (model.mtp is null)")
    if k > model.mtp.n_draft_heads:
      raise ValueError(
        f"num_speculative_tokens={k} with draft='mtp' must be <= {model.mtp.n_draft_heads}: "
        f"each {model.mtp.kind} MTP head drafts one token"
        + (" (only the first sequential head drafts)" if model.mtp.kind == "sequential" else "")
      )
    return MTPDrafter(k)
  if not hasattr(draft, "init_cache") or not hasattr(draft, "cfg"):
    raise ValueError(
      f"draft={draft!r} is not allowed: expected a model (atlas_jax.model.Transformer) or 'mtp'"
    )
  if draft.cfg.vocab_size != model.cfg.vocab_size:
    raise ValueError(
      f"draft vocab_size={draft.cfg.vocab_size} != the model's vocab_size="
      f"{model.cfg.vocab_size}: speculation needs one vocabulary"
    )
  if max_len is not None and draft.cfg.max_seq_len < max_len:
    raise ValueError(
      f"draft max_seq_len={draft.cfg.max_seq_len} is shorter than the served context "
      f"max_model_len={max_len}"
    )
  return DraftModel(nnx.graphdef(draft))


def hidden_store(cfg, rows: int, slots: int, dtype) -> jax.ShapeDtypeStruct:
  """The shape of an MTP drafter's hidden states beside a cache of `rows` x `slots` entries
  ([B, S] or [P, Z])."""
  return jax.ShapeDtypeStruct((2, rows, slots, cfg.d_model), jnp.dtype(dtype))
