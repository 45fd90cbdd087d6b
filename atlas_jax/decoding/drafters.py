"""Drafters: what proposes tokens for speculative decoding, one interface for every draft.

`generate(..., draft=)`'s static loop and the serving engine's rounds both speak to a drafter
through two calls, over a `DraftCache` that they roll back with the target's:

* `follow(params, target, dcache, window, in_round=)`: the target has computed a `Window` of
  positions (a prompt, a prefill chunk, decode steps, a round's verification); the drafter
  catches up with it, so it never needs a catch-up pass of its own.
* `propose(params, target, dcache, pending_B, lengths_B, keys_BT, arrays, k)`: k draft tokens
  per row from its pending token (drawn, not yet in any cache, at position `lengths_B`), and the
  distributions they were drawn from.

Three drafters:

* `DraftModel`: a smaller model with the target's vocabulary and its own cache (contiguous, or
  a paged pool indexed by the target's block tables). `follow` runs it over the window's tokens;
  `propose` runs k + 1 single-token steps (the last only writes d_k, so its cache holds every
  draft, and a round's `follow` has nothing left to do).
* `MTPDrafter`: the target's own multi-token-prediction heads (`atlas_jax.model.mtp`). Their
  cache holds the heads' blocks; beside it, `DraftCache.hidden` keeps the target's hidden
  states per slot of that cache (the final one and the last block's input). `follow` runs the
  heads over the window from the target's hidden states and stores them; `propose` runs a chain
  of k head steps from each row's last computed position (its first rewrites that position's
  entry, idempotently), with the pending token as its next, and draws from their logits.
* `NGramDrafter`: prompt lookup, no model. Its cache is the row's tokens per slot; `propose`
  finds the row's longest recent n-gram earlier in its prompt and output and proposes what
  followed it (one-hot proposals; fewer than k, or none, where nothing matches).

Every cache entry a round reads was written by `follow` or `propose`, and entries past a row's
length are never read, so rolling back lengths rolls back the drafter too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax.cache.paged import PagedCache
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
  # i32[S] each sequence's first token's index in the window's flattened [B * T] (-1: none), for
  # chained MTP heads (`MTPDrafter.follow`); None: no rewrite before the window (a contiguous
  # cache's prompt window: nothing precedes it, and a contiguous row cannot skip a write).
  first_S: Array | None = None


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
  """The target's MTP heads drafting for it: `n_heads` of them hold a cache (k for parallel
  heads, min(k, J) for sequential ones, which chain)."""

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
    dcache = self._heads(target, dcache, window, store=True)[0]
    if target.mtp.kind == "sequential" and self.n_heads > 1 and window.first_S is not None:
      dcache = self._chain_before(target, dcache, window)
    return dcache

  def _chain_before(self, target, dcache: DraftCache, window: Window) -> DraftCache:
    """Rewrites the deeper heads' entries at the position before each sequence's window.

    Head i at position p reads token p + 1 + i: when p was last in its window (or a round's
    drafting link wrote it from a draft), that token was not known, and this window is where it
    is. So the chain runs again at p = start - 1, from the stored hidden states and the window's
    first tokens: head 0 rewrites its entry as it was, head 1 exactly; a head i > 1 reads the
    window's token i - 1 after start, approximate where the window is shorter than that.
    """
    tokens = window.tokens_BT.reshape(-1)
    after = window.next_BT.reshape(-1)
    n = tokens.shape[0]
    first_S = jnp.maximum(window.first_S, 0)
    start_S = window.positions_BT.reshape(-1)[first_S]
    p_S = jnp.where((window.first_S >= 0) & (start_S >= 1), start_S - 1, -1)
    cache = dcache.cache
    if getattr(cache, "query_start", None) is not None:  # ragged: one position per sequence
      cache = cache.replace(query_start=None, query_len=None, max_query_len=None)
    _, X, Y, D = dcache.hidden.shape
    slots_S = jnp.maximum(cache.slots(p_S[:, None])[:, 0], 0)
    h_SD, trunk_SD = dcache.hidden.reshape(2, X * Y, D)[:, slots_S]
    for i in range(self.n_heads):
      token_S = tokens[first_S] if i == 0 else after[jnp.minimum(first_S + i - 1, n - 1)]
      _, h_SD, cache = target.mtp.draft_step(
        cache,
        head=jnp.int32(i),
        token_B=token_S,
        h_BD=h_SD,
        trunk_BD=trunk_SD,
        position_B=p_S,
        embed_VD=target.embed[...],
        head_DV=target._head_DV(),
      )
    return dcache.replace(cache=cache)

  def propose(self, params, target, dcache, pending_B, lengths_B, keys_BT, arrays, k):
    """(dcache, i32[B, k] drafts, f32[B, k, V] their distributions): a chain of k links
    (`MTPHeads.draft_step`) from each row's last computed position (lengths - 1), its hidden
    states read back from their slot.

    Link j runs head i = j mod n_heads. Parallel heads (k <= n_heads) all sit at the last
    position and read the trunk: their drafts do not read each other's. Sequential heads chain:
    head i drafts token j + 1 from the previous link's output and draft at position
    last + j - i, so the first n_heads links are the training-time depths at the last position,
    and past them the first head runs again one step further on, on the chain's own output (a
    stand-in for the trunk's state there, as vLLM drafts from DeepSeek-V3's one module). Links
    past the last position write entries the round's `follow` rewrites from verified states.
    """
    del params
    last_B = jnp.where(lengths_B >= 1, lengths_B - 1, -1)
    _, X, Y, D = dcache.hidden.shape
    slots_B = jnp.maximum(dcache.cache.slots(last_B[:, None])[:, 0], 0)
    final_BD, trunk_BD = dcache.hidden.reshape(2, X * Y, D)[:, slots_B]
    mtp, J = target.mtp, self.n_heads
    embed_VD, head_DV = target.embed[...], target._head_DV()

    def link(carry, j):
      cache, h_BD, token_B = carry
      head = j % J
      position_B = jnp.where(last_B >= 0, last_B + j - head, -1)
      logits_BV, h_BD, cache = mtp.draft_step(
        cache,
        head=head,
        token_B=token_B,
        h_BD=h_BD,
        trunk_BD=trunk_BD,
        position_B=position_B,
        embed_VD=embed_VD,
        head_DV=head_DV,
      )
      q_BV = probabilities(first_masked(logits_BV, arrays, j), arrays)
      d_B = draw(keys_BT[:, j], q_BV)
      return (cache, h_BD, d_B), (d_B, q_BV)

    carry = (dcache.cache, final_BD, pending_B)
    (cache, _, _), (d_JB, q_JBV) = jax.lax.scan(link, carry, jnp.arange(k, dtype=jnp.int32))
    return dcache.replace(cache=cache), d_JB.T, q_JBV.transpose(1, 0, 2)


# -- prompt lookup -------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenPool:
  """Every token at each slot of a cache: the n-gram drafter's whole state. A one-"layer" pool
  ([1, P, Z] blocks indexed by the target's block tables, or a contiguous cache's [B, S] rows as
  blocks), so a `PagedCache` maps its positions to slots and block copies copy it too."""

  tokens: Array  # i32[1, X, Y]

  @property
  def arrays(self) -> tuple[Array]:
    return (self.tokens,)

  def with_arrays(self, arrays) -> TokenPool:
    return TokenPool(*arrays)


def ngram_match(buf_BS: Array, end_B: Array, *, min_n: int, max_n: int) -> tuple[Array, Array]:
  """The longest n-gram (min_n <= n <= max_n) ending at each row's `end_B` that also ends
  earlier in the row, and the earliest place it does (as vLLM's and transformers' prompt
  lookup pick it): one vectorised pass over the buffer, O(S * max_n) per row.

  Args:
    buf_BS: i32[B, S] each row's tokens (prompt and output) at their positions.
    end_B: i32[B] the position of each row's last token (-1: an empty row).

  Returns:
    (i32[B] e, the position where the earlier occurrence ends (its next token at e + 1 <= end),
    i32[B] its length n; 0 where no n-gram of at least min_n tokens recurs).
  """
  B, S = buf_BS.shape
  e_1S = jnp.arange(S, dtype=jnp.int32)[None, :]
  run_BS = jnp.zeros((B, S), jnp.int32)  # how many tokens ending at e match those ending at end
  alive_BS = jnp.ones((B, S), bool)
  for t in range(max_n):
    tail_B = jnp.take_along_axis(buf_BS, jnp.maximum(end_B - t, 0)[:, None], axis=1)
    back_BS = jnp.roll(buf_BS, t, axis=1)  # position e holds the token at e - t
    alive_BS &= (back_BS == tail_B) & (e_1S >= t) & (end_B - t >= 0)[:, None]
    run_BS += alive_BS
  run_BS = jnp.where((e_1S < end_B[:, None]) & (run_BS >= min_n), run_BS, 0)
  n_B = run_BS.max(axis=1)
  e_B = jnp.argmax(run_BS == n_B[:, None], axis=1).astype(jnp.int32)  # the first: earliest
  return e_B, n_B


def ngram_drafts(buf_BS: Array, end_B: Array, *, min_n: int, max_n: int, k: int):
  """(i32[B, k] the up to k tokens after the match `ngram_match` finds, 0 past them; i32[B]
  how many there are: none without a match, fewer than k where the match ends near `end`)."""
  S = buf_BS.shape[1]
  e_B, n_B = ngram_match(buf_BS, end_B, min_n=min_n, max_n=max_n)
  count_B = jnp.where(n_B > 0, jnp.minimum(k, end_B - e_B), 0)
  at_BJ = e_B[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :]
  tokens_BJ = jnp.take_along_axis(buf_BS, jnp.minimum(at_BJ, S - 1), axis=1)
  has_BJ = jnp.arange(k)[None, :] < count_B[:, None]
  return jnp.where(has_BJ, tokens_BJ, 0), count_B


@dataclasses.dataclass(frozen=True)
class NGramDrafter:
  """Prompt lookup (n-gram) drafting: no model. Each row drafts the tokens that followed the
  earliest earlier occurrence of its longest recent n-gram, `prompt_lookup_min` <= n <=
  `prompt_lookup_max` (vLLM's names), found in its own prompt and output on the device.

  Its cache is a `TokenPool` over the target's slots: `follow` writes the window's tokens;
  `propose` reads each row's tokens back through its block table. A draft is a deterministic
  proposal, q = one-hot: the verifier accepts it with probability p(x) and after a rejection
  draws from p without x, renormalised, exactly as `verify` treats any q. A row with fewer than
  k drafts (no match, or a match near its end) pads with q = 0: a position with nothing
  proposed is never accepted, and the residual there is p itself, the plain draw.
  """

  prompt_lookup_min: int = 5  # vLLM's defaults when neither is given
  prompt_lookup_max: int = 5
  needs_hidden = False

  def __post_init__(self):
    lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
    for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed: must be a positive int")
    if lo > hi:
      raise ValueError(f"prompt_lookup_min={lo} is not allowed: must be <= prompt_lookup_max={hi}")

  def init_cache(self, batch: int, max_len: int) -> Any:
    """A cache of `batch` rows of `max_len` tokens: the rows as blocks of a `PagedCache`."""
    Z = next(z for z in (64, 32, 16, 8, 4, 2, 1) if max_len % z == 0)
    table_BM = jnp.arange(batch * (max_len // Z), dtype=jnp.int32).reshape(batch, -1)
    pool = TokenPool(jnp.zeros((1, batch * (max_len // Z), Z), jnp.int32))
    return PagedCache(pool, table_BM, jnp.zeros((batch,), jnp.int32))

  def init_pool(self, n_blocks: int, block_size: int) -> TokenPool:
    return TokenPool(jnp.zeros((1, n_blocks, block_size), jnp.int32))

  def follow(self, params, target, dcache: DraftCache, window: Window, *, in_round=False):
    """The window's tokens written at their slots (a round's: the pending token and every
    draft; those past the kept ones are never read)."""
    del params, target, in_round
    cache = dcache.cache
    tokens = cache.pool.tokens
    _, X, Y = tokens.shape
    slots_BT = cache.slots(window.positions_BT)
    slots_BT = jnp.where(slots_BT >= 0, slots_BT, X * Y)  # padding: out of range, dropped
    flat = tokens.reshape(X * Y).at[slots_BT].set(window.tokens_BT, mode="drop")
    return dcache.replace(cache=cache.replace(pool=TokenPool(flat.reshape(tokens.shape))))

  def propose(self, params, target, dcache, pending_B, lengths_B, keys_BT, arrays, k):
    """(dcache, i32[B, k] drafts, f32[B, k, V] their one-hot proposals, zero rows where a row
    has fewer than k drafts); padding rows (length -1) draft nothing."""
    del params, keys_BT, arrays
    cache = dcache.cache
    table_BM = cache.block_table
    B, M = table_BM.shape
    buf_BS = cache.pool.tokens[0][table_BM].reshape(B, -1)
    valid_B = lengths_B >= 0
    at_B = jnp.where(valid_B, lengths_B, buf_BS.shape[1])  # the pending token's position
    buf_BS = buf_BS.at[jnp.arange(B), at_B].set(pending_B, mode="drop")
    draft_BJ, count_B = ngram_drafts(
      buf_BS,
      jnp.where(valid_B, lengths_B, -1),
      min_n=self.prompt_lookup_min,
      max_n=self.prompt_lookup_max,
      k=k,
    )
    has_BJ = jnp.arange(k)[None, :] < count_B[:, None]
    q_BJV = jax.nn.one_hot(draft_BJ, target.cfg.vocab_size, dtype=jnp.float32)
    return dcache, draft_BJ, q_BJV * has_BJ[..., None]


Drafter = DraftModel | MTPDrafter | NGramDrafter


def check_k(k) -> None:
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"num_speculative_tokens={k!r} is not allowed: must be a positive int")


def make_drafter(model, draft, k: int, *, max_len: int | None = None) -> Drafter:
  """The drafter for `draft` proposing k tokens: "mtp" (the model's own heads), "ngram" or an
  `NGramDrafter` (prompt lookup), or a model with `model`'s vocabulary.

  Raises:
    ValueError naming the argument: a draft that is none of these, another vocabulary, too short
    a context (`max_len`, the served one), no MTP heads, or more drafts than parallel heads.
  """
  check_k(k)
  if isinstance(draft, NGramDrafter):
    return draft
  if isinstance(draft, str):
    if draft == "ngram":
      return NGramDrafter()
    if draft != "mtp":
      raise ValueError(f"draft={draft!r} is not allowed: expected a model, 'mtp' or 'ngram'")
    if model.mtp is None:
      raise ValueError("draft='mtp': the model has no MTP heads (model.mtp is null)")
    J = model.mtp.n_draft_heads
    if model.mtp.kind == "parallel" and k > J:
      raise ValueError(
        f"num_speculative_tokens={k} with draft='mtp' must be <= {J}: each parallel MTP head "
        "drafts one token from the trunk"
      )
    return MTPDrafter(min(k, J))
  if not hasattr(draft, "init_cache") or not hasattr(draft, "cfg"):
    raise ValueError(
      f"draft={draft!r} is not allowed: expected a model (atlas_jax.model.Transformer), 'mtp' "
      "or 'ngram'"
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
