"""The engine's device programs, each over one `StepInputs` pytree: a mixed step, a burst of
decode steps, a speculative round, block copies.

Each is jitted once per bucket of shapes and donates the pools, so XLA updates them in place.
The scheduler (`atlas_jax.serving.scheduler`) decides what runs and the model runner
(`atlas_jax.serving.runner`) builds the inputs; these only compute.

* `forward_sample`: one model call over rows of new tokens (prefill chunks right-padded, or one
  decode token), then one draw per row from its last real token.
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

With a drafter (`atlas_jax.decoding.drafters`), every program takes `states` and `pools` as
(target, draft) pairs and lets the drafter follow every window the target computes (prefill
chunks and bursts too), into its own pool indexed by the same block tables, so a round needs no
catch-up. A draft model's pool is its own `init_pool`; the MTP heads' is their pool and the
target's hidden states per slot, [2, P, Z, D]. Without one the draft halves are None.

On a device mesh, `layout` (the target's, and `d_layout` a draft model's) places the pools and
every read and write of them runs per shard (`atlas_jax.cache.paged`); the inputs' rows are
split over the data axis, replica r's rows in its own slice of B.

`programs(graphdef, drafter, layout, d_layout)` returns the jitted programs with these bound
in, made once per combination: a step then hashes no graph, only its arrays' shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from atlas_jax.cache.paged import PagedCache, PoolLayout, copy_pages
from atlas_jax.decoding.drafters import DraftCache, Drafter, Window
from atlas_jax.decoding.sampling import MAX_LOGPROBS, SamplingArrays, sample_rows, step_keys
from atlas_jax.decoding.speculative import round_keys, top_logprobs, verify_drafts

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
  """What one call of a program takes per row: B rows, padded to a bucket (a padding row has
  length -1 and writes nothing); on a mesh, replica r's rows are its slice of B."""

  tokens_BT: Array  # i32[B, T] new tokens, right-padded; a burst or a round: T = 1, the pending
  positions_BT: Array  # i32[B, T] their positions; -1: padding
  block_table_BM: Array  # i32[B, M] each row's blocks (global ids), reserved ones included
  lengths_B: Array  # i32[B] tokens in the pool before this call; -1: a padding row
  last_B: Array  # i32[B] index in T of each row's last real token (its draw is the row's)
  seed_B: Array  # i32[B]
  step_B: Array  # i32[B] the index of the first token this call draws for the row
  sampling: SamplingArrays  # [B] per-row sampling controls (guided masks, logit bias)
  counts_BV: Array | None = None  # i32[B, V] output token counts (penalties), else None
  prompt_mask_BV: Array | None = None  # bool[B, V] the prompt's tokens (penalties), else None


def _next_tokens(tokens_BT, last_B, token_B):
  """i32[B, T] the token after each position: the row shifted left, then the drawn token."""
  t_1T = jnp.arange(tokens_BT.shape[1])[None, :]
  shifted_BT = jnp.roll(tokens_BT, -1, axis=1)
  return jnp.where(t_1T == last_B[:, None], token_B[:, None], shifted_BT)


@dataclasses.dataclass(frozen=True)
class _Bound:
  """What a program's trace needs besides arrays (static)."""

  graphdef: object
  drafter: Drafter | None
  layout: PoolLayout | None
  d_layout: PoolLayout | None

  def draft_cache(self, d_pool, block_table_BM) -> DraftCache:
    """The draft half of the pools as the drafter's cache over these rows' block tables."""
    mtp = self.drafter.needs_hidden
    pool, hidden = d_pool if mtp else (d_pool, None)
    lay = self.layout if mtp else self.d_layout
    zeros_B = jnp.zeros(block_table_BM.shape[:1], jnp.int32)
    return DraftCache(PagedCache(pool, block_table_BM, zeros_B, lay), hidden)

  def draft_pool(self, dcache: DraftCache):
    pool = dcache.cache.pool
    return (pool, dcache.hidden) if self.drafter.needs_hidden else pool

  def follow(self, d_params, target, d_pool, block_table_BM, window, *, in_round=False):
    """The drafter caught up with a window the target computed (nothing without one)."""
    if self.drafter is None:
      return d_pool
    dcache = self.draft_cache(d_pool, block_table_BM)
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


def forward_sample(b: _Bound, states, pools, x: StepInputs):
  """One model call over the pool (donated), then one draw per row from its last real token.

  Returns:
    (pools, i32[B] tokens, f32[B] logprobs, i32[B, 5] top tokens, f32[B, 5] top logprobs).
  """
  (state, d_params), (pool, d_pool) = states, pools
  model = nnx.merge(b.graphdef, state)
  start_B = jnp.maximum(x.lengths_B, 0)
  cache = PagedCache(pool, x.block_table_BM, start_B, b.layout)
  logits_B1V, cache, *hidden = model(
    x.tokens_BT,
    positions_BT=x.positions_BT,
    cache=cache,
    logits_at_B=x.last_B,
    return_hidden=b.hidden,
  )
  out = sample_rows(
    b.whole(logits_B1V[:, 0]),
    step_keys(x.seed_B, x.step_B),
    x.sampling,
    counts_BV=x.counts_BV,
    prompt_mask_BV=x.prompt_mask_BV,
  )
  window = Window(
    x.tokens_BT,
    x.positions_BT,
    start_B,
    _next_tokens(x.tokens_BT, x.last_B, out[0]),
    x.last_B,
    hidden[0] if hidden else None,
  )
  d_pool = b.follow(d_params, model, d_pool, x.block_table_BM, window)
  return ((cache.pool, d_pool), *out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BurstCarry:
  """A burst's state between its decode iterations."""

  pools: tuple  # (target pool, draft pool or None)
  token_B: Array  # i32[B] each row's pending token
  counts_BV: Array | None  # i32[B, V] output token counts (penalties), else None
  outs: tuple  # the draws so far: i32[I, B] tokens, f32[I, B] logprobs, [I, B, 5] top ones


def decode_burst(b: _Bound, states, pools, x: StepInputs, capacity: int, n_steps: Array):
  """`n_steps` (i32[], 1 to `capacity`) decode iterations: compute each row's pending token,
  sample the next, repeat. One program serves every burst length up to `capacity` (the
  engine's online and offline bursts, a burst cut to what its rows still need); its loop runs
  `n_steps` times.

  `x.tokens_BT` [B, 1] holds each row's pending token (sampled, not yet in the pool), at
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
  B = x.tokens_BT.shape[0]

  def body(i, c: BurstCarry):
    pool, d_pool = c.pools
    positions_B1 = jnp.where(valid_B, x.lengths_B + i, -1)[:, None]
    at_B = positions_B1[:, 0] + ~valid_B  # padding rows: 0
    cache = PagedCache(pool, x.block_table_BM, at_B, b.layout)
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
    )
    d_pool = b.follow(d_params, model, d_pool, x.block_table_BM, window)
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
  carry = BurstCarry(pools, x.tokens_BT[:, 0], x.counts_BV, outs)
  carry = jax.lax.fori_loop(0, jnp.clip(n_steps, 1, capacity), body, carry)
  return (carry.pools, *carry.outs, carry.counts_BV)


def speculative_round(b: _Bound, states, pools, x: StepInputs, k: int):
  """One round of speculation for every row: the draft half and the verify half in one program.

  Both pools then hold entries for positions up to lengths + k; the host keeps lengths + 1 + a_b
  of them (cut at stops), and the next round overwrites the rest.

  Returns:
    (pools, i32[k+1, B] emitted tokens (row b's first a_b + 1 are real), f32[k+1, B] their target
    logprobs, i32[k+1, B, 5] top ids, f32[k+1, B, 5] top logprobs, i32[B] accepted drafts a_b).
  """
  pools, draft_BJ, q_BJV = speculative_draft(b, states, pools, x, k)
  return speculative_verify(b, states, pools, x, draft_BJ, q_BJV, None)


def speculative_draft(b: _Bound, states, pools, x: StepInputs, k: int):
  """The draft half of a round: (pools, i32[B, k] draft tokens, f32[B, k, V] the distributions
  they were drawn from). A guided row's first draft is drawn under its current mask."""
  (state, d_params), (pool, d_pool) = states, pools
  keys_BT = round_keys(x.seed_B, x.step_B, k + 1)
  dcache = b.draft_cache(d_pool, x.block_table_BM)
  dcache, draft_BJ, q_BJV = b.drafter.propose(
    d_params,
    nnx.merge(b.graphdef, state),
    dcache,
    x.tokens_BT[:, 0],
    x.lengths_B,
    keys_BT,
    x.sampling,
    k,
  )
  return (pool, b.draft_pool(dcache)), draft_BJ, q_BJV


def speculative_verify(b: _Bound, states, pools, x: StepInputs, draft_BJ, q_BJV, allowed_BTW):
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
  cache = PagedCache(pool, x.block_table_BM, jnp.maximum(x.lengths_B, 0), b.layout)
  v = verify_drafts(
    model,
    cache,
    x.tokens_BT[:, 0],
    x.lengths_B,
    draft_BJ,
    q_BJV,
    keys_BT[:, k],
    x.sampling,
    hidden=b.hidden,
    allowed_BTW=allowed_BTW,
  )
  d_pool = b.follow(d_params, model, d_pool, x.block_table_BM, v.window, in_round=True)
  lp_BT, top_ids_BTk, top_lp_BTk = top_logprobs(v.logp_BTV, v.new_BT)
  return (
    (v.cache.pool, d_pool),
    v.new_BT.T,
    lp_BT.T,
    top_ids_BTk.transpose(1, 0, 2),
    top_lp_BTk.transpose(1, 0, 2),
    v.accepted_B,
  )


def prompt_logprobs(b: _Bound, state, tokens_1T):
  """Log-probabilities of a prompt's tokens under the model (the target's `state`).

  Args:
    tokens_1T: i32[1, T] the prompt, right-padded.

  Returns:
    (f32[T] at position t the logprob of token t + 1, i32[T, 5] the top tokens there, f32[T, 5]
    their logprobs); the last real position's and the padding's values are not used.
  """
  model = nnx.merge(b.graphdef, state)
  logp_TV = jax.nn.log_softmax(model(tokens_1T)[0].astype(jnp.float32), axis=-1)
  next_T = jnp.roll(tokens_1T[0], -1)
  lp_T = jnp.take_along_axis(logp_TV, next_T[:, None], axis=-1)[:, 0]
  top_lp_Tk, top_ids_Tk = jax.lax.top_k(logp_TV, min(MAX_LOGPROBS, logp_TV.shape[-1]))
  return lp_T, top_ids_Tk.astype(jnp.int32), top_lp_Tk


def copy_blocks(b: _Bound, pools, src_c, dst_c):
  """Copies pool blocks src -> dst (i32[c] each) in every pool array; the pools are donated."""
  target, draft = pools
  copy = lambda lay: lambda a_LP_: copy_pages(a_LP_, src_c, dst_c, lay)
  d_layout = b.layout if b.hidden else b.d_layout
  return jax.tree.map(copy(b.layout), target), jax.tree.map(copy(d_layout), draft)


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


log = logging.getLogger(__name__)

# XLA's CPU backend hands dots, elementwise fusions and reductions to YNNPACK by default. The
# step programs are many small ops (the paged attention's page loop, a decode step's norms and
# softmaxes at a few dozen rows), for which YNNPACK's reductions and elementwise calls cost more
# than XLA's own loops, threads included: on 2 cores the batch-32 decode step took 30.8 ms by
# default and 27.5 ms with only the dots in YNNPACK, prefill chunks unchanged (bench/cpu_profile.py
# --path decode|prefill; a training step gains nothing, so the trainer keeps the default).
# XLA also rewrites every reduction of more than 32 elements into a reduce-window of 32 and a
# reduction of the windows, and a reduce-window fuses nothing before it: the paged decode
# attention's scores, a product summed over a head's 64 dims, were written out whole
# ([B, C, K, G, 64] a page step) and read back. Without that pass the product and its sum are one
# loop: the decode step 24.6 -> 20.5 ms (bench/cpu_profile.py --path decode), the paged
# attention alone 12.1 ms at XLA's defaults and 5.1 ms with these options (bench/cpu_micro.py
# --only paged), a 4 x 128 prefill 102 -> 106 ms.
CPU_COMPILER_OPTIONS = {
  "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
  "xla_disable_hlo_passes": "tree_reduction_rewriter",
}


@functools.cache
def compiler_options(options: tuple = ()) -> dict:
  """`CPU_COMPILER_OPTIONS` (or the `options` items given) on the CPU backend, if this XLA knows
  them; {} elsewhere."""
  wanted = dict(options) or CPU_COMPILER_OPTIONS
  if jax.default_backend() != "cpu":
    return {}
  try:
    jax.jit(lambda x: x + 1, compiler_options=wanted).lower(jnp.zeros(())).compile()
  except Exception as e:  # an XLA that renamed or dropped an option: without them, said once
    log.info("serving programs: without %s (%s)", sorted(wanted), str(e).splitlines()[0])
    return {}
  return dict(wanted)


# The same with no YNNPACK at all: the dots are XLA's own. At a few rows a projection is a
# matrix-vector product in all but name, bound by reading its weights; on some CPUs YNNPACK's
# dots read them at half the speed XLA's do there, and win from a few dozen rows on (the runner's
# start-up probe, `ModelRunner.matmul_plan`, finds where).
CPU_XLA_DOTS_OPTIONS = {**CPU_COMPILER_OPTIONS, "xla_cpu_experimental_ynn_fusion_type": ""}


# With YNNPACK's reductions too: at a decode step of a few rows (`YNN_REDUCE_ROWS` at most) the
# paged attention's page step, scored over `YNN_REDUCE_KEYS` keys, is then one YNNPACK call where
# XLA's loops spend more on each of the small products than they compute. Which wins depends on
# the heads: on 2 Zen 4 cores at 4 rows, the tiny preset's attention (6 heads of 32, 2 kv heads)
# took 0.94 ms a step this way against 1.18-1.28 ms, its whole 8-step burst 0.93 -> 1.06 of
# `generate`'s loop; 8 heads of 64 over 4 kv heads took 1.6x longer, and at 8 rows and more the
# tiny preset's burst lost too. So the runner times the decode attention both ways at start-up
# (`serve.engine.cpu_reductions`, `runner.time_decode_attention`).
CPU_YNN_REDUCE_OPTIONS = {
  **CPU_COMPILER_OPTIONS,
  "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,"
  "LIBRARY_FUSION_TYPE_REDUCE",
}
YNN_REDUCE_ROWS = 4
YNN_REDUCE_KEYS = 32


def reduce_compiler_options() -> dict:
  """`CPU_YNN_REDUCE_OPTIONS` on the CPU backend, if this XLA knows them; {} elsewhere."""
  return compiler_options(tuple(CPU_YNN_REDUCE_OPTIONS.items()))


@dataclasses.dataclass(frozen=True)
class ByRows:
  """A step program compiled several ways, called by its token rows (the step inputs' B x T):
  the first of `tiers` (most rows, program) whose rows it does not exceed, else `many`. On CPU
  the tiers are XLA's own dots (a few rows, `xla_dots_rows`), then YNNPACK's reductions at the
  row counts of `ynn_reduce_rows` (`many` at those between); `many` is YNNPACK's dots alone."""

  tiers: tuple[tuple[int, Callable], ...]
  many: Callable

  def pick(self, x: StepInputs) -> Callable:
    rows = x.tokens_BT.shape[0] * x.tokens_BT.shape[1]
    return next((f for most, f in self.tiers if rows <= most), self.many)

  def __call__(self, states, pools, x: StepInputs, *args):
    return self.pick(x)(states, pools, x, *args)

  def lower(self, states, pools, x: StepInputs, *args):
    return self.pick(x).lower(states, pools, x, *args)

  def _cache_size(self) -> int:  # as a jitted function's: the shapes compiled, every way
    ways = {id(f): f for f in (self.many, *(f for _, f in self.tiers))}
    return sum(f._cache_size() for f in ways.values())


@functools.cache
def programs(
  graphdef,
  drafter: Drafter | None = None,
  layout: PoolLayout | None = None,
  d_layout: PoolLayout | None = None,
  pool_shardings: tuple | None = None,
  xla_dots_rows: int = 0,
  ynn_reduce_rows: tuple[int, ...] = (),
) -> Programs:
  """The step programs with the statics bound, compiled lazily per shape; one set per
  combination. `pool_shardings`: the pools' NamedShardings as a hashable (treedef, leaves)
  pair (`sharding_key`), or None on one device; every program returns its pools laid out so.
  `xla_dots_rows` > 0 (CPU only): a step of at most that many token rows compiles its dots as
  XLA's own, not YNNPACK's; a step of more rows, exactly as many as one of `ynn_reduce_rows`,
  hands YNNPACK its reductions too and walks `YNN_REDUCE_KEYS` keys a decode attention
  iteration (`ByRows`)."""
  b = _Bound(graphdef, drafter, layout, d_layout)
  shardings = None if pool_shardings is None else jax.tree.unflatten(*pool_shardings)

  def pinned(pools):
    return pools if shardings is None else jax.lax.with_sharding_constraint(pools, shardings)

  def bind(f, decode_keys=None):
    def run(states, pools, *args):
      del decode_keys
      pools, *outs = f(b, states, pools, *args)
      return (pinned(pools), *outs)

    return run

  speculate = drafter is not None
  options = compiler_options()
  # (most rows, compiler options, decode attention keys an iteration); None: `many`'s way
  tiers: list[tuple[int, dict | None, int | None]] = []
  if options and xla_dots_rows > 0:
    tiers.append((xla_dots_rows, CPU_XLA_DOTS_OPTIONS, None))
  reduce_options = reduce_compiler_options() if options else {}
  for rows in sorted(ynn_reduce_rows) if reduce_options else ():
    below = tiers[-1][0] if tiers else 0
    if rows <= below:
      continue
    if rows - 1 > below:  # the row counts in between: YNNPACK's dots alone
      tiers.append((rows - 1, None, None))
    tiers.append((rows, reduce_options, YNN_REDUCE_KEYS))

  def jit(f, **kw):
    many = jax.jit(bind(f), donate_argnums=(1,), compiler_options=options, **kw)
    if not tiers:
      return many
    ways = {}  # one jitted function per way, shared by its tiers

    def way(opts, keys):
      if opts is None:
        return many
      key = (tuple(sorted(opts.items())), keys)
      if key not in ways:
        ways[key] = jax.jit(bind(f, keys), donate_argnums=(1,), compiler_options=dict(opts), **kw)
      return ways[key]

    return ByRows(tuple((rows, way(opts, keys)) for rows, opts, keys in tiers), many)

  return Programs(
    forward_sample=jit(forward_sample),
    decode_burst=jit(decode_burst, static_argnums=(3,)),
    speculative_round=jit(speculative_round, static_argnums=(3,)) if speculate else None,
    speculative_draft=jit(speculative_draft, static_argnums=(3,)) if speculate else None,
    speculative_verify=jit(speculative_verify) if speculate else None,
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


__all__ = ["ByRows", "Programs", "StepInputs", "programs", "sharding_key"]
