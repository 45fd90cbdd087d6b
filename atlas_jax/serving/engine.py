"""The serving engine: a host-side scheduler over the paged KV cache and one jitted step.

Every request is a token list (prompt, then output) and a count of tokens whose K/V are already
in the pool (`n_computed`). Each `step()`:

1. schedules the running requests, oldest first: each computes its pending tokens (a prompt
   chunk of at most `prefill_chunk`, or the one token sampled last step), within a per-step token
   budget. Blocks are registered with the allocator only for the tokens computed this step, so a
   block enters the prefix cache only once its K/V are real. When the pool runs out, the newest
   running request is preempted: its blocks are freed (full ones stay in the prefix cache) and it
   goes back to the front of the queue to be recomputed later.
2. admits waiting requests in arrival order while the budget, the batch and the pool allow,
   starting each after its longest prefix already in the prefix cache.
3. runs the jitted step twice at most: once over the prefill rows [B, T] and once over the
   decode rows [B, 1], with B and T rounded up to powers of two so that a few compiled shapes
   serve every step. Prefill runs first, so a request admitted this step whose prefix blocks
   another row is computing reads them after they are written.
4. samples each row whose tokens are all computed and applies the stop conditions.

A request that cannot fit the pool (or the context) on its own is rejected when it is added, so
the oldest request can always make progress by preempting newer ones: no crash, no livelock.
Sampling keys are `fold_in(key(seed), i)` for the i-th generated token, as in `generate`, so
outputs do not depend on arrival order, batch composition or preemption.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import numbers
import threading
from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from atlas_jax.cache.allocator import BlockAllocator, OutOfBlocksError
from atlas_jax.cache.paged import init_kv_pool
from atlas_jax.cache.paged_view import PagedKVCache
from atlas_jax.decoding.sampling import (
  MAX_LOGPROBS,
  SamplingArrays,
  SamplingParams,
  sample_rows,
  step_keys,
)
from atlas_jax.model.transformer import Transformer

Array = jax.Array
RequestId = Hashable


class RequestError(ValueError):
  """A request the engine cannot serve (too long for the context or the pool, bad token ids)."""


class _PoolLost(Exception):
  """A jitted call raised after the device took the donated pool."""

  def __init__(self, rows, error: BaseException):
    super().__init__(str(error))
    self.rows, self.error = rows, error


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  n_blocks: int = 256  # P, blocks in the KV pool
  block_size: int = 16  # Z, token slots per block
  max_num_seqs: int = 8  # running requests at most (rows of the decode step)
  max_num_batched_tokens: int = 256  # per-step token budget, prefill and decode together
  prefill_chunk: int = 64  # most prompt tokens one request computes per step (a power of two)
  max_model_len: int | None = None  # default: the model's max_seq_len
  enable_prefix_caching: bool = True

  def __post_init__(self):
    for name in ("n_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r} must be a positive int")
    c = self.prefill_chunk
    if not isinstance(c, int) or c < 1 or c & (c - 1):
      raise ValueError(f"EngineConfig.prefill_chunk={c!r} must be a power of two")
    if self.max_num_batched_tokens < self.max_num_seqs:
      raise ValueError(
        f"EngineConfig.max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
        f"max_num_seqs={self.max_num_seqs} (one decode token per running request)"
      )


@dataclasses.dataclass
class RequestOutput:
  """What one step produced for one request."""

  request_id: RequestId
  new_token_ids: list[int]
  new_logprobs: list[float]  # logprob of each new token
  new_top_logprobs: list[list[tuple[int, float]]]  # per new token, top `params.logprobs`
  text: str  # new detokenised text (empty without a detokenizer)
  finished: bool
  finish_reason: str | None = None  # "stop", "length", "abort" or "error"
  error: str | None = None


@dataclasses.dataclass
class _Request:
  id: RequestId
  prompt: list[int]
  params: SamplingParams
  arrival: int
  stop_ids: frozenset[int]
  output: list[int] = dataclasses.field(default_factory=list)
  n_computed: int = 0  # tokens of prompt + output whose K/V are in the pool
  text: str = ""  # detokenised output (only with a detokenizer)
  n_text_sent: int = 0
  n_preemptions: int = 0
  suspect: bool = False  # in a failed call that lost the pool: runs alone from then on

  @property
  def tokens(self) -> list[int]:
    return self.prompt + self.output

  @property
  def n_pending(self) -> int:
    return len(self.prompt) + len(self.output) - self.n_computed


def _step_error(e: BaseException) -> str:
  return f"the model step failed: {type(e).__name__}: {e}"


def _pow2(n: int, minimum: int = 1) -> int:
  return max(minimum, 1 << max(n - 1, 0).bit_length())


@functools.partial(jax.jit, static_argnums=(0, 11), donate_argnums=(2,))
def _forward_sample(
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
  cache = PagedKVCache(pool=pool, block_table=block_table_BM, lengths=lengths_B)
  logits_B1V, cache = model(tokens_BT, positions_BT=positions_BT, cache=cache, logits_at_B=last_B)
  logits_BV = logits_B1V[:, 0]
  out = sample_rows(
    logits_BV,
    step_keys(seed_B, step_B),
    arrays,
    counts_BV=counts_BV if penalties else None,
    prompt_mask_BV=prompt_mask_BV if penalties else None,
  )
  return (cache.pool, *out)


class Engine:
  """Continuous batching over a paged KV cache.

  Not thread-safe by itself except for `abort`, which may be called from any thread; drive
  `add_request` and `step` from one thread (see `atlas_jax.serving.server`).

  Args:
    model: a Transformer.
    config: pool and scheduling limits.
    eos_id: the model's end-of-sequence token (a stop token unless a request sets ignore_eos).
    detokenize: token ids -> text; enables stop strings and the `text` of outputs.
  """

  def __init__(
    self,
    model: Transformer,
    config: EngineConfig = EngineConfig(),
    *,
    eos_id: int | None = None,
    detokenize: Callable[[Sequence[int]], str] | None = None,
  ):
    cfg = model.cfg
    self.config = config
    self.model_config = cfg
    self.max_model_len = config.max_model_len or cfg.max_seq_len
    self.eos_id = eos_id
    self.detokenize = detokenize
    self.graphdef, self.state = nnx.split(model)
    self.pool = init_kv_pool(
      n_layers=cfg.n_layers,
      n_blocks=config.n_blocks,
      block_size=config.block_size,
      n_kv_heads=cfg.n_kv_heads,
      head_dim=cfg.head_dim,
      dtype=jnp.dtype(cfg.dtype),
    )
    # Shapes, dtypes and placement of the pool, to build a fresh one if a failed step lost it.
    self._pool_spec = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.pool
    )
    self.allocator = BlockAllocator(
      config.n_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
    )
    self.max_blocks = -(-self.max_model_len // config.block_size)  # M, columns of block tables
    self.waiting: collections.deque[_Request] = collections.deque()
    self.running: list[_Request] = []  # oldest first
    self._requests: dict[RequestId, _Request] = {}
    self._aborts: list[RequestId] = []
    self._abort_lock = threading.Lock()
    self._arrivals = 0
    self.n_preemptions = 0
    self.n_steps = 0

  # -- requests ------------------------------------------------------------------------------

  def add_request(
    self, request_id: RequestId, prompt: Sequence[int], params: SamplingParams | None = None
  ) -> None:
    """Queues a request.

    Everything the jitted step will hold is checked here (SamplingParams checks its own fields
    against i32/f32), so an admitted request cannot make a batched step fail.

    Raises:
      RequestError: empty prompt, token ids that are not integers in the vocabulary, prompt +
        max_new_tokens past the context, or more blocks than the whole pool holds; or a
        duplicate id.
    """
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
      raise RequestError(f"params={params!r} is not allowed: must be a SamplingParams")
    V = self.model_config.vocab_size
    try:
      hash(request_id)
    except TypeError:
      raise RequestError(f"request id {request_id!r} is not allowed: must be hashable") from None
    if request_id in self._requests:
      raise RequestError(f"request {request_id!r} already exists")
    if isinstance(prompt, str | bytes):
      raise RequestError("the prompt must be a list of token ids, not text (encode it first)")
    prompt = list(prompt)
    if not all(
      isinstance(t, numbers.Integral) and not isinstance(t, bool | np.bool_) for t in prompt
    ):
      raise RequestError(f"prompt token ids must be integers in [0, {V})")
    prompt = [int(t) for t in prompt]
    if not prompt:
      raise RequestError("the prompt needs at least one token")
    if min(prompt) < 0 or max(prompt) >= V:
      bad = next(t for t in prompt if not 0 <= t < V)
      raise RequestError(f"prompt token id {bad} is not allowed: token ids must be in [0, {V})")
    total = len(prompt) + params.max_new_tokens
    if total > self.max_model_len:
      raise RequestError(
        f"prompt length {len(prompt)} + max_tokens {params.max_new_tokens} = {total} exceeds "
        f"the context length {self.max_model_len}"
      )
    Z = self.config.block_size
    if -(-total // Z) > self.config.n_blocks:
      raise RequestError(
        f"prompt length {len(prompt)} + max_tokens {params.max_new_tokens} needs "
        f"{-(-total // Z)} KV blocks of {Z} tokens; the pool holds {self.config.n_blocks}"
      )
    stop = set(params.stop_token_ids)
    if self.eos_id is not None and not params.ignore_eos:
      stop.add(self.eos_id)
    req = _Request(request_id, prompt, params, self._arrivals, frozenset(stop))
    self._arrivals += 1
    self._requests[request_id] = req
    self.waiting.append(req)

  def abort(self, request_id: RequestId) -> None:
    """Cancels a request (any thread); its blocks are freed at the start of the next step."""
    with self._abort_lock:
      self._aborts.append(request_id)

  def has_unfinished(self) -> bool:
    return bool(self.waiting or self.running or self._aborts)

  @property
  def n_running(self) -> int:
    return len(self.running)

  @property
  def n_waiting(self) -> int:
    return len(self.waiting)

  def kv_usage(self) -> float:
    """Fraction of the pool's blocks referenced by live requests."""
    s = self.allocator.stats()
    return s.n_used / s.n_blocks

  # -- the step ------------------------------------------------------------------------------

  def step(self) -> list[RequestOutput]:
    """Schedules, runs the model once or twice, samples; returns what changed.

    A request whose rows make the model step raise fails alone (finish_reason "error"); the
    others continue with unchanged outputs (see `_run_isolated`).
    """
    outputs = self._process_aborts()
    scheduled = self._schedule()
    if not scheduled:
      return outputs
    self.n_steps += 1
    prefill = [(r, n) for r, n in scheduled if n > 1]
    decode = [(r, n) for r, n in scheduled if n == 1]
    results: dict[RequestId, tuple] = {}
    failed: dict[RequestId, str] = {}
    try:
      for rows, T in ((prefill, None), (decode, 1)):
        if rows:
          got, bad = self._run_isolated(rows, T)
          results.update(got)
          failed.update(bad)
    except _PoolLost as lost:
      return outputs + self._recover_pool(lost)
    if failed:
      outputs += self._fail_rows(scheduled, failed)
      scheduled = [(r, n) for r, n in scheduled if r in self.running]  # not failed or preempted
    for req, n in scheduled:
      req.n_computed += n
      if req.n_pending == 0:  # the row ended on the sequence's last token: its draw counts
        try:
          outputs.append(self._accept(req, *results[req.id]))
        except Exception as e:  # e.g. the detokenizer: this request's fault only
          outputs.append(self._finish(req, "error", f"{type(e).__name__}: {e}"))
    return outputs

  def generate(
    self,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
  ) -> list[list[int]]:
    """Serves a list of prompts to completion; the new tokens of each, in order."""
    params = SamplingParams() if params is None else params
    per_row = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    ids = [("generate", self._arrivals, i) for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, per_row):
      self.add_request(rid, p, sp)
    got: dict[RequestId, list[int]] = {rid: [] for rid in ids}
    while any(rid in self._requests for rid in ids):
      for out in self.step():
        if out.request_id in got:
          if out.error:
            raise RequestError(out.error)
          got[out.request_id].extend(out.new_token_ids)
    return [got[rid] for rid in ids]

  # -- scheduling ----------------------------------------------------------------------------

  def _process_aborts(self) -> list[RequestOutput]:
    with self._abort_lock:
      aborts, self._aborts = self._aborts, []
    outputs = []
    for rid in aborts:
      req = self._requests.get(rid)
      if req is not None:
        outputs.append(self._finish(req, "abort"))
    return outputs

  def _preempt(self, req: _Request) -> None:
    """Recompute-style preemption: free the blocks, requeue at the front."""
    self.allocator.free(req.id)
    self.running.remove(req)
    req.n_computed = 0
    req.n_preemptions += 1
    self.n_preemptions += 1
    self.waiting.appendleft(req)

  def _schedule(self) -> list[tuple[_Request, int]]:
    cfg = self.config
    budget = cfg.max_num_batched_tokens
    scheduled: list[tuple[_Request, int]] = []
    preempted = False
    i = 0
    while i < len(self.running) and budget > 0:
      req = self.running[i]
      n = min(req.n_pending, cfg.prefill_chunk, budget)
      start = req.n_computed
      while True:
        try:
          copies = self.allocator.append(req.id, req.tokens[start : start + n])
          assert not copies, "the engine never forks, so no block is shared mid-write"
          break
        except OutOfBlocksError:
          preempted = True
          self._preempt(self.running[-1])  # the newest; possibly `req` itself
          if req not in self.running:
            break
      if req not in self.running:
        break  # it was the newest: nothing after it remains
      scheduled.append((req, n))
      budget -= n
      i += 1
    # Admit only when nothing was preempted this step, or the two would trade blocks forever.
    while not preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
      req = self.waiting[0]
      tokens = req.tokens
      hit = self.allocator.cached_prefix_length(tokens)
      n = min(len(tokens) - hit, cfg.prefill_chunk, budget)
      try:
        got = self.allocator.add_sequence(req.id, tokens[: hit + n])
      except OutOfBlocksError:
        break
      self.waiting.popleft()
      self.running.append(req)
      req.n_computed = got
      n = hit + n - got
      scheduled.append((req, n))
      budget -= n
    # Running stays in arrival order so the oldest is scheduled first and preempted last.
    self.running.sort(key=lambda r: r.arrival)
    return scheduled

  def _run(self, rows: list[tuple[_Request, int]], T: int | None) -> dict:
    """One jitted call over `rows`; returns {id: (token, logprob, top ids, top logprobs)}."""
    B = _pow2(len(rows))
    if T is None:
      T = min(_pow2(max(n for _, n in rows), 16), self.config.prefill_chunk)
    tokens = np.zeros((B, T), np.int32)
    positions = np.full((B, T), -1, np.int32)
    lengths = np.zeros((B,), np.int32)
    last = np.zeros((B,), np.int32)
    seeds = np.zeros((B,), np.int32)
    steps = np.zeros((B,), np.int32)
    ids = [r.id for r, _ in rows]
    table, _ = self.allocator.block_table(ids, self.max_blocks)
    block_table = np.zeros((B, self.max_blocks), np.int32)
    block_table[: len(rows)] = table
    for b, (req, n) in enumerate(rows):
      start = req.n_computed
      tokens[b, :n] = req.tokens[start : start + n]
      positions[b, :n] = np.arange(start, start + n)
      lengths[b] = start
      last[b] = n - 1
      seeds[b] = req.params.seed
      steps[b] = len(req.output)
    params = [r.params for r, _ in rows]
    penalties = any(p.uses_penalties for p in params)
    counts = prompt_mask = None
    if penalties:
      V = self.model_config.vocab_size
      counts = np.zeros((B, V), np.int32)
      prompt_mask = np.zeros((B, V), bool)
      for b, (req, _) in enumerate(rows):
        np.add.at(counts[b], np.asarray(req.output, np.int64), 1)
        prompt_mask[b, req.prompt] = True
    self.pool, tok, lp, top_ids, top_lp = _forward_sample(
      self.graphdef,
      self.state,
      self.pool,
      tokens,
      positions,
      block_table,
      lengths,
      last,
      seeds,
      steps,
      SamplingArrays.from_params(params, pad_to=B),
      penalties,
      counts,
      prompt_mask,
    )
    tok, lp, top_ids, top_lp = map(np.asarray, (tok, lp, top_ids, top_lp))
    return {
      req.id: (int(tok[b]), float(lp[b]), top_ids[b], top_lp[b]) for b, (req, _) in enumerate(rows)
    }

  # -- fault isolation ------------------------------------------------------------------------

  def _run_isolated(self, rows: list[tuple[_Request, int]], T: int | None):
    """`_run`, and when it raises, the rows split in halves until the failing ones are alone.

    Halves run in order, so a row reading blocks that an earlier row writes this step still
    reads them after they are written. Requests flagged `suspect` (in a call that lost the pool)
    run alone. Returns ({id: draw}, {id: error message}).
    """
    groups: list[list[tuple[_Request, int]]] = []
    for row in rows:
      if row[0].suspect or not groups or groups[-1][0][0].suspect:
        groups.append([row])
      else:
        groups[-1].append(row)
    results: dict[RequestId, tuple] = {}
    failed: dict[RequestId, str] = {}
    for group in groups:
      try:
        results.update(self._run(group, T))
      except Exception as e:
        if any(x.is_deleted() for x in jax.tree.leaves(self.pool)):
          raise _PoolLost(group, e) from e  # the donated pool went with it: nothing to re-run
        if len(group) == 1:
          failed[group[0][0].id] = _step_error(e)
          continue
        mid = len(group) // 2
        for half in (group[:mid], group[mid:]):
          got, bad = self._run_isolated(half, T)
          results.update(got)
          failed.update(bad)
    return results, failed

  def _fail_rows(
    self, scheduled: list[tuple[_Request, int]], failed: dict[RequestId, str]
  ) -> list[RequestOutput]:
    """Ends the failed requests; recomputes those that read K/V the failed ones never wrote.

    The blocks a failed row was to fill this step hold no valid K/V, though the allocator may
    have hashed them into the prefix cache and another request admitted this step may read them:
    they leave the cache, and every reader (transitively) is preempted to recompute.
    """
    by_id = {r.id: r for r, _ in scheduled}
    lost_blocks: set[int] = set()
    tainted = set(failed)
    changed = True
    while changed:
      changed = False
      for req, _ in scheduled:
        blocks = self.allocator.blocks(req.id)
        written = blocks[req.n_computed // self.config.block_size :]  # blocks filled this step
        if req.id in tainted:
          if not lost_blocks.issuperset(written):
            lost_blocks.update(written)
            changed = True
        elif lost_blocks.intersection(blocks):
          tainted.add(req.id)
          changed = True
    outputs = []
    for rid in tainted:
      req = by_id[rid]
      self.allocator.free(rid, computed=req.n_computed)
      if rid in failed:
        outputs.append(self._finish(req, "error", failed[rid]))
      else:
        self.running.remove(req)
        req.n_computed = 0
        req.n_preemptions += 1
        self.n_preemptions += 1
        self.waiting.appendleft(req)
    self.waiting = collections.deque(sorted(self.waiting, key=lambda r: r.arrival))
    return outputs

  def _recover_pool(self, lost: _PoolLost) -> list[RequestOutput]:
    """The step failed after the device took the donated pool: every running request's K/V are
    gone. A fresh pool and allocator, every running request recomputes (its outputs so far are
    kept, and its sampling keys make the recomputation draw the same tokens); the rows of the
    failed call fail if there was one, else run alone from now on until the culprit is found.
    """
    outputs = []
    rows = [r for r, _ in lost.rows]
    if len(rows) == 1:
      outputs.append(self._finish(rows[0], "error", _step_error(lost.error)))
    for req in rows:
      req.suspect = True
    self.pool = jax.tree.map(
      lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), self._pool_spec
    )
    self.allocator = BlockAllocator(
      self.config.n_blocks,
      self.config.block_size,
      enable_prefix_caching=self.config.enable_prefix_caching,
    )
    for req in self.running:
      req.n_computed = 0
      req.n_preemptions += 1
      self.n_preemptions += 1
    self.waiting = collections.deque(
      sorted([*self.running, *self.waiting], key=lambda r: r.arrival)
    )
    self.running = []
    return outputs

  # -- results -------------------------------------------------------------------------------

  def _accept(self, req: _Request, token, logprob, top_ids, top_logprobs) -> RequestOutput:
    req.output.append(token)
    n_top = req.params.logprobs or 0
    top = [(int(t), float(p)) for t, p in zip(top_ids[:n_top], top_logprobs[:n_top])]
    reason = None
    if token in req.stop_ids:
      reason = "stop"
    elif len(req.output) >= req.params.max_new_tokens:
      reason = "length"
    text = ""
    if self.detokenize is not None:
      req.text = self.detokenize(req.output)
      end = len(req.text)
      for s in req.params.stop:
        at = req.text.find(s, max(0, req.n_text_sent - len(s) + 1))
        if at >= 0 and at < end:
          end, reason = at, "stop"
      if reason is None:
        # Hold back what could be the start of a stop string, or half a UTF-8 character.
        hold = max((len(s) - 1 for s in req.params.stop), default=0)
        end = len(req.text) - hold
        while end > req.n_text_sent and req.text[end - 1] == "\ufffd":
          end -= 1
      end = max(end, req.n_text_sent)
      text = req.text[req.n_text_sent : end]
      req.n_text_sent = end
    out = RequestOutput(
      req.id,
      [token],
      [logprob],
      [top] if req.params.logprobs is not None else [],
      text,
      finished=reason is not None,
      finish_reason=reason,
    )
    if reason is not None:
      self._release(req)
    return out

  def _release(self, req: _Request) -> None:
    if req.id in self.allocator:
      self.allocator.free(req.id)
    if req in self.running:
      self.running.remove(req)
    if req in self.waiting:
      self.waiting.remove(req)
    self._requests.pop(req.id, None)

  def _finish(self, req: _Request, reason: str, error: str | None = None) -> RequestOutput:
    self._release(req)
    return RequestOutput(req.id, [], [], [], "", finished=True, finish_reason=reason, error=error)


__all__ = ["MAX_LOGPROBS", "Engine", "EngineConfig", "RequestError", "RequestOutput"]
