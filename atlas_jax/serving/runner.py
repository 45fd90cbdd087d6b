"""The model runner: owns the device mesh, the placed weights, the pools and the jitted programs,
and runs each engine step as one call.

The scheduler hands it rows (`batch.Row`: a request, the tokens it computes, where they start,
its blocks). A step's rows, prompt chunks and decode tokens alike, become one ragged
`batch.StepRecord` (every new token on one flat axis per data-parallel replica, each sequence's
query start, length and context) and one call of `steps.forward_sample`: every weight is read
once per step, and attention reads each sequence's pages in place through
`kernels.ragged_paged_attention`, whatever its number of new tokens. Decode bursts and
speculative rounds take one token per sequence, in rows form.

Compiled shapes are bounded: a step's tokens per replica round up to a power of two (at least
`MIN_STEP_TOKENS`), its sequence slots are min(its tokens, the largest batch), and block tables
come in a few widths (`WIDTH_GROWTH` apart); bursts and rounds take a power-of-two batch. So the
programs a server compiles are known at start-up (`shapes`), and `warmup` compiles them: the
first of each kind before the server answers, the rest on a background thread.

The weights are held as the model holds them: each layer stack one array, run by the model's
layer scan, so a program's size and its compile time do not grow with depth. On a mesh
(`atlas_jax.serving.mesh`), weights are placed by their logical axes, a KV pool's kv heads split
over the tensor axis (repeated up to it when fewer), an MLA latent pool held whole per replica,
and every pool's pages split over the data axis.

This is the accelerator path. A backend's specialisation subclasses it behind a few hooks: how
the weights are held (`hold`), how a step's rows become calls (`execute`, `shapes`), how programs
compile (`compile_programs`); XLA's CPU backend has one (`atlas_jax.serving.cpu`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from atlas_jax import host_memory
from atlas_jax.decoding.drafters import Drafter, NGramDrafter, hidden_store
from atlas_jax.decoding.sampling import PADDING, SamplingArrays
from atlas_jax.kernels.quantized_kv import code_dtype
from atlas_jax.serving import batch, sizing, steps
from atlas_jax.serving import mesh as placement
from atlas_jax.serving.batch import Layout, Row, StepRecord, pow2

Array = jax.Array
log = logging.getLogger("atlas_jax.serving")

# A step's tokens per replica round up to a power of two from here: below it, a bucket would
# save less work than a compiled shape costs.
MIN_STEP_TOKENS = 16
# Block-table widths (pages per sequence in a call) grow by this factor. On the accelerator
# kernels a table's width sets only bounds (attention walks the pages each sequence holds), so a
# coarse ladder costs a little index traffic and saves compiled shapes.
WIDTH_GROWTH = 4
# The decode batch of an accelerator step: a decode step reads every weight once whatever its
# rows, so rows up to this many cost about the same and need no buckets of their own.
MIN_DECODE_BATCH = 8


@jax.jit
def _carried(tok_IB, counts_BV, prompt_mask_BV, index_B, n_steps):
  """A chained burst's inputs from the burst before it, still on the device: each row's last
  draw (the `n_steps`-th) as its pending token (and its penalty counts), row b taken from
  `index_B[b]`. One dispatch: as eager indexing, each of these ops cost more host time than a
  burst step."""
  take = lambda x: None if x is None else x[index_B]
  last_B = jax.lax.dynamic_index_in_dim(tok_IB, n_steps - 1, keepdims=False)
  return last_B[index_B][:, None], take(counts_BV), take(prompt_mask_BV)


def padding_record(R: int, T: int, B: int, M: int) -> StepRecord:
  """A record of B padding sequences (length -1, no tokens: nothing is written or read) on R
  rows of T tokens, tables M wide."""
  zeros = lambda *shape: np.zeros(shape, np.int32)
  return StepRecord(
    tokens_RT=zeros(R, T),
    positions_RT=np.full((R, T), -1, np.int32),
    query_start_B=zeros(B),
    query_len_B=zeros(B),
    lengths_B=np.full((B,), -1, np.int32),
    last_B=zeros(B),
    block_table_BM=zeros(B, M),
    seed_B=zeros(B),
    step_B=zeros(B),
    sampling=SamplingArrays.from_params([], pad_to=B),
  )


@dataclasses.dataclass(frozen=True)
class Shape:
  """A compiled program's shape: `kind` ("step", "burst", "speculate"; a specialisation may
  add its own), b sequence slots per replica, T tokens per row (a burst's capacity, a round's
  k + 1), M block-table columns."""

  kind: str
  b: int
  T: int
  M: int

  def __str__(self) -> str:
    return f"{self.kind} b={self.b} T={self.T} M={self.M}"


@dataclasses.dataclass
class Drawn:
  """A dispatched burst or round: its rows, and its draws, on the device until read."""

  rows: list[Row]
  slot: np.ndarray  # i32[n rows] each row's index in the step's batch
  prompt_mask_BV: Array | None  # bool[B, V] (penalties), for a burst chained on this one
  tok_IB: Array  # i32[I, B] draws per iteration (a round: its k + 1 positions)
  lp_IB: Array  # f32[I, B]
  top_ids_IBk: Array  # i32[I, B, 5]
  top_lp_IBk: Array  # f32[I, B, 5]
  counts_BV: Array | None  # i32[B, V] output token counts after the burst (penalties)
  n_draws: np.ndarray | None = None  # i32[n rows] real draws per row (a round)
  n_steps: int | None = None  # a burst's iterations: the first n_steps of its I rows are draws


class ModelRunner:
  """Runs the model's programs over the pools: the accelerator path.

  Args:
    model: the served Transformer (already repeated to the tensor size where needed).
    draft: the draft model, or None ("mtp" and prompt lookup draft without one: `drafter`).
    drafter: the drafter for `draft`, or None.
    mesh: a serving mesh (`placement.serving_mesh`), or None for one device.
    block_size: Z.
    max_blocks: M at most, the block-table columns of the longest context.
    min_batch_bucket: a burst's or round's rows per replica are padded to a power of two, at
      least this many (None: `MIN_DECODE_BATCH`).
    lora: the model holds served LoRA adapters (`atlas_jax.serving.lora`): every record carries
      its tokens' adapter slots.
  """

  def __init__(
    self,
    model,
    *,
    draft,
    drafter: Drafter | None,
    mesh: Mesh | None,
    block_size: int,
    max_blocks: int,
    min_batch_bucket: int | None = None,
    kv_cache_dtype: str = "auto",
    lora: bool = False,
  ):
    cfg = model.cfg
    self.lora = lora
    self.model_config = cfg
    # The target pool's dtype: the model's, or 8-bit codes with their scales.
    self.kv_dtype = code_dtype(kv_cache_dtype) or jnp.dtype(cfg.dtype)
    self.mesh = mesh
    self.n_replicas, self.tensor = (1, 1) if mesh is None else placement.mesh_sizes(mesh)
    self.block_size, self.max_blocks = block_size, max_blocks
    self.min_batch_bucket = MIN_DECODE_BATCH if min_batch_bucket is None else min_batch_bucket
    # Tables narrower than 64 tokens would only add compiled shapes.
    self.min_blocks = min(pow2(-(-64 // block_size)), max_blocks)
    self.model, self.draft, self.drafter = model, draft, drafter
    self.limits = None  # the engine's resolved limits (`allocate`)
    # Blocks per replica of the windowed layers' own pool, for a model mixing windowed and
    # full-attention layers (`allocate`; `atlas_jax.cache.paged.HybridPool`), else None.
    self.n_window_blocks: int | None = None
    # Every shape a call has run (a program compiles once per shape; see `shapes`).
    self.shapes_met: set[Shape] = set()
    self.rules = placement.model_rules(cfg, self.tensor)
    self.layout = placement.layout(mesh, self.rules)
    graphdef, state = nnx.split(model)
    self.graphdef = graphdef
    d_params, self.d_rules, self.d_layout = None, None, None
    if draft is not None:
      self.d_rules = placement.model_rules(draft.cfg, self.tensor)
      if mesh is not None and self.d_rules is not placement.SERVING_RULES:
        log.info(
          "draft: %d query heads, %d kv heads: held whole by each of the %d tensor devices",
          draft.cfg.n_heads,
          draft.cfg.n_kv_heads,
          self.tensor,
        )
      self.d_layout = placement.layout(mesh, self.d_rules)
      d_params = self.hold(placement.place_state(nnx.state(draft), mesh, self.d_rules))
    self.states = (self.hold(placement.place_state(state, mesh, self.rules)), d_params)
    self.pools = None
    self.programs: steps.Programs | None = None
    self._background: threading.Thread | None = None

  # -- hooks for a backend's specialisation ------------------------------------------------------

  def hold(self, placed_state):
    """How a model's placed state is held for serving: as the model holds it (layer stacks,
    run by its layer scan)."""
    return placed_state

  def compile_programs(self) -> Callable:
    """How the step programs compile (`steps.programs`' `compile`)."""
    return steps.jit_program

  # -- memory ------------------------------------------------------------------------------------

  @property
  def weight_bytes(self) -> int:
    """Weight bytes on the most loaded device (the draft's included)."""
    return placement.bytes_per_device(self.states)

  def pool_spec(self, n_blocks: int, n_window_blocks: int | None = None):
    """The pools' shapes for `n_blocks` blocks per replica (nothing allocated); with
    `n_window_blocks`, a hybrid pool whose windowed layers hold that many per replica."""
    P, Z, cfg = n_blocks * self.n_replicas, self.block_size, self.model_config
    P_w = None if n_window_blocks is None else n_window_blocks * self.n_replicas
    target = jax.eval_shape(lambda: self.model.init_pool(P, Z, self.kv_dtype, n_window_blocks=P_w))
    draft = None
    if self.drafter is not None and self.drafter.needs_hidden:
      heads = jax.eval_shape(
        lambda: self.model.mtp.init_pool(
          cfg, P, Z, jnp.dtype(cfg.dtype), n_heads=self.drafter.n_heads
        )
      )
      # The heads' pool, and the trunk's hidden states (final, last-block input) per slot.
      draft = (heads, hidden_store(cfg, P, Z, cfg.dtype))
    elif isinstance(self.drafter, NGramDrafter):  # prompt lookup: each slot's token
      draft = jax.eval_shape(lambda: self.drafter.init_pool(P, Z))
    elif self.draft is not None:
      draft = jax.eval_shape(lambda: self.draft.init_pool(P, Z))
    return target, draft

  def pool_shardings(self, spec):
    """NamedShardings of the pools (None on one device)."""
    if self.mesh is None:
      return None
    target, draft = spec
    # A draft model's rules; the MTP heads' and prompt lookup's pools follow the target's.
    d_rules = self.rules if self.d_rules is None else self.d_rules
    return (
      placement.pool_shardings(target, self.mesh, self.rules),
      None if draft is None else placement.pool_shardings(draft, self.mesh, d_rules),
    )

  def block_bytes(self) -> int:
    """Bytes one block of every pool takes on one device (per shard: heads split over tensor
    count 1 / tensor of their bytes), every layer's (a hybrid pool's two kinds of block split
    these between them: `sizing.split_window_pool`)."""
    spec = self.pool_spec(1)
    leaves = jax.tree.leaves(spec)
    if self.mesh is None:
      return sum(x.size * x.dtype.itemsize for x in leaves)
    shardings = jax.tree.leaves(
      self.pool_shardings(spec), is_leaf=lambda s: isinstance(s, NamedSharding)
    )
    return sum(placement.shard_bytes(x, s) for x, s in zip(leaves, shardings))

  def allocate(self, n_blocks: int, limits=None, n_window_blocks: int | None = None) -> None:
    """Zeroed pools of `n_blocks` blocks per replica, made in place on their devices; `limits`
    (the engine's resolved `EngineConfig`) bound the step shapes. With `n_window_blocks`, a
    hybrid pool: the windowed layers' blocks apart, that many per replica."""
    self.n_window_blocks = n_window_blocks
    spec = self.pool_spec(n_blocks, n_window_blocks)
    shardings = self.pool_shardings(spec)
    self._pool_spec = (spec, shardings)
    self.programs = self._programs(shardings)
    self.pools = self._zeros()
    self.limits = limits

  def _programs(self, shardings) -> steps.Programs:
    """The step programs for pools laid out as `shardings` (None on one device)."""
    key = steps.sharding_key(shardings)
    return steps.programs(
      self.graphdef, self.drafter, self.layout, self.d_layout, key, self.compile_programs()
    )

  def _zeros(self):
    spec, shardings = self._pool_spec
    if shardings is None:
      return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), spec)
    return jax.tree.map(lambda x, s: jnp.zeros(x.shape, x.dtype, device=s), spec, shardings)

  @property
  def pool_bytes(self) -> int:
    """Pool bytes on the most loaded device."""
    return placement.bytes_per_device(self.pools)

  def largest_step_bytes(self, config) -> int:
    """Per-device temporaries of the largest step `config` allows (its token budget), read from
    its compiled program (nothing runs or is kept)."""
    budget = config.max_num_batched_tokens or sizing.DEFAULT_BATCHED_TOKENS
    T = self.token_bucket(budget)
    seqs = config.max_num_seqs or sizing.MAX_DEFAULT_SEQS  # not sized yet: the most it can be
    b = min(T, self.bucket(seqs))
    return self.step_bytes(Shape("step", b, T, self.max_blocks))

  def step_bytes(self, shape: Shape) -> int:
    """Per-device temporaries of one step shape's compiled program."""
    R, B, M = self.record_rows(shape), shape.b * self.n_replicas, shape.M
    hybrid = None if self.n_window_blocks is None else self.max_blocks
    spec = self.pool_spec(self.max_blocks, hybrid)
    shardings = self.pool_shardings(spec)
    rows = None if self.mesh is None else NamedSharding(self.mesh, self.layout.spec("batch"))
    abstract = lambda shape, dtype, s=rows: jax.ShapeDtypeStruct(shape, dtype, sharding=s)
    if shardings is not None:
      spec = jax.tree.map(lambda x, s: abstract(x.shape, x.dtype, s), spec, shardings)
    x = jax.tree.map(lambda a: abstract(a.shape, a.dtype), self.padding(R, shape.T, B, M))
    compiled = self._programs(shardings).forward_sample.lower(self.states, spec, x).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)

  def pool_lost(self) -> bool:
    """Whether a failed call took the donated pools with it."""
    return any(x.is_deleted() for x in jax.tree.leaves(self.pools))

  def reset_pools(self) -> None:
    """Fresh zeroed pools (after a failure lost them)."""
    self.pools = self._zeros()

  # -- shapes ------------------------------------------------------------------------------------

  def bucket(self, n_rows: int) -> int:
    """The padded rows per replica of a burst or round with `n_rows` on its busiest replica."""
    return pow2(n_rows, self.min_batch_bucket)

  def token_bucket(self, n_tokens: int) -> int:
    """T of a step whose busiest replica computes `n_tokens` tokens."""
    return pow2(n_tokens, MIN_STEP_TOKENS)

  def step_slots(self, T: int, config=None) -> int:
    """b, the sequence slots per replica of a step of T tokens: as many as the tokens, at most
    the largest batch's bucket (every sequence computes at least one token, so they never run
    short), so T alone picks the shape."""
    config = config or self.limits
    return min(T, self.bucket(config.max_num_seqs))

  def width(self, n_blocks: int) -> int:
    """M, the block-table columns of a call whose longest row holds `n_blocks` blocks: the
    narrowest of `widths` that holds them."""
    return next(m for m in self.widths() if m >= n_blocks)

  def widths(self) -> list[int]:
    """Every M a call can have: `min_blocks` times powers of `WIDTH_GROWTH`, and `max_blocks`."""
    out, m = [], self.min_blocks
    while m < self.max_blocks:
      out.append(m)
      m *= WIDTH_GROWTH
    return [*out, self.max_blocks]

  def record_rows(self, shape: Shape) -> int:
    """R, the rows of a shape's record: one per replica for a ragged step, else one per
    sequence slot."""
    return self.n_replicas if shape.kind == "step" else shape.b * self.n_replicas

  def shapes(self, config, level: str, *, capacity: int) -> tuple[list[Shape], list[str]]:
    """(every shape a server with these limits runs, at warm-up `level`; what is left to first
    use). A step is one shape per (token bucket, width); a burst (`capacity` iterations) and a
    round per (batch bucket, width). Levels "default" and "all" are the same here: a ragged
    step's shape does not depend on where its prompts start."""
    always = ["penalties, logit bias, guided masks, min_tokens, prompt logprobs, n > 1 copies"]
    if level == "none":
      return [], ["every step shape", *always]
    budget = config.max_num_batched_tokens
    tokens = sorted({self.token_bucket(n) for n in (1, budget)} | set(_pow2_range(16, budget)))
    tokens = [T for T in tokens if T <= self.token_bucket(budget)]
    out = [Shape("step", self.step_slots(T, config), T, M) for M in self.widths() for T in tokens]
    return first_of_each_kind(out + self.decode_shapes(config, capacity)), always

  def decode_shapes(self, config, capacity: int) -> list[Shape]:
    """A burst (`capacity` iterations) and a speculative round per batch bucket and width."""
    buckets = sorted({self.bucket(n) for n in range(1, config.max_num_seqs + 1)})
    widths, out = self.widths(), []
    if capacity >= 2:
      out += [Shape("burst", b, capacity, M) for M in widths for b in buckets]
    if self.drafter is not None:
      k, most = config.num_speculative_tokens, pow2(config.speculative_max_batch)
      out += [Shape("speculate", b, k + 1, M) for M in widths for b in buckets if b <= most]
    return out

  def padding(self, R: int, T: int, B: int, M: int) -> StepRecord:
    """`padding_record` with the fields this runner's records carry: adapter slots (LoRA), the
    windowed layers' table (a hybrid pool)."""
    x = padding_record(R, T, B, M)
    if self.lora:
      x = dataclasses.replace(x, adapter_RT=np.zeros(x.tokens_RT.shape, np.int32))
    if self.n_window_blocks is not None:
      x = dataclasses.replace(x, window_table_BM=np.zeros((B, M), np.int32))
    return x

  def _met(self, kind: str, x: StepRecord, T: int | None = None) -> None:
    B, M = x.block_table_BM.shape
    T = x.tokens_RT.shape[1] if T is None else T
    self.shapes_met.add(Shape(kind, B // self.n_replicas, T, M))

  # -- the step's inputs -------------------------------------------------------------------------

  def _replica(self, row: Row) -> int:
    return row.req.replica

  def busiest(self, rows: Sequence[Row], count=lambda row: 1) -> int:
    """The most rows (or, with `count`, tokens) any one replica holds."""
    held = [0] * self.n_replicas
    for row in rows:
      held[row.req.replica] += count(row)
    return max(held)

  def record(
    self,
    rows: Sequence[Row],
    layout: Layout,
    M: int,
    *,
    penalties: bool,
    allowed: bool = True,
  ) -> StepRecord:
    """The record of these rows placed by `layout`, tables M wide, on the host. `allowed` puts
    each guided row's mask (and a row in its min_tokens its suppressed stops) in the sampling
    arrays."""
    B = layout.B
    fields = batch.fill_tokens(rows, layout)
    seeds = np.zeros((B,), np.int32)
    step = np.zeros((B,), np.int32)
    params = [PADDING] * B
    for row, b in zip(rows, layout.slot):
      seeds[b] = row.req.params.seed
      step[b] = row.step
      params[b] = row.req.params
    counts = prompt_mask = None
    if penalties:
      V = self.model_config.vocab_size
      counts = np.zeros((B, V), np.int32)
      prompt_mask = np.zeros((B, V), bool)
      for row, b in zip(rows, layout.slot):
        np.add.at(counts[b], np.asarray(row.req.output, np.int64), 1)
        prompt_mask[b, row.req.prompt] = True
    bits = self._allowed_bits(rows, layout.slot, B) if allowed else None
    window = None
    if self.n_window_blocks is not None:
      window = batch.block_table(rows, layout.slot, B, M, window=True)
    return StepRecord(
      adapter_RT=batch.adapter_slots(rows, layout) if self.lora else None,
      window_table_BM=window,
      **fields,
      block_table_BM=batch.block_table(rows, layout.slot, B, M),
      seed_B=seeds,
      step_B=step,
      sampling=SamplingArrays.from_params(params, allowed_bits=bits),
      counts_BV=counts,
      prompt_mask_BV=prompt_mask,
    )

  def step_record(self, rows: Sequence[Row]) -> tuple[StepRecord, np.ndarray]:
    """(the ragged record of a step's rows, each row's sequence slot)."""
    T = self.token_bucket(self.busiest(rows, lambda row: row.n))
    b = self.step_slots(T)
    layout = batch.ragged_layout(rows, self._replica, self.n_replicas, b, T)
    M = self.width(max(len(r.blocks) for r in rows))
    penalties = any(r.req.params.uses_penalties for r in rows)
    return self.record(rows, layout, M, penalties=penalties), layout.slot

  def decode_record(
    self, rows: Sequence[Row], *, penalties: bool, allowed: bool = True
  ) -> tuple[StepRecord, np.ndarray]:
    """(the rows-form record of one pending token per row, each row's slot): a burst's or a
    round's."""
    b = self.bucket(self.busiest(rows))
    layout = batch.rows_layout(rows, self._replica, self.n_replicas, b, 1)
    M = self.width(max(len(r.blocks) for r in rows))
    return self.record(rows, layout, M, penalties=penalties, allowed=allowed), layout.slot

  def needs_masks(self, rows: Sequence[Row]) -> bool:
    """Whether a row's sampling takes a mask: a guided row's, or the stops of a row in its
    min_tokens."""
    return any(r.req.matcher is not None or r.req.suppressing_stops for r in rows)

  def _allowed_bits(self, rows: Sequence[Row], slot, B) -> np.ndarray | None:
    """i32[B, W] packed allowed tokens: guided rows' from their matchers, without the stop ids
    for rows in their min_tokens, all set for the others; None when no row needs a mask."""
    if not self.needs_masks(rows):
      return None
    V = self.model_config.vocab_size
    bits = np.full((B, -(-V // 32)), -1, np.int32)
    for row, b in zip(rows, slot):
      req = row.req
      if req.matcher is not None:
        bits[b] = req.matcher.allowed_bits()
      if req.suppressing_stops:
        words = bits[b].view(np.uint32)
        for t in req.stop_ids:
          if t < V:
            words[t >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (t & 31)))
    return bits

  def draft_masks(self, rows: Sequence[Row], slot, drafts_BJ: np.ndarray) -> np.ndarray:
    """i32[B, k+1, W]: a guided row's allowed tokens at its pending token and after each of its
    drafts, from its matcher advanced along the drafts and rolled back; all set for the other
    rows, and past a draft the grammar refuses (the target rejects it there, so the positions
    after it are never read)."""
    B, k = drafts_BJ.shape
    masks = np.full((B, k + 1, -(-self.model_config.vocab_size // 32)), -1, np.int32)
    for row, b in zip(rows, slot):
      m = row.req.matcher
      if m is None:
        continue
      masks[b, 0] = m.allowed_bits()
      n = 0
      while n < k and m.accepts(drafts_BJ[b, n]):
        m.advance(drafts_BJ[b, n])
        n += 1
        masks[b, n] = m.allowed_bits()
      m.rollback(n)
    return masks

  def on_devices(self, x: StepRecord) -> StepRecord:
    """The record with every array split over the data axis by its leading (row or sequence)
    axis, on a mesh."""
    if self.layout is None:
      return x
    rows = NamedSharding(self.mesh, self.layout.spec("batch"))
    return jax.device_put(x, jax.tree.map(lambda _: rows, x))

  # -- calls -------------------------------------------------------------------------------------

  def execute(self, rows: Sequence[Row]) -> dict:
    """One step: every row's new tokens (prompt chunks and decode tokens) in one call; returns
    {request id: (token, logprob, top ids, top logprobs)} of the draw after each row's last
    token."""
    x, slot = self.step_record(rows)
    self._met("step", x)
    return self._forward(rows, x, slot)

  def _forward(self, rows, x: StepRecord, slot) -> dict:
    self.pools, *outs = self.programs.forward_sample(self.states, self.pools, self.on_devices(x))
    tok, lp, top_ids, top_lp = map(np.asarray, outs)
    return {
      row.req.id: (int(tok[b]), float(lp[b]), top_ids[b], top_lp[b]) for row, b in zip(rows, slot)
    }

  def burst(
    self, rows: Sequence[Row], n_steps: int, capacity: int, chained: Drawn | None = None
  ) -> Drawn:
    """Dispatches `n_steps` decode iterations of `rows` (not waiting for them) in the burst
    program of `capacity` iterations at most. Chained on a burst the host has not read, each
    row's pending token (and penalty counts) is taken from that burst's last draws on the
    device."""
    penalties = any(r.req.params.uses_penalties for r in rows)
    x, slot = self.decode_record(rows, penalties=penalties and chained is None, allowed=False)
    self._met("burst", x, capacity)
    prompt_mask = x.prompt_mask_BV
    if chained is not None:
      prev = {id(r.req): b for r, b in zip(chained.rows, chained.slot)}
      index = np.zeros((x.tokens_RT.shape[0],), np.int32)
      index[slot] = [prev[id(r.req)] for r in rows]
      # On the device: the host has not seen these yet.
      tokens_RT, counts, prompt_mask = _carried(
        chained.tok_IB, chained.counts_BV, chained.prompt_mask_BV, index, np.int32(chained.n_steps)
      )
      x = dataclasses.replace(x, tokens_RT=tokens_RT, counts_BV=counts, prompt_mask_BV=prompt_mask)
    self.pools, *outs = self.programs.decode_burst(
      self.states, self.pools, self.on_devices(x), capacity, np.int32(n_steps)
    )
    return Drawn(list(rows), slot, prompt_mask, *outs, n_steps=n_steps)

  def speculate(self, rows: Sequence[Row], k: int) -> Drawn:
    """One speculative round over `rows`, settled at once (guided rows: drafted, masked on the
    host along their drafts, then verified)."""
    x, slot = self.decode_record(rows, penalties=False)
    self._met("speculate", x, k + 1)
    x_dev = self.on_devices(x)
    progs = self.programs
    if x.sampling.allowed_bits is None:
      self.pools, *outs, accepted_B = progs.speculative_round(self.states, self.pools, x_dev, k)
    else:  # guided rows: the target's masks at each draft follow the drafts before it
      self.pools, draft_BJ, q_BJV = progs.speculative_draft(self.states, self.pools, x_dev, k)
      masks = self.draft_masks(rows, slot, np.asarray(draft_BJ))
      self.pools, *outs, accepted_B = progs.speculative_verify(
        self.states, self.pools, x_dev, draft_BJ, q_BJV, masks
      )
    accepted = np.asarray(accepted_B)[slot]
    return Drawn(list(rows), slot, None, *outs, counts_BV=None, n_draws=accepted + 1)

  def copy(self, pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: blocks src -> dst (global ids) copied on the device, in every pool."""
    if pairs:
      # Padded to a power of two by repeating the last pair (an idempotent copy).
      pairs = pairs + pairs[-1:] * (pow2(len(pairs)) - len(pairs))
      src, dst = (np.asarray(x, np.int32) for x in zip(*pairs))
      self.pools = self.programs.copy_blocks(self.pools, src, dst)

  def prompt_logprobs(self, prompt: list[int], max_len: int, adapter: int = 0):
    """(f32[T] logprob of each next token, i32[T, 5] top ids, f32[T, 5] top logprobs) of one
    prompt, from one pass of the model over it (right padding: causal attention keeps it out of
    the real positions), under LoRA adapter slot `adapter` where the model holds adapters."""
    n = len(prompt)
    T = max(n, min(pow2(n, 16), max_len))
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :n] = prompt
    slots = np.full((1, T), adapter, np.int32) if self.lora else None
    return map(np.asarray, self.programs.prompt_logprobs(self.states[0], tokens, slots))

  # -- compiling ahead ---------------------------------------------------------------------------

  def warmup(
    self,
    shapes: Sequence[Shape],
    progress: Callable[[int, int, str], None] | None = None,
    threads: int | None = None,
    *,
    first: int | None = None,
  ) -> threading.Thread | None:
    """Compiles every shape, then runs each once on padding rows that write nothing.

    With `first` given, only the first `first` shapes compile before this returns; the rest
    compile on a background thread (returned), one at a time, so the device keeps serving
    while they do. `threads` compiles run at once before it returns (default
    `_compile_threads`). `progress(i, n, shape)` is called as each compile ends. A shape a
    request needs before the thread reaches it compiles on first use, in the serving thread."""
    shapes = list(shapes)
    now, later = (shapes, []) if first is None else (shapes[:first], shapes[first:])
    self._compile(now, progress, threads, total=len(shapes))
    self._run_once(now)
    if not later:
      return None

    def rest():
      try:
        self._compile(later, progress, 1, total=len(shapes), done=len(now))
      except Exception:  # the shape compiles on first use instead, where its error surfaces
        log.exception("background compilation stopped")

    self._background = threading.Thread(target=rest, name="atlas-compile", daemon=True)
    self._background.start()
    return self._background

  def _compile_threads(self) -> int:
    """Compiles at once: one on an accelerator, where a compile may autotune its kernels on the
    device."""
    return 1

  def _compile(self, shapes, progress, threads: int | None, *, total: int, done: int = 0) -> None:
    """Compiles `shapes` (`lower(...).compile()`: a jitted function called on a compiled
    shape runs that executable), `threads` at a time: XLA compiles off the GIL."""
    calls = [self._warmup_call(s) for s in shapes]
    threads = self._compile_threads() if threads is None else threads
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
      pending = {
        pool.submit(lambda c: c[0].lower(self.states, self.pools, *c[1:]).compile(), c): i
        for i, c in enumerate(calls)
      }
      for n, future in enumerate(concurrent.futures.as_completed(pending)):
        future.result()
        # A compile's working memory, freed into its thread's malloc arena, goes back to the
        # system: what stays resident is the compiled program.
        host_memory.return_freed_memory()
        if progress is not None:
          progress(done + n + 1, total, str(shapes[pending[future]]))

  def _run_once(self, shapes) -> None:
    """Each shape run once on padding rows (what it writes goes nowhere)."""
    for shape in shapes:
      program, x, *static = self._warmup_call(shape)
      self.pools, *outs = program(self.states, self.pools, x, *static)
      if program is self.programs.decode_burst:
        # Again fed from the device, as a chained burst is (`burst`): its pending tokens are
        # the last one's draws.
        index = np.arange(x.tokens_RT.shape[0])
        tokens_RT, _, _ = _carried(outs[0], None, None, index, static[-1])
        x = dataclasses.replace(x, tokens_RT=tokens_RT)
        self.pools, *outs = program(self.states, self.pools, x, *static)
      jax.block_until_ready(outs)

  def _warmup_call(self, shape: Shape) -> tuple:
    """(program, a padding record of the shape, its static arguments)."""
    B = shape.b * self.n_replicas
    T = shape.T if shape.kind == "step" else 1
    x = self.on_devices(self.padding(self.record_rows(shape), T, B, shape.M))
    progs = self.programs
    if shape.kind == "step":
      return progs.forward_sample, x
    if shape.kind == "burst":  # its T iterations at most; one runs (the count is an input)
      return progs.decode_burst, x, shape.T, np.int32(1)
    return progs.speculative_round, x, shape.T - 1

  def wait_compiled(self, timeout: float | None = None) -> bool:
    """Waits for the background compilation, if any; whether it has ended."""
    if self._background is not None:
      self._background.join(timeout)
      return not self._background.is_alive()
    return True


def first_of_each_kind(shapes: list[Shape]) -> list[Shape]:
  """The shapes with the first of each kind first (a short prompt's step, a small batch's burst:
  what the first requests run), the rest in their order after."""
  firsts = list({s.kind: s for s in reversed(shapes)}.values())[::-1]
  firsts.sort(key=shapes.index)
  return firsts + [s for s in shapes if s not in firsts]


def _pow2_range(lo: int, hi: int) -> list[int]:
  out, n = [], lo
  while n < hi:
    out.append(n)
    n *= 2
  return out


__all__ = ["Drawn", "ModelRunner", "Row", "Shape", "padding_record"]
