"""The scheduler: which requests run, on which replica, with which blocks, and what kind of step.

Plain host Python over one block allocator (with its prefix cache) per data-parallel replica;
block ids are global (replica r's allocator hands out local ids, which the scheduler offsets by
r * n_blocks), so a step's block tables name each row's pages on its own replica's devices.

Each step is one of (`next_plan`):

* a mixed step (`MixedPlan`): the running requests, oldest first, each compute their pending
  tokens (a prompt chunk of at most `prefill_chunk`, or the one token sampled last step), within
  a per-replica token budget. Blocks are registered with the allocator only for the tokens
  computed this step, so a block enters the prefix cache only once its entries are real. When a
  replica's pool runs out, its newest running request is preempted: its blocks are freed (full
  ones stay in the prefix cache) and it goes back to the front of the queue to be recomputed
  later. Then waiting requests are admitted in arrival order while the budgets, the batch and
  the pools allow, each on the least-loaded replica (the fewest running, then the longest cached
  prefix, then the most free blocks), starting after its longest prefix already cached there.
* a burst (`BurstPlan`): every running request is decoding, none is streamed (unless
  `stream_bursts`) and nothing waits that could be admitted: `decode_burst` iterations in one
  call, blocks reserved ahead for them (`BlockAllocator.reserve`); a burst may be chained on the
  one in flight before the host has read it, unless a waiting request could be admitted once
  that one is read: an arrival waits for the burst in flight, never for one more.
* a speculative round (`RoundPlan`): the same, with a drafter, at most `speculative_max_batch`
  rows and none with penalties or in its min_tokens: k + 1 positions reserved per row.

After a burst or a round, `settle` registers the tokens each row kept and gives back the
blocks it did not need. `add_group` queues n completions of one prompt: only the first computes
the prompt; the others then fork its blocks (copy-on-write of a shared partial block) and
recompute only its last token. A request that cannot fit one replica's pool (or the context) on
its own is refused at intake, so the oldest request can always make progress by preempting
newer ones: no crash, no livelock.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from atlas_jax.cache.allocator import (
  AllocatorStats,
  BlockAllocator,
  HybridAllocator,
  OutOfBlocksError,
)
from atlas_jax.config import EngineConfig
from atlas_jax.serving.batch import Row
from atlas_jax.serving.requests import Request, RequestId


@dataclasses.dataclass
class MixedPlan:
  """Rows computing their pending tokens (prefill chunks and decode tokens)."""

  rows: list[Row]
  copies: list[tuple[int, int]]  # copy-on-write block pairs (global ids) to copy first


@dataclasses.dataclass
class BurstPlan:
  """Every running request, `n_steps` decode iterations each."""

  rows: list[Row]
  copies: list[tuple[int, int]]
  n_steps: int


@dataclasses.dataclass
class RoundPlan:
  """Every running request, one speculative round each."""

  rows: list[Row]
  copies: list[tuple[int, int]]


def burst_capacity(config: EngineConfig) -> int:
  """The most decode iterations any burst runs (the burst program's size): the longer of
  `decode_burst` and `offline_burst` (1 with bursts off)."""
  if config.decode_burst < 2:
    return 1
  return max(config.decode_burst, config.offline_burst)


class Scheduler:
  """Continuous batching over the replicas' pools.

  Args:
    config: the engine's resolved limits (counts per replica).
    n_replicas: data-parallel replicas, each with `config.n_blocks` blocks.
    speculates: whether a drafter is there to run speculative rounds.
  """

  def __init__(
    self,
    config: EngineConfig,
    n_replicas: int,
    *,
    speculates: bool,
    window: int | None = None,
    n_window_blocks: int | None = None,
  ):
    self.config = config
    self.n_replicas = n_replicas
    self.speculates = speculates
    # W when the served model's windowed layers attend within a sliding window of W positions:
    # a request's blocks before its last W positions then go back to their pool as it
    # advances. With `n_window_blocks` (a model mixing windowed and full-attention layers) the
    # windowed layers have a pool of their own, that many blocks per replica
    # (`HybridAllocator`); without, every layer is windowed and shares the one pool.
    self.window = window
    self.n_window_blocks = n_window_blocks
    self.allocators = [self._allocator() for _ in range(n_replicas)]
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []  # oldest first
    self.requests: dict[RequestId, Request] = {}  # every live request, by id
    # Completions waiting for their first sibling's prompt, by that sibling's id (add_group).
    self.followers: dict[RequestId, list[Request]] = {}
    self.pending_copies: list[tuple[int, int]] = []  # copy-on-write pairs for the next step
    self.finished: list[Request] = []  # released since the engine last logged them
    self.n_preemptions = 0
    # Whether every request the engine will serve has been added (`Engine.generate`, serve.py's
    # batch mode): no arrival can then wait for a burst, so bursts run `offline_burst` steps.
    self.offline = False

  def _allocator(self) -> BlockAllocator | HybridAllocator:
    c = self.config
    if self.n_window_blocks is not None:
      return HybridAllocator(
        c.n_blocks,
        self.n_window_blocks,
        c.block_size,
        self.window,
        enable_prefix_caching=c.enable_prefix_caching,
      )
    return BlockAllocator(
      c.n_blocks, c.block_size, enable_prefix_caching=c.enable_prefix_caching, window=self.window
    )

  def reset(self) -> None:
    """Fresh allocators (the pools were lost): every running request recomputes."""
    self.allocators = [self._allocator() for _ in range(self.n_replicas)]
    self.pending_copies = []
    for req in self.running:
      req.n_computed = 0
      req.n_preemptions += 1
      self.n_preemptions += 1
    self.waiting = collections.deque(
      sorted([*self.running, *self.waiting], key=lambda r: r.arrival)
    )
    self.running = []

  # -- bookkeeping -------------------------------------------------------------------------------

  def allocator(self, req: Request) -> BlockAllocator | HybridAllocator:
    return self.allocators[req.replica]

  def _global(self, req: Request, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Copy pairs with global ids. A hybrid allocator's pairs of its sliding group (ids from
    `n_blocks` on) name the windowed layers' pool: they come after every replica's full-group
    ids, at R * n_blocks + (that pool's global id)."""
    n, first = self.config.n_blocks, req.replica * self.config.n_blocks

    def gid(b: int) -> int:
      if b < n:
        return first + b
      return self.n_replicas * n + req.replica * self.n_window_blocks + b - n

    return [(gid(src), gid(dst)) for src, dst in pairs]

  def blocks(self, req: Request) -> list[int]:
    """The global ids of a request's blocks; a dropped one (`forget_outside_window`) reads as
    its replica's first block, whose entries the window masks, never writes."""
    first = req.replica * self.config.n_blocks
    return [first + max(b, 0) for b in self.allocator(req).blocks(req.id)]

  def window_blocks(self, req: Request) -> list[int]:
    """The global ids of a request's blocks in the windowed layers' pool (a hybrid model's;
    empty otherwise), dropped ones as in `blocks`."""
    if self.n_window_blocks is None:
      return []
    first = req.replica * self.n_window_blocks
    return [first + max(b, 0) for b in self.allocator(req).window_blocks(req.id)]

  def forget_outside_window(self, req: Request) -> None:
    """Releases the blocks of a request that its next tokens cannot see: those wholly before
    position n_computed - W + 1 (the first key the next query at n_computed reads)."""
    if self.window is not None and req.id in self.allocator(req):
      self.allocator(req).drop_before(req.id, max(0, req.n_computed - self.window + 1))

  def row(self, req: Request, n: int, start: int | None = None, step: int | None = None) -> Row:
    """A request's row computing `n` tokens from `start` (default: its computed ones)."""
    start = req.n_computed if start is None else start
    step = len(req.output) if step is None else step
    return Row(req, n, start, step, tuple(self.blocks(req)), tuple(self.window_blocks(req)))

  def stats(self) -> AllocatorStats:
    """Every replica's allocator, summed."""
    each = [a.stats() for a in self.allocators]
    fields = {f.name: sum(getattr(s, f.name) for s in each) for f in dataclasses.fields(each[0])}
    return AllocatorStats(**{**fields, "block_size": each[0].block_size})

  def usage(self) -> float:
    """Fraction of the pools' blocks referenced by live requests."""
    s = self.stats()
    return s.n_used / s.n_blocks

  @property
  def n_waiting(self) -> int:
    return len(self.waiting) + sum(len(f) for f in self.followers.values())

  def has_work(self) -> bool:
    return bool(self.waiting or self.running or self.followers)

  def add(self, req: Request) -> None:
    self.requests[req.id] = req
    self.waiting.append(req)

  def add_group(self, reqs: list[Request]) -> None:
    """n completions of one prompt: the first computes it, the others follow (`fork_followers`)."""
    for req in reqs:
      self.requests[req.id] = req
    self.waiting.append(reqs[0])
    if len(reqs) > 1:
      self.followers[reqs[0].id] = reqs[1:]

  def release(self, req: Request) -> None:
    """Frees a finished, aborted or failed request's blocks and forgets it."""
    if req.id in self.requests:
      self.finished.append(req)
    alloc = self.allocator(req)
    if req.id in alloc:
      alloc.free(req.id)
    if req in self.running:
      self.running.remove(req)
    if req in self.waiting:
      self.waiting.remove(req)
    # A leader that ends before its prompt is computed lets its siblings compute it themselves.
    self.waiting.extendleft(reversed(self.followers.pop(req.id, [])))
    for followers in self.followers.values():
      if req in followers:
        followers.remove(req)
    self.requests.pop(req.id, None)

  def preempt(self, req: Request) -> None:
    """Recompute-style preemption: free the blocks, requeue at the front."""
    self.allocator(req).free(req.id)
    self.running.remove(req)
    req.n_computed = 0
    req.n_preemptions += 1
    self.n_preemptions += 1
    self.waiting.appendleft(req)

  def requeue(self, reqs: list[Request]) -> None:
    """Sends running requests back to the queue to recompute, in arrival order: their blocks
    are freed, the full ones they computed kept in the prefix cache."""
    for req in reqs:
      self.allocator(req).free(req.id, computed=req.n_computed)
      self.running.remove(req)
      req.n_computed = 0
      req.n_preemptions += 1
      self.n_preemptions += 1
      self.waiting.appendleft(req)
    self.waiting = collections.deque(sorted(self.waiting, key=lambda r: r.arrival))

  def fork_followers(self, leader: Request) -> None:
    """Starts the leader's sibling completions on its blocks, now that its prompt is computed.

    Each forks the leader's sequence and drops the last prompt token, which it recomputes to
    draw its own first token; a shared partial last block is copied at the start of the next
    step. Siblings that do not fit the batch or the pool wait and are admitted normally (their
    prompt's full blocks then come from the prefix cache).
    """
    late = []
    alloc = self.allocator(leader)
    for f in self.followers.pop(leader.id):
      if self._n_running(leader.replica) >= self.config.max_num_seqs:
        late.append(f)
        continue
      f.replica = leader.replica
      alloc.fork(leader.id, f.id)
      try:
        self.pending_copies += self._global(f, alloc.truncate(f.id, len(f.prompt) - 1))
      except OutOfBlocksError:
        alloc.free(f.id)
        late.append(f)
        continue
      f.n_computed = len(f.prompt) - 1
      self.running.append(f)
    self.waiting.extendleft(reversed(late))
    self.running.sort(key=lambda r: r.arrival)

  def take_copies(self, copies: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The copies a step makes first: those pending from forks, then its own."""
    copies, self.pending_copies = self.pending_copies + copies, []
    return copies

  def _n_running(self, replica: int) -> int:
    return sum(1 for r in self.running if r.replica == replica)

  # -- what kind of step -------------------------------------------------------------------------

  def next_plan(self) -> RoundPlan | BurstPlan | None:
    """A speculative round or a burst when the batch allows one and the pools can hold its
    reservations; None for a mixed step (`schedule`)."""
    if self.should_speculate():
      rows = list(self.running)
      copies = self.reserve(rows, self.config.num_speculative_tokens + 1)
      return None if copies is None else RoundPlan([self.row(r, 1) for r in rows], copies)
    if self.should_burst():
      return self._burst(list(self.running))
    return None

  def burst_length(self) -> int:
    """The most decode iterations a burst runs: `decode_burst`, or `offline_burst` offline."""
    return burst_capacity(self.config) if self.offline else self.config.decode_burst

  def _burst(
    self, reqs: list[Request], prev: Sequence[Row] = (), done: int = 0
  ) -> BurstPlan | None:
    """A burst of `reqs`, chained on the burst of rows `prev` and `done` steps (in flight, its
    draws not yet read) if given: the burst length, cut to the most draws a row still needs (no
    row needs a step past its max_tokens); a pool that cannot hold the reservation for that
    many gets the online length, then nothing (None)."""
    at = {id(r): (r.n_computed, len(r.output)) for r in reqs}  # where each row starts, unread
    at.update((id(row.req), (row.start, row.step)) for row in prev)
    need = max(r.params.max_new_tokens - at[id(r)][1] - done for r in reqs)
    lengths = (self.burst_length(), self.config.decode_burst)
    for n in dict.fromkeys(max(1, min(length, need)) for length in lengths):
      copies = self.reserve(reqs, done + n)  # the burst in flight holds the first `done`
      if copies is not None:
        rows = [self.row(r, 1, at[id(r)][0] + done, at[id(r)][1] + done) for r in reqs]
        return BurstPlan(rows, copies, n)
    return None

  def should_burst(self) -> bool:
    """Whether no running request needs the host for a burst's steps."""
    return (
      self.config.decode_burst >= 2
      and self.decode_only()
      # A guided row's mask follows each draw; a row in its min_tokens changes mask; a streamed
      # row's client is owed each token as it is drawn (unless `stream_bursts`).
      and all(r.matcher is None and not r.suppressing_stops for r in self.running)
      and (self.config.stream_bursts or not any(r.stream for r in self.running))
    )

  def should_speculate(self) -> bool:
    """Whether this step is a speculative round: a drafter, a small enough batch, no row with
    penalties (their counts would follow each draft) or in its min_tokens, and no request that
    needs a mixed step. Guided rows speculate: the host walks their drafts through the grammar
    mid-round."""
    return self.speculates_for(self.running) and self.decode_only()

  def speculates_for(self, rows: list[Request]) -> bool:
    guided = any(r.matcher is not None for r in rows)
    c = self.config
    return (
      self.speculates
      and len(rows) <= (c.guided_speculative_max_batch if guided else c.speculative_max_batch)
      and not any(r.params.uses_penalties or r.suppressing_stops for r in rows)
    )

  def decode_only(self) -> bool:
    """Whether every running request is decoding one pending token, and nothing waits that
    could be admitted now."""
    if not self.running:
      return False
    if any(r.suspect for r in self.running):
      return False  # suspects run alone, in mixed steps
    if any(r.n_pending != 1 for r in self.running):
      return False
    return not self._admissible()

  def _admissible(self, n_running: collections.Counter | None = None) -> bool:
    """Whether the head of the queue could be admitted now on some replica (a mixed step then
    runs rather than make it wait a burst), with `n_running` rows per replica (default: the
    running ones)."""
    if not self.waiting:
      return False
    head, c = self.waiting[0], self.config
    for r, alloc in enumerate(self.allocators):
      seated = self._n_running(r) if n_running is None else n_running[r]
      if seated >= c.max_num_seqs:
        continue
      hit = alloc.cached_prefix_length(head.tokens, salt=head.cache_salt)
      first = min(len(head.tokens) - hit, c.prefill_chunk)
      if -(-first // c.block_size) < alloc.n_available:
        return True
    return False

  def reserve(self, rows: list[Request], n_tokens: int) -> list[tuple[int, int]] | None:
    """Reserves blocks for `n_tokens` tokens past each row's computed ones; None (and nothing
    reserved) when a replica's pool cannot hold its rows'."""
    ids = [[r.id for r in rows if r.replica == rep] for rep in range(self.n_replicas)]
    if not all(a.can_reserve(i, n_tokens) for a, i in zip(self.allocators, ids)):
      return None
    return [p for r in rows for p in self._global(r, self.allocator(r).reserve(r.id, n_tokens))]

  def chain(self, prev_rows: list[Row], done: int) -> BurstPlan | None:
    """The next burst, dispatched before the host has read the burst of `prev_rows` and `done`
    steps, for its rows still running and not certain to stop in it; None when a row needs the
    host first (an admission is possible once that burst is read, or a pool is short).

    A waiting request that could be admitted then stops the chain, so that it waits for the
    burst in flight and no more: the head fits a seat and the blocks left beside the rows that
    run on, or a row ends in the burst in flight (freeing its seat and blocks). One that cannot
    be admitted (no seat, too few blocks) lets the chain go on."""
    live = [row for row in prev_rows if row.req in self.running]
    keep = [row for row in live if len(row.req.output) + done < row.req.params.max_new_tokens]
    if not keep:
      return None
    if self.waiting and (
      len(keep) < len(live) or self._admissible(collections.Counter(r.req.replica for r in keep))
    ):
      return None
    reqs = [row.req for row in keep]
    if self.speculates_for(reqs):
      return None  # the batch has shrunk enough to speculate
    return self._burst(reqs, keep, done)

  # -- progress: the one place a step's results advance a request -------------------------------

  def update_from_output(self, rows: list[Row], draws: dict, accept) -> list:
    """After a mixed step: each row's tokens are computed; a row that ended on its sequence's
    last pending token takes its draw, through `accept(req, (tokens, logprobs, top ids, top
    logprobs)) -> (output, kept)` (the output processor: stops, detokenisation); a finished
    request's blocks are released. Returns the outputs."""
    outputs = []
    for row in rows:
      req = row.req
      req.n_computed += row.n
      if req.id in self.followers and req.n_computed == len(req.prompt):
        self.fork_followers(req)  # before `accept` may finish and free the leader
      self.forget_outside_window(req)
      if req.n_pending:  # a prompt chunk before the last: its draw is not a token yet
        continue
      token, logprob, top_ids, top_lp = draws[req.id]
      out, _ = accept(req, ([token], [logprob], [top_ids], [top_lp]))
      outputs.append(out)
      if out.finished:
        self.release(req)
    return outputs

  def update_from_draws(self, rows: list[Row], draws: dict, accept, *, chained: set) -> list:
    """After a burst or a speculative round: each live row's draws (cut at its first stop by
    `accept`, as `update_from_output`'s) are registered (`settle`). `chained`: the ids of the
    requests running on in a burst already dispatched. Returns the outputs."""
    outputs = []
    for row in rows:
      req = row.req
      if self.requests.get(req.id) is not req:
        continue  # aborted while the burst ran
      out, n_kept = accept(req, draws[req.id])
      outputs.append(out)
      if req.id in self.requests:  # not ended by `accept` (an output error)
        self.settle(row, n_kept, finished=out.finished, chained=id(req) in chained)
    return outputs

  def fail(self, req: Request) -> None:
    """A request whose step failed: its blocks freed, the full ones it computed before the
    step kept in the prefix cache (their entries are real)."""
    alloc = self.allocator(req)
    if req.id in alloc:
      alloc.free(req.id, computed=req.n_computed)

  def truncate(self, rows: list[Row]) -> None:
    """Gives back what a burst or round that did not run had reserved."""
    for row in rows:
      self.allocator(row.req).truncate(row.req.id, row.req.n_computed)

  def settle(self, row: Row, n_kept: int, *, finished: bool, chained: bool) -> None:
    """After a burst or round: the pool holds the pending token and every kept draw but the
    last: register those (a finished request's full blocks then enter the prefix cache). A row
    that runs on in a chained burst keeps its reservation; any other gives back what it did
    not use."""
    req = row.req
    self.allocator(req).append(req.id, req.tokens[row.start : row.start + n_kept])
    req.n_computed = row.start + n_kept
    if finished:
      self.release(req)
      return
    if not chained:
      self.allocator(req).truncate(req.id, req.n_computed)
    self.forget_outside_window(req)

  # -- the mixed step ----------------------------------------------------------------------------

  def schedule(self) -> MixedPlan:
    """The rows of a mixed step and the copy-on-write pairs to copy first."""
    cfg = self.config
    budget = [cfg.max_num_batched_tokens] * self.n_replicas
    scheduled: list[tuple[Request, int]] = []
    copies: list[tuple[int, int]] = []
    preempted = False
    i = 0
    while i < len(self.running):
      req = self.running[i]
      r = req.replica
      if budget[r] <= 0:
        i += 1
        continue
      n = min(req.n_pending, cfg.prefill_chunk, budget[r])
      start = req.n_computed
      while True:
        try:
          copies += self._global(
            req, self.allocator(req).append(req.id, req.tokens[start : start + n])
          )
          break
        except OutOfBlocksError:
          preempted = True
          newest = next(q for q in reversed(self.running) if q.replica == r)
          self.preempt(newest)  # the replica's newest; possibly `req` itself
          if newest is req:
            break
      if req not in self.running:
        continue  # it was its replica's newest: the next one (if any) is now at index i
      scheduled.append((req, n))
      budget[r] -= n
      i += 1
    # Admit only when nothing was preempted this step, or the two would trade blocks forever.
    while not preempted and self.waiting:
      req = self.waiting[0]
      tokens = req.tokens
      choice = self._replica_for(tokens, budget, req.cache_salt)
      if choice is None:
        break
      r, hit = choice
      alloc = self.allocators[r]
      n = min(len(tokens) - hit, cfg.prefill_chunk, budget[r])
      try:
        got = alloc.add_sequence(req.id, tokens[: hit + n], salt=req.cache_salt)
      except OutOfBlocksError:
        break
      self.waiting.popleft()
      req.replica = r
      self.running.append(req)
      req.n_computed = got
      n = hit + n - got
      scheduled.append((req, n))
      budget[r] -= n
    # Running stays in arrival order so the oldest is scheduled first and preempted last.
    self.running.sort(key=lambda r: r.arrival)
    return MixedPlan([self.row(req, n) for req, n in scheduled], copies)

  def _replica_for(
    self, tokens: list[int], budget: list[int], salt: bytes = b""
  ) -> tuple[int, int] | None:
    """(the replica to admit a request on, its cached prefix length there), or None when no
    replica has a seat and budget left: the fewest running, then the longest cached prefix,
    then the most blocks available."""
    best = None
    for r, alloc in enumerate(self.allocators):
      n_running = self._n_running(r)
      if n_running >= self.config.max_num_seqs or budget[r] <= 0:
        continue
      hit = alloc.cached_prefix_length(tokens, salt=salt)
      key = (n_running, -hit, -alloc.n_available, r)
      if best is None or key < best[0]:
        best = (key, r, hit)
    return None if best is None else best[1:]
