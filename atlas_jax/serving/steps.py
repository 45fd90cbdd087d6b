"""The engine's device programs, each over one `batch.StepRecord`: a step, a burst of decode
steps, a speculative round, block copies.

Each is jitted once per bucket of shapes and donates the pools, so XLA updates them in place.
The scheduler (`atlas_jax.serving.scheduler`) decides what runs and the model runner
(`atlas_jax.serving.runner`) lays the record out; these only compute.

* `forward_sample`: one model call over every new token of the step (prompt chunks and decode
  tokens of every sequence, on the record's rows: ragged, or one row per sequence), then one draw
  per sequence from its last new token.
* `decode_burst`: n decode iterations in one call (n a traced count, so one program per shape
  serves every burst length up to its capacity), each sampled token fed straight back as the
  next input without leaving the device; the host reads all n tokens per row afterwards. Rows
  do not stop inside the burst: tokens past a stop are cut by the host, whose block reservation
  covered them.
* `speculative_round`: the drafter proposes k tokens per row, the target scores all of them in
  one pass, the rejection sampler keeps a prefix and draws the token after it
  (`atlas_jax.decoding.speculative`). Split in `speculative_draft` and `speculative_verify` for
  guided rows, whose masks at each draft position the host computes from the drafts.
* `copy_blocks`: copy-on-write of pool blocks.
* `prompt_logprobs`: the model over one whole prompt (no pool), each position's log-probability
  of the token after it and the top ones (the API's `echo` with `logprobs`).

Bursts and rounds take a record in rows form with one token per sequence (its pending token).

With a drafter (`atlas_jax.decoding.drafters`), every program takes `states` and `pools` as
(target, draft) pairs and lets the drafter follow every window the target computes (prefill
chunks and bursts too), into its own pool indexed by the same block tables and the same ragged
layout, so a round needs no catch-up. A draft model's pool is its own `init_pool`; the MTP
heads' is their pool and the target's hidden states per slot, [2, P, Z, D]; prompt lookup's is
each slot's token (`drafters.TokenPool`, [1, P, Z]). Without one the draft halves are None.

On a device mesh, `layout` (the target's, and `d_layout` a draft model's) places the pools and
every read and write of them runs per shard (`atlas_jax.cache.paged`); the record's rows and
sequences are split over the data axis, replica r's in its own slice.

`programs(graphdef, drafter, layout, d_layout, pool_shardings, compile)` returns the jitted
programs with these bound in, made once per combination: a step then hashes no graph, only its
arrays' shapes. `compile` is how a backend's specialisation compiles them (the CPU runner's
`atlas_jax.serving.cpu`); by default `jax.jit`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from atlas_jax.cache.paged import HybridPool, PagedCache, PoolLayout, copy_pages
from atlas_jax.decoding.drafters import DraftCache, Drafter, Window
from atlas_jax.decoding.sampling import MAX_LOGPROBS, sample_rows, step_keys
from atlas_jax.decoding.speculative import round_keys, top_logprobs, verify_drafts
from atlas_jax.model import lora
from atlas_jax.serving.batch import StepRecord

Array = jax.Array


jax.tree_util.register_dataclass(StepRecord)


def _adapters(slots_RT):
  """While tracing the model's calls: each token's LoRA adapter slot (i32[R, T], the record's
  token layout), where the model holds served adapters (`atlas_jax.serving.lora`)."""
  return contextlib.nullcontext() if slots_RT is None else lora.token_slots(slots_RT)


def _next_tokens(x: StepRecord, token_B: Array) -> Array:
  """i32[R, T] the token after each position: the next one in its row, and after each
  sequence's last token the one drawn for it."""
  R, B = x.tokens_RT.shape[0], x.lengths_B.shape[0]
  shifted_RT = jnp.roll(x.tokens_RT, -1, axis=1)
  row_B = jnp.arange(B, dtype=jnp.int32) // (B // R)
  row_B = jnp.where(x.query_len_B > 0, row_B, R)  # padding sequences: out of range, dropped
  return shifted_RT.at[row_B, x.last_B].set(token_B, mode="drop")


def splits_tokens(layout: PoolLayout | None, x: StepRecord) -> bool:
  """Whether a record's tokens split over the layout's `tokens` axis (prefill context
  parallelism): a ragged record whose T the axis divides. A rows-form record (a burst, a round)
  runs whole on every device of the axis."""
  if layout is None or layout.tokens is None or x.rows_form:
    return False
  return x.tokens_RT.shape[1] % layout.mesh.shape[layout.tokens] == 0


def split_tokens(layout: PoolLayout | None, x: StepRecord) -> StepRecord:
  """The record with its tokens laid out split over the `tokens` axis where it splits them
  (`splits_tokens`): every per-token computation of the model then runs on each device's share
  (XLA's partitioner follows the tokens' layout), and attention on the pool per shard."""
  if not splits_tokens(layout, x):
    return x
  spec = NamedSharding(layout.mesh, layout.spec("batch", "tokens"))
  put = lambda a: None if a is None else jax.lax.with_sharding_constraint(a, spec)
  return dataclasses.replace(
    x, tokens_RT=put(x.tokens_RT), positions_RT=put(x.positions_RT), adapter_RT=put(x.adapter_RT)
  )


@dataclasses.dataclass(frozen=True)
class _Bound:
  """What a program's trace needs besides arrays (static)."""

  graphdef: object
  drafter: Drafter | None
  layout: PoolLayout | None
  d_layout: PoolLayout | None
  options: tuple = ()  # (name, value) pairs for the paged attention's dispatcher

  def cache(self, pool, x: StepRecord, lengths_B, layout) -> PagedCache:
    """The pool as the cache of the record's sequences, laid out as the record's tokens: in rows
    form each row's new tokens are its non-padding positions (a burst's one, a round's k + 1),
    ragged they are where the record's query fields say."""
    # A hybrid pool's windowed layers read their own table; other pools (a drafter's) do not.
    window = x.window_table_BM if isinstance(pool, HybridPool) else None
    if x.rows_form:
      return PagedCache(
        pool, x.block_table_BM, lengths_B, layout, options=self.options, window_table=window
      )
    return PagedCache(
      pool,
      x.block_table_BM,
      lengths_B,
      layout,
      query_start=x.query_start_B,
      query_len=x.query_len_B,
      options=self.options,
      window_table=window,
      split_tokens=splits_tokens(layout, x),
    )

  @property
  def draft_layout(self) -> PoolLayout | None:
    """The draft pool's layout: a draft model's own, else the target's (the MTP heads' and
    prompt lookup's pools are placed as the target's)."""
    return self.layout if self.d_layout is None else self.d_layout

  def draft_cache(self, d_pool, x: StepRecord) -> DraftCache:
    """The draft half of the pools as the drafter's cache over the record's sequences."""
    mtp = self.drafter.needs_hidden
    pool, hidden = d_pool if mtp else (d_pool, None)
    zeros_B = jnp.zeros(x.lengths_B.shape, jnp.int32)
    return DraftCache(self.cache(pool, x, zeros_B, self.draft_layout), hidden)

  def draft_pool(self, dcache: DraftCache):
    pool = dcache.cache.pool
    return (pool, dcache.hidden) if self.drafter.needs_hidden else pool

  def follow(self, d_params, target, d_pool, x: StepRecord, window, *, in_round=False):
    """The drafter caught up with a window the target computed (nothing without one)."""
    if self.drafter is None:
      return d_pool
    dcache = self.draft_cache(d_pool, x)
    dcache = self.drafter.follow(d_params, target, dcache, window, in_round=in_round)
    return self.draft_pool(dcache)

  def whole(self, logits_BV):
    """The logits with every vocabulary column on each device of its replica (rows stay split
    over the data axis): the vocabulary-parallel head's output all-gathered once, so that the
    sampler's sorts, gathers and sums run locally rather than each gathering its own copy."""
    if self.layout is None:
      return logits_BV
    spec = self.layout.spec("batch", *[None] * (logits_BV.ndim - 1))
    return jax.lax.with_sharding_constraint(logits_BV, NamedSharding(self.layout.mesh, spec))

  @property
  def hidden(self) -> bool:
    return self.drafter is not None and self.drafter.needs_hidden


def forward_sample(b: _Bound, states, pools, x: StepRecord):
  """One model call over the step's tokens and the pool (donated), then one draw per sequence
  from its last new token.

  Returns:
    (pools, i32[B] tokens, f32[B] logprobs, i32[B, 5] top tokens, f32[B, 5] top logprobs).
  """
  (state, d_params), (pool, d_pool) = states, pools
  model = nnx.merge(b.graphdef, state)
  x = split_tokens(b.layout, x)
  R, B = x.tokens_RT.shape[0], x.lengths_B.shape[0]
  start_B = jnp.maximum(x.lengths_B, 0)
  with _adapters(x.adapter_RT):
    logits_RJV, cache, *hidden = model(
      x.tokens_RT,
      positions_BT=x.positions_RT,
      cache=b.cache(pool, x, start_B, b.layout),
      logits_at_B=x.last_B.reshape(R, B // R),
      return_hidden=b.hidden,
    )
  out = sample_rows(
    b.whole(logits_RJV.reshape(B, -1)),
    step_keys(x.seed_B, x.step_B),
    x.sampling,
    counts_BV=x.counts_BV,
    prompt_mask_BV=x.prompt_mask_BV,
  )
  # The drafter's heads read no logits while following: any index of each row will do.
  at_R = x.last_B if x.rows_form else jnp.zeros((R,), jnp.int32)
  T = x.tokens_RT.shape[1]
  row_B = jnp.arange(B, dtype=jnp.int32) // (B // R)
  first_B = jnp.where(x.query_len_B > 0, row_B * T + x.query_start_B, -1)
  window = Window(
    x.tokens_RT,
    x.positions_RT,
    start_B,
    _next_tokens(x, out[0]),
    at_R,
    hidden[0] if hidden else None,
    first_B,
  )
  d_pool = b.follow(d_params, model, d_pool, x, window)
  return ((cache.pool, d_pool), *out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BurstCarry:
  """A burst's state between its decode iterations."""

  pools: tuple  # (target pool, draft pool or None)
  token_B: Array  # i32[B] each row's pending token
  counts_BV: Array | None  # i32[B, V] output token counts (penalties), else None
  outs: tuple  # the draws so far: i32[I, B] tokens, f32[I, B] logprobs, [I, B, 5] top ones


def decode_burst(b: _Bound, states, pools, x: StepRecord, capacity: int, n_steps: Array):
  """`n_steps` (i32[], 1 to `capacity`) decode iterations: compute each row's pending token,
  sample the next, repeat. One program serves every burst length up to `capacity` (the
  engine's online and offline bursts, a burst cut to what its rows still need); its loop runs
  `n_steps` times.

  `x.tokens_RT` [B, 1] holds each row's pending token (sampled, not yet in the pool), at
  position `x.lengths_B`; the block table covers positions up to lengths + n_steps - 1;
  `x.step_B` is the index of the first token the burst draws; `x.counts_BV` is updated on the
  device.

  Returns:
    (pools, i32[capacity, B] tokens, f32[capacity, B] logprobs, i32[capacity, B, 5] top ids,
    f32[capacity, B, 5] top logprobs (the rows past `n_steps` zeros), i32[B, V] counts after
    the burst, or None without penalties).
  """
  if x.sampling.allowed_bits is not None:
    raise ValueError("decode_burst: a guided row's mask needs the host after every token")
  state, d_params = states
  model = nnx.merge(b.graphdef, state)
  valid_B = x.lengths_B >= 0
  B = x.tokens_RT.shape[0]

  def body(i, c: BurstCarry):
    pool, d_pool = c.pools
    positions_B1 = jnp.where(valid_B, x.lengths_B + i, -1)[:, None]
    at_B = positions_B1[:, 0] + ~valid_B  # padding rows: 0
    cache = b.cache(pool, x, at_B, b.layout)
    logits_B1V, cache, *hidden = model(
      c.token_B[:, None], positions_BT=positions_B1, cache=cache, return_hidden=b.hidden
    )
    out = sample_rows(
      b.whole(logits_B1V[:, 0]),
      step_keys(x.seed_B, x.step_B + i),
      x.sampling,
      counts_BV=c.counts_BV,
      prompt_mask_BV=x.prompt_mask_BV,
    )
    window = Window(
      c.token_B[:, None],
      positions_B1,
      at_B,
      out[0][:, None],
      jnp.zeros_like(at_B),
      hidden[0] if hidden else None,
      jnp.where(valid_B, jnp.arange(B, dtype=jnp.int32), -1),
    )
    d_pool = b.follow(d_params, model, d_pool, x, window)
    counts_BV = c.counts_BV
    if counts_BV is not None:
      counts_BV = counts_BV.at[jnp.arange(B), out[0]].add(1)
    outs = tuple(o.at[i].set(v) for o, v in zip(c.outs, out))
    return BurstCarry((cache.pool, d_pool), out[0], counts_BV, outs)

  k = min(MAX_LOGPROBS, model.cfg.vocab_size)
  outs = (
    jnp.zeros((capacity, B), jnp.int32),
    jnp.zeros((capacity, B), jnp.float32),
    jnp.zeros((capacity, B, k), jnp.int32),
    jnp.zeros((capacity, B, k), jnp.float32),
  )
  carry = BurstCarry(pools, x.tokens_RT[:, 0], x.counts_BV, outs)
  with _adapters(x.adapter_RT):  # each row's slot, every iteration
    carry = jax.lax.fori_loop(0, jnp.clip(n_steps, 1, capacity), body, carry)
  return (carry.pools, *carry.outs, carry.counts_BV)


def speculative_round(b: _Bound, states, pools, x: StepRecord, k: int):
  """One round of speculation for every row: the draft half and the verify half in one program.

  Both pools then hold entries for positions up to lengths + k; the host keeps lengths + 1 + a_b
  of them (cut at stops), and the next round overwrites the rest.

  Returns:
    (pools, i32[k+1, B] emitted tokens (row b's first a_b + 1 are real), f32[k+1, B] their target
    logprobs, i32[k+1, B, 5] top ids, f32[k+1, B, 5] top logprobs, i32[B] accepted drafts a_b).
  """
  pools, draft_BJ, q_BJV = speculative_draft(b, states, pools, x, k)
  return speculative_verify(b, states, pools, x, draft_BJ, q_BJV, None)


def speculative_draft(b: _Bound, states, pools, x: StepRecord, k: int):
  """The draft half of a round: (pools, i32[B, k] draft tokens, f32[B, k, V] the distributions
  they were drawn from). A guided row's first draft is drawn under its current mask."""
  (state, d_params), (pool, d_pool) = states, pools
  keys_BT = round_keys(x.seed_B, x.step_B, k + 1)
  dcache = b.draft_cache(d_pool, x)
  dcache, draft_BJ, q_BJV = b.drafter.propose(
    d_params,
    nnx.merge(b.graphdef, state),
    dcache,
    x.tokens_RT[:, 0],
    x.lengths_B,
    keys_BT,
    x.sampling,
    k,
  )
  return (pool, b.draft_pool(dcache)), draft_BJ, q_BJV


def speculative_verify(b: _Bound, states, pools, x: StepRecord, draft_BJ, q_BJV, allowed_BTW):
  """The verify half of a round: the target over [pending, d_1..d_k], the rejection sampler,
  and the drafter following the round's window. Returns what `speculative_round` returns.

  Args:
    allowed_BTW: i32[B, k+1, W] the allowed tokens at each of the k + 1 positions (guided rows'
      from their grammar after the drafts before it, all set for the others), or None. A draft
      the mask refuses has target probability 0, so it is rejected there: the law of every
      emitted token is the target's masked one, whatever the drafts were.
  """
  (state, d_params), (pool, d_pool) = states, pools
  model = nnx.merge(b.graphdef, state)
  k = draft_BJ.shape[1]
  keys_BT = round_keys(x.seed_B, x.step_B, k + 1)
  cache = b.cache(pool, x, jnp.maximum(x.lengths_B, 0), b.layout)
  v = verify_drafts(
    model,
    cache,
    x.tokens_RT[:, 0],
    x.lengths_B,
    draft_BJ,
    q_BJV,
    keys_BT[:, k],
    x.sampling,
    hidden=b.hidden,
    allowed_BTW=allowed_BTW,
  )
  d_pool = b.follow(d_params, model, d_pool, x, v.window, in_round=True)
  lp_BT, top_ids_BTk, top_lp_BTk = top_logprobs(v.logp_BTV, v.new_BT)
  return (
    (v.cache.pool, d_pool),
    v.new_BT.T,
    lp_BT.T,
    top_ids_BTk.transpose(1, 0, 2),
    top_lp_BTk.transpose(1, 0, 2),
    v.accepted_B,
  )


def prompt_logprobs(b: _Bound, state, tokens_1T, adapter_1T=None):
  """Log-probabilities of a prompt's tokens under the model (the target's `state`).

  Args:
    tokens_1T: i32[1, T] the prompt, right-padded.
    adapter_1T: i32[1, T] its LoRA adapter slot at every position where the model holds served
      adapters, else None.

  Returns:
    (f32[T] at position t the logprob of token t + 1, i32[T, 5] the top tokens there, f32[T, 5]
    their logprobs); the last real position's and the padding's values are not used.
  """
  model = nnx.merge(b.graphdef, state)
  with _adapters(adapter_1T):
    logits_1TV = model(tokens_1T)
  logp_TV = jax.nn.log_softmax(logits_1TV[0].astype(jnp.float32), axis=-1)
  next_T = jnp.roll(tokens_1T[0], -1)
  lp_T = jnp.take_along_axis(logp_TV, next_T[:, None], axis=-1)[:, 0]
  top_lp_Tk, top_ids_Tk = jax.lax.top_k(logp_TV, min(MAX_LOGPROBS, logp_TV.shape[-1]))
  return lp_T, top_ids_Tk.astype(jnp.int32), top_lp_Tk


def copy_blocks(b: _Bound, pools, src_c, dst_c):
  """Copies pool blocks src -> dst (i32[c] each) in every pool array; the pools are donated."""
  target, draft = pools
  copy = lambda lay: lambda a_LP_: copy_pages(a_LP_, src_c, dst_c, lay)
  if isinstance(target, HybridPool):  # each of its pools copies the pairs that name it
    return target.copy(src_c, dst_c, b.layout), draft
  return jax.tree.map(copy(b.layout), target), jax.tree.map(copy(b.draft_layout), draft)


@dataclasses.dataclass(frozen=True)
class Programs:
  """The jitted step programs of one model graph (the arguments after the bound statics)."""

  forward_sample: Callable
  decode_burst: Callable
  speculative_round: Callable | None  # with a drafter only
  speculative_draft: Callable | None  # the round in two halves, for guided rows: the host
  speculative_verify: Callable | None  # walks the drafts through each grammar in between
  prompt_logprobs: Callable
  copy_blocks: Callable


def jit_program(make_run: Callable[[tuple], Callable], **jit_kwargs) -> Callable:
  """The default way to compile a step program: `make_run(())` (no kernel options) under
  `jax.jit`, the pools (argument 1) donated."""
  return jax.jit(make_run(()), donate_argnums=(1,), **jit_kwargs)


@functools.cache
def programs(
  graphdef,
  drafter: Drafter | None = None,
  layout: PoolLayout | None = None,
  d_layout: PoolLayout | None = None,
  pool_shardings: tuple | None = None,
  compile: Callable = jit_program,
) -> Programs:
  """The step programs with the statics bound, compiled lazily per shape; one set per
  combination. `pool_shardings`: the pools' NamedShardings as a hashable (treedef, leaves)
  pair (`sharding_key`), or None on one device; every program returns its pools laid out so.
  `compile(make_run, **jit_kwargs)` makes each program from `make_run(options)`, the program's
  function with those kernel options bound (`_Bound.options`); it must be hashable (a
  specialisation's is a frozen dataclass)."""
  shardings = None if pool_shardings is None else jax.tree.unflatten(*pool_shardings)

  def pinned(pools):
    return pools if shardings is None else jax.lax.with_sharding_constraint(pools, shardings)

  def maker(f):
    def make_run(options: tuple):
      b = _Bound(graphdef, drafter, layout, d_layout, options)

      def run(states, pools, *args):
        pools, *outs = f(b, states, pools, *args)
        return (pinned(pools), *outs)

      return run

    return make_run

  b = _Bound(graphdef, drafter, layout, d_layout)
  speculate = drafter is not None
  return Programs(
    forward_sample=compile(maker(forward_sample)),
    decode_burst=compile(maker(decode_burst), static_argnums=(3,)),
    speculative_round=compile(maker(speculative_round), static_argnums=(3,)) if speculate else None,
    speculative_draft=compile(maker(speculative_draft), static_argnums=(3,)) if speculate else None,
    speculative_verify=compile(maker(speculative_verify)) if speculate else None,
    prompt_logprobs=jax.jit(functools.partial(prompt_logprobs, b)),
    copy_blocks=jax.jit(
      lambda pools, src_c, dst_c: pinned(copy_blocks(b, pools, src_c, dst_c)), donate_argnums=(0,)
    ),
  )


def sharding_key(shardings) -> tuple | None:
  """A pool shardings tree as `programs`' hashable argument."""
  if shardings is None:
    return None
  leaves, treedef = jax.tree.flatten(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
  return treedef, tuple(leaves)


__all__ = ["Programs", "StepRecord", "jit_program", "programs", "sharding_key"]
