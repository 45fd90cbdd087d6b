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

When every running request is decoding and nothing waits that could be admitted, a step is a
burst instead: `decode_burst` iterations in one jitted call, each sampled token fed back on the
device, blocks reserved ahead for them (`BlockAllocator.reserve`). The host reads the K tokens
of every row once, cuts each at its first stop (eos, stop token, max_tokens, stop string) and
gives back the blocks it did not need, so outputs are exactly those of single steps while the
host's per-step work is paid once per K tokens.

Attention work follows the real lengths: every call's block table has as many columns as its
longest row holds blocks, rounded up to a power of two, not the context's maximum. Output text is
detokenised incrementally (`atlas_jax.serving.detokenize`).

`add_requests` queues n completions of one prompt (OpenAI's `n`): only the first computes the
prompt; when its prompt is done, every other completion forks its blocks (`BlockAllocator.fork`),
drops the last prompt token and recomputes just that one, in a device copy of the shared partial
block (copy-on-write). So n completions cost one prefill.

A guided request (`SamplingParams.guided`, a compiled grammar) holds a matcher: each step that
samples for it passes its allowed tokens (packed bits i32[W], from the matcher's state) into the
jitted step, which masks the logits; the drawn token advances the matcher, and the request stops
("stop") once only eos could follow. No burst runs while a guided request is running, since its
mask depends on each drawn token (speculative rounds do: see below). Preemption keeps the output
tokens, so the matcher stays valid.

With a draft model (`Engine(..., draft=...)`), a step in which every running request decodes
and the batch is at most `speculative_max_batch` (`guided_speculative_max_batch` with a guided
row) is a speculative round instead
(`steps.speculative_round`): the draft proposes `num_speculative_tokens` tokens per row, the
target scores them in one pass, and each row keeps its accepted drafts and the token after them;
blocks are reserved for all k + 1 positions and those past the kept tokens are given back
(`BlockAllocator.truncate`). The draft has its own pool with the target's block tables and runs
over every token the target computes (prefill chunks and bursts too), so it never needs to catch
up. With `draft="mtp"` the model's own multi-token-prediction heads draft instead, from the
trunk's hidden states at the last computed position (kept per slot beside the heads' own pool).
Outputs follow the target's law exactly; greedy outputs equal plain greedy decoding. Rows
with penalties do not speculate (the batch takes plain steps while one runs). A batch with
guided rows runs the round as two programs (`steps.speculative_draft`, then
`steps.speculative_verify`): between them the host advances each guided row's matcher along its
drafts, collecting the mask at every position, and rolls it back; the target's distributions are
masked there, so a draft the grammar refuses is rejected and the token drawn in its place is
allowed. The first draft of a guided row is drawn under its current mask; later ones are not
(their masks depend on the drafts before them), so a guided row accepts fewer drafts where the
grammar departs from what the draft would write. The matcher then advances by the emitted tokens
only.
Larger batches burst instead: there the target's pass is no longer bound by reading its
weights, and speculation's extra draft and rejected-token work stops paying.

A request in its first `min_tokens` tokens has its eos and stop ids masked the same way (and no
burst or speculative round runs while one does); stop strings are looked for only after them. A
request with `prompt_logprobs` gets the log-probabilities of its prompt tokens, from one more pass
of the model over the whole prompt when its first token is drawn (`steps.prompt_logprobs`).

`warmup()` compiles the step shapes a server meets first (decode steps and bursts at every batch
bucket, prefill chunks), so that the first requests do not pay for compilation; it names the
shapes it leaves to first use. Each finished request is logged on one line (logger
`atlas_jax.serving`, INFO): its id, prompt and output tokens, time to first token, total time and
finish reason.

A request that cannot fit the pool (or the context) on its own is rejected when it is added, so
the oldest request can always make progress by preempting newer ones: no crash, no livelock.
Sampling keys are `fold_in(key(seed), i)` for the i-th generated token, as in `generate`, so
outputs do not depend on arrival order, batch composition or preemption.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import numbers
import threading
import time
from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from atlas_jax.cache.allocator import BlockAllocator, OutOfBlocksError
from atlas_jax.decoding.guided import GuidedMatcher
from atlas_jax.decoding.sampling import SamplingArrays, SamplingParams, eos_ids
from atlas_jax.model.transformer import Transformer
from atlas_jax.serving import steps
from atlas_jax.serving.detokenize import IncrementalDetokenizer

Array = jax.Array
RequestId = Hashable
log = logging.getLogger("atlas_jax.serving")


class RequestError(ValueError):
  """A request the engine cannot serve (too long for the context or the pool, bad token ids).
  `field` names the request field at fault, where one is (e.g. "logit_bias")."""

  def __init__(self, message: str, field: str | None = None):
    super().__init__(message)
    self.field = field


class _PoolLost(Exception):
  """A jitted call raised after the device took the donated pool."""

  def __init__(self, rows: list[_Request], error: BaseException):
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
  decode_burst: int = 8  # K: decode iterations per call when no request needs the host; 1: off
  # With a draft model: tokens it proposes per round, and the largest batch that speculates.
  num_speculative_tokens: int = 4
  speculative_max_batch: int = 8  # measured: bench/speculative.py --engine
  # The same for a batch with a guided row, whose rounds pay a host walk of the drafts and
  # accept fewer of them; measured: bench/speculative.py --engine-guided.
  guided_speculative_max_batch: int = 4
  # Rows of a step are padded to a power of two, at least this many: each bucket is one more
  # compiled shape of every program (warm-up time), each padded row wasted work.
  min_batch_bucket: int = 1

  def __post_init__(self):
    for name in (
      "n_blocks",
      "block_size",
      "max_num_seqs",
      "max_num_batched_tokens",
      "decode_burst",
      "num_speculative_tokens",
      "speculative_max_batch",
      "guided_speculative_max_batch",
    ):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r} must be a positive int")
    for name in ("prefill_chunk", "min_batch_bucket"):
      c = getattr(self, name)
      if not isinstance(c, int) or c < 1 or c & (c - 1):
        raise ValueError(f"EngineConfig.{name}={c!r} must be a power of two")
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
  # With `params.prompt_logprobs`, on the request's first output: per prompt token, its logprob
  # and the top `prompt_logprobs` (token, logprob) pairs; None for the first token.
  prompt_logprobs: list[float | None] | None = None
  prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclasses.dataclass
class _Request:
  id: RequestId
  prompt: list[int]
  params: SamplingParams
  arrival: int
  stop_ids: frozenset[int]
  output: list[int] = dataclasses.field(default_factory=list)
  n_computed: int = 0  # tokens of prompt + output whose K/V are in the pool
  detok: IncrementalDetokenizer | None = None  # the output's text (only with a detokenizer)
  n_text_sent: int = 0
  stop_at: int | None = None  # where the first stop string starts in the text
  stop_end: int | None = None  # and where it ends
  n_preemptions: int = 0
  suspect: bool = False  # in a failed call that lost the pool: runs alone from then on
  matcher: GuidedMatcher | None = None  # guided requests: where the output is in the grammar
  t_arrival: float = 0.0  # time.perf_counter() when added
  t_first: float | None = None  # when its first token was drawn

  @property
  def suppressing_stops(self) -> bool:
    """Whether its eos and stop ids are masked (its first `min_tokens` tokens)."""
    return len(self.output) < self.params.min_tokens

  @property
  def tokens(self) -> list[int]:
    return self.prompt + self.output

  @property
  def n_pending(self) -> int:
    return len(self.prompt) + len(self.output) - self.n_computed


@dataclasses.dataclass
class _Burst:
  """A dispatched decode burst: its rows, and its outputs still on the device."""

  rows: list[_Request]
  start: list[int]  # each row's computed tokens when the burst began (its pending token's position)
  first_step: np.ndarray  # i32[B] index of each row's first draw in the burst
  prompt_mask: Array | None  # bool[B, V] (penalties)
  tok: Array  # i32[K, B]
  lp: Array  # f32[K, B]
  top_ids: Array  # i32[K, B, 5]
  top_lp: Array  # f32[K, B, 5]
  counts: Array | None  # i32[B, V] output token counts after the burst (penalties)
  n_draws: np.ndarray | None = None  # i32[B] real draws per row (a speculative round), else all K


def _step_error(e: BaseException) -> str:
  return f"the model step failed: {type(e).__name__}: {e}"


def _pool_lost(pool) -> bool:
  return any(x.is_deleted() for x in jax.tree.leaves(pool))


def _pow2(n: int, minimum: int = 1) -> int:
  return max(minimum, 1 << max(n - 1, 0).bit_length())


def _check_mtp(model: Transformer, k: int) -> None:
  if model.mtp is None:
    raise ValueError("draft='mtp': the model has no MTP heads (model.mtp is null)")
  if k > model.mtp.n_draft_heads:
    raise ValueError(
      f"num_speculative_tokens={k} with draft='mtp' must be <= {model.mtp.n_draft_heads}: each "
      f"{model.mtp.kind} MTP head drafts one token"
    )


def _check_draft(draft, cfg, max_model_len: int) -> None:
  """ValueError naming the field when `draft` cannot draft for a model of config `cfg`."""
  if not isinstance(draft, Transformer):
    raise ValueError(f"draft={draft!r} is not allowed: must be a Transformer (or None)")
  if draft.cfg.vocab_size != cfg.vocab_size:
    raise ValueError(
      f"draft vocab_size={draft.cfg.vocab_size} != the model's vocab_size={cfg.vocab_size}: "
      "speculation needs one vocabulary"
    )
  if draft.cfg.max_seq_len < max_model_len:
    raise ValueError(
      f"draft max_seq_len={draft.cfg.max_seq_len} is shorter than the served context "
      f"max_model_len={max_model_len}"
    )


class Engine:
  """Continuous batching over a paged KV cache.

  Not thread-safe by itself except for `abort`, which may be called from any thread; drive
  `add_request` and `step` from one thread (see `atlas_jax.serving.server`).

  Args:
    model: a Transformer (any family: its pool holds K/V, or MLA latents).
    config: pool and scheduling limits.
    eos_id: the model's end-of-sequence token, or a list of them (Llama-3-Instruct ends on two):
      stop tokens unless a request sets ignore_eos.
    detokenize: token ids -> text; enables stop strings and the `text` of outputs. A request with
      `skip_special_tokens=False` calls it with that keyword.
    draft: a smaller model with the same vocabulary, for speculative decoding; or "mtp", the
      model's own multi-token-prediction heads.
  """

  def __init__(
    self,
    model: Transformer,
    config: EngineConfig = EngineConfig(),
    *,
    eos_id: int | Sequence[int] | None = None,
    detokenize: Callable[[Sequence[int]], str] | None = None,
    draft: Transformer | str | None = None,
  ):
    cfg = model.cfg
    self.config = config
    self.model_config = cfg
    self.max_model_len = config.max_model_len or cfg.max_seq_len
    self.eos_ids = frozenset(eos_ids(eos_id))
    self.detokenize = detokenize
    self.graphdef, state = nnx.split(model)
    self.draft = draft
    d_graphdef, d_state, d_pool = None, None, None
    if draft == "mtp":
      _check_mtp(model, config.num_speculative_tokens)
      d_graphdef = steps.MTP
      P, Z, dtype = config.n_blocks, config.block_size, jnp.dtype(cfg.dtype)
      hidden_PZD = lambda: jnp.zeros((P, Z, cfg.d_model), dtype)
      # The heads' pool, and the trunk's hidden states (final, last-block input) per slot.
      # The first k heads only: the others would draft tokens nobody verifies.
      heads = model.mtp.init_pool(cfg, P, Z, dtype, n_heads=config.num_speculative_tokens)
      d_pool = (heads, hidden_PZD(), hidden_PZD())
    elif draft is not None:
      _check_draft(draft, cfg, self.max_model_len)
      d_graphdef, d_state = nnx.split(draft)
      d_pool = draft.init_pool(config.n_blocks, config.block_size)
    self.states = (state, d_state)
    self.programs = steps.programs(self.graphdef, d_graphdef)
    # The target's pool (KV or MLA latents) and the draft's, indexed by the same block tables.
    self.pools = (model.init_pool(config.n_blocks, config.block_size), d_pool)
    # Shapes, dtypes and placement of the pools, to build fresh ones if a failed step lost them.
    self._pool_spec = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.pools
    )
    self.allocator = BlockAllocator(
      config.n_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
    )
    # M, the most block-table columns: the context, plus what a burst or a speculative round may
    # write past its end (draws after a request's last token, which are cut).
    Z = config.block_size
    ahead = max(config.decode_burst, config.num_speculative_tokens + 1)
    self.max_blocks = -(-(self.max_model_len + ahead) // Z)
    # Block tables narrower than 64 tokens would only add compiled shapes.
    self._min_blocks = _pow2(-(-64 // Z))
    self.waiting: collections.deque[_Request] = collections.deque()
    self.running: list[_Request] = []  # oldest first
    self._requests: dict[RequestId, _Request] = {}
    # Completions waiting for their first sibling's prompt, by that sibling's id (add_requests).
    self._followers: dict[RequestId, list[_Request]] = {}
    self._pending_copies: list[tuple[int, int]] = []  # copy-on-write pairs for the next step
    self._inflight: _Burst | None = None  # a dispatched decode burst the host has not read yet
    self._aborts: list[RequestId] = []
    self._abort_lock = threading.Lock()
    self._arrivals = 0
    self.n_preemptions = 0
    self.n_steps = 0
    self.n_computed_tokens = 0  # tokens run through the model (prefill, recompute and decode)
    self.n_bursts = 0  # steps that ran `decode_burst` decode iterations
    self.n_chained = 0  # bursts dispatched before the host read the previous one
    self.n_spec_rounds = 0  # steps that were speculative rounds
    self.n_spec_row_rounds = 0  # of those, summed over their rows (target passes per row)
    self.n_drafted = 0  # draft tokens proposed to the target
    self.n_accepted = 0  # of those, accepted
    self.n_spec_emitted = 0  # tokens emitted by speculative rounds (accepted + one per row round)
    self._finished: list[_Request] = []  # released since the last step's log lines

  @property
  def mean_acceptance_length(self) -> float:
    """Tokens a row emits per speculative round (accepted drafts + 1; cut at stops)."""
    return self.n_spec_emitted / max(self.n_spec_row_rounds, 1)

  # -- start-up ------------------------------------------------------------------------------

  def warmup_shapes(self) -> tuple[list[tuple[str, int, int]], list[str]]:
    """(the step shapes `warmup` compiles, as (program, rows B, tokens T), what it leaves to
    first use): decode steps and bursts at every batch bucket, one prompt's prefill at every
    chunk bucket and short prompts' (T <= 32) at every batch bucket; all with the narrowest
    block table."""
    c = self.config
    buckets = sorted({self._bucket(n) for n in range(1, c.max_num_seqs + 1)})
    chunks = sorted({min(_pow2(n, 16), c.prefill_chunk) for n in range(2, c.prefill_chunk + 1)})
    shapes = [("prefill", B, T) for B in buckets for T in chunks if B == 1 or T <= 32]
    shapes += [("decode", B, 1) for B in buckets]
    if c.decode_burst >= 2:
      shapes += [("burst", B, c.decode_burst) for B in buckets]
    if self.draft is not None:
      k = c.num_speculative_tokens
      shapes += [("speculate", B, k + 1) for B in buckets if B <= _pow2(c.speculative_max_batch)]
    Z, M = c.block_size, min(self._min_blocks, self.max_blocks)
    deferred = [
      f"block tables past {M * Z} tokens (one more shape per doubling of a context)",
      "prefill batches of more than one prompt past 32 tokens",
      "penalties, logit bias, guided masks, min_tokens and prompt logprobs",
    ]
    return shapes, deferred

  def warmup(self, progress: Callable[[int, int, str], None] | None = None) -> None:
    """Compiles (and runs once, on padding rows that write nothing) every shape of
    `warmup_shapes`, so the first requests of those shapes do not wait for XLA.

    Args:
      progress: called before each shape with (index, total, "prefill B=4 T=32").
    """
    shapes, _ = self.warmup_shapes()
    M = min(self._min_blocks, self.max_blocks)
    for i, (kind, B, T) in enumerate(shapes):
      if progress is not None:
        progress(i + 1, len(shapes), f"{kind} B={B} T={T}")
      zeros = lambda *shape: np.zeros(shape, np.int32)
      table, arrays, pad = zeros(B, M), SamplingArrays.from_params([], pad_to=B), np.full(B, -1)
      progs = self.programs
      if kind in ("prefill", "decode"):
        self.pools, *outs = progs.forward_sample(
          self.states,
          self.pools,
          zeros(B, T),
          np.full((B, T), -1, np.int32),
          table,
          zeros(B),
          zeros(B),
          zeros(B),
          zeros(B),
          arrays,
          False,
          None,
          None,
        )
      elif kind == "burst":
        # Twice: fed from the host, then from the device (a chained burst's pending tokens are
        # the last one's draws, which the program sees as placed on the device).
        tokens = zeros(B)
        for _ in range(2):
          self.pools, *outs = progs.decode_burst(
            self.states,
            self.pools,
            tokens,
            pad.astype(np.int32),
            table,
            zeros(B),
            zeros(B),
            arrays,
            None,
            T,
            False,
            None,
          )
          tokens = outs[0][T - 1]
      else:
        rows = steps.RoundRows(zeros(B), pad.astype(np.int32), table, zeros(B), zeros(B), arrays)
        self.pools, *outs = progs.speculative_round(self.states, self.pools, rows, T - 1)
      jax.block_until_ready(outs)

  # -- requests ------------------------------------------------------------------------------

  def add_request(
    self, request_id: RequestId, prompt: Sequence[int], params: SamplingParams | None = None
  ) -> None:
    """Queues a request.

    Raises:
      RequestError: empty prompt, token ids that are not integers in the vocabulary, prompt +
        max_new_tokens past the context, or more blocks than the whole pool holds; or a
        duplicate id.
    """
    req = self._make_request(request_id, prompt, params)
    self._requests[request_id] = req
    self.waiting.append(req)

  def add_requests(
    self,
    request_ids: Sequence[RequestId],
    prompt: Sequence[int],
    params: Sequence[SamplingParams],
  ) -> None:
    """Queues n completions of one prompt that share its computation and its blocks.

    Each completion samples with its own params (seeds differ, say) and produces exactly what
    `add_request` would; the prompt is computed once and its blocks are shared copy-on-write.
    All or nothing: if any request is invalid, none is queued.

    Raises:
      RequestError: as `add_request`, for any of them; or ids and params of different lengths.
    """
    if len(request_ids) != len(params) or not request_ids:
      raise RequestError(
        f"add_requests: {len(request_ids)} request ids for {len(params)} SamplingParams"
      )
    if len(set(request_ids)) != len(request_ids):
      raise RequestError(f"add_requests: duplicate request ids in {list(request_ids)!r}")
    reqs = [self._make_request(rid, prompt, p) for rid, p in zip(request_ids, params)]
    for req in reqs:
      self._requests[req.id] = req
    self.waiting.append(reqs[0])
    if len(reqs) > 1:
      self._followers[reqs[0].id] = reqs[1:]

  def _make_request(
    self, request_id: RequestId, prompt: Sequence[int], params: SamplingParams | None
  ) -> _Request:
    """A validated request with the next arrival number; nothing is queued.

    Everything the jitted steps will hold is checked here (SamplingParams checks its own fields
    against i32/f32), so an admitted request cannot make a batched step fail.
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
    for token, _ in params.logit_bias:
      if token >= V:
        raise RequestError(
          f"logit_bias token id {token} is not allowed: token ids must be in [0, {V})",
          "logit_bias",
        )
    stop = set(params.stop_token_ids)
    if not params.ignore_eos:
      stop |= self.eos_ids
    if params.guided is not None:
      if params.guided.vocab_size != V:
        raise RequestError(
          f"guided grammar compiled for {params.guided.vocab_size} tokens; the model has {V}"
        )
      stop.add(params.guided.eos_id)  # the grammar allows eos only where the output is whole
    req = _Request(request_id, prompt, params, self._arrivals, frozenset(stop))
    req.t_arrival = time.perf_counter()
    if params.guided is not None:
      req.matcher = params.guided.matcher()
    if self.detokenize is not None:
      decode = self.detokenize
      if not params.skip_special_tokens:
        decode = functools.partial(decode, skip_special_tokens=False)
      req.detok = IncrementalDetokenizer(decode)
    self._arrivals += 1
    return req

  def abort(self, request_id: RequestId) -> None:
    """Cancels a request (any thread); its blocks are freed at the start of the next step."""
    with self._abort_lock:
      self._aborts.append(request_id)

  def has_unfinished(self) -> bool:
    return bool(
      self.waiting or self.running or self._aborts or self._followers or self._inflight is not None
    )

  @property
  def n_running(self) -> int:
    return len(self.running)

  @property
  def n_waiting(self) -> int:
    return len(self.waiting) + sum(len(f) for f in self._followers.values())

  def kv_usage(self) -> float:
    """Fraction of the pool's blocks referenced by live requests."""
    s = self.allocator.stats()
    return s.n_used / s.n_blocks

  # -- the step ------------------------------------------------------------------------------

  def step(self) -> list[RequestOutput]:
    """Schedules, runs the model (a mixed step, or a burst of decode steps), samples; returns
    what changed.

    A request whose rows make the model step raise fails alone (finish_reason "error"); the
    others continue with unchanged outputs (see `_run_isolated`).
    """
    outputs = self._step()
    if self._finished:
      reasons = {o.request_id: o.finish_reason for o in outputs if o.finished}
      for req in self._finished:
        _log_finished(req, reasons.get(req.id))
      self._finished = []
    return outputs

  def _step(self) -> list[RequestOutput]:
    outputs = self._process_aborts()
    try:
      if self._inflight is not None:
        # The host settles the burst in flight while the next one (if any) runs on the device.
        burst = self._inflight
        self._inflight = self._chain(burst)
        return outputs + self._collect(burst)
      if self._should_speculate():
        got = self._speculate()
        if got is not None:
          return outputs + got
      elif self._should_burst():
        self._inflight = self._start_burst()
        if self._inflight is not None:
          return outputs  # its tokens are read by the next step, while the next burst runs
    except _PoolLost as lost:
      return outputs + self._recover_pool(lost)
    scheduled, copies = self._schedule()
    if not scheduled:
      return outputs
    self.n_steps += 1
    self.n_computed_tokens += sum(n for _, n in scheduled)
    self._copy(copies)
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
      if req.id in self._followers and req.n_computed == len(req.prompt):
        self._fork_followers(req)  # before `_accept` may finish and free the leader
      if req.n_pending == 0:  # the row ended on the sequence's last token: its draw counts
        token, logprob, top_ids, top_lp = results[req.id]
        try:
          outputs.append(self._accept(req, [token], [logprob], [top_ids], [top_lp])[0])
        except Exception as e:  # e.g. the detokenizer: this request's fault only
          outputs.append(self._finish(req, "error", f"{type(e).__name__}: {e}"))
    return outputs

  def _copy(self, copies: list[tuple[int, int]]) -> None:
    """Copy-on-write: shared blocks are copied on the device before a step writes into them."""
    copies, self._pending_copies = self._pending_copies + copies, []
    if copies:
      # Padded to a power of two by repeating the last pair (an idempotent copy).
      pairs = copies + copies[-1:] * (_pow2(len(copies)) - len(copies))
      src, dst = (np.asarray(x, np.int32) for x in zip(*pairs))
      self.pools = steps.copy_blocks(self.pools, src, dst)

  def _should_burst(self) -> bool:
    """Whether no running request needs the host for `decode_burst` steps."""
    return (
      self.config.decode_burst >= 2
      and self._decode_only()
      # A guided row's mask follows each draw; a row in its min_tokens changes mask.
      and all(r.matcher is None and not r.suppressing_stops for r in self.running)
    )

  def _should_speculate(self) -> bool:
    """Whether this step is a speculative round: a draft, a small enough batch, no row with
    penalties (their counts would follow each draft) or in its min_tokens, and no request that
    needs a mixed step. Guided rows speculate: the host walks their drafts through the grammar
    mid-round."""
    return self._speculates(self.running) and self._decode_only()

  def _speculates(self, rows: list[_Request]) -> bool:
    guided = any(r.matcher is not None for r in rows)
    c = self.config
    return (
      self.draft is not None
      and len(rows) <= (c.guided_speculative_max_batch if guided else c.speculative_max_batch)
      and not any(r.params.uses_penalties or r.suppressing_stops for r in rows)
    )

  def _decode_only(self) -> bool:
    """Whether every running request is decoding one pending token, and nothing waits that
    could be admitted now."""
    if not self.running:
      return False
    if any(r.suspect for r in self.running):
      return False  # suspects run alone, in mixed steps
    if any(r.n_pending != 1 for r in self.running):
      return False
    if self.waiting and len(self.running) < self.config.max_num_seqs:
      head = self.waiting[0]
      hit = self.allocator.cached_prefix_length(head.tokens)
      first = min(len(head.tokens) - hit, self.config.prefill_chunk)
      if -(-first // self.config.block_size) < self.allocator.n_available:
        return False  # admit it with a mixed step rather than make it wait a burst
    return True

  def _reserve(self, rows: list[_Request], n_tokens: int) -> list[tuple[int, int]] | None:
    """Reserves blocks for `n_tokens` tokens past each row's computed ones; None (and nothing
    reserved) when the pool cannot hold them all."""
    needed = sum(self.allocator.blocks_needed(r.id, n_tokens) for r in rows)
    if needed > self.allocator.n_available:
      return None
    return [pair for r in rows for pair in self.allocator.reserve(r.id, n_tokens)]

  def _start_burst(self) -> _Burst | None:
    """Dispatches `decode_burst` decode iterations of every running request; None when the pool
    cannot hold their reservations (a mixed step then preempts as usual)."""
    K = self.config.decode_burst
    rows = list(self.running)
    copies = self._reserve(rows, K)
    if copies is None:
      return None
    self._copy(copies)
    B = self._bucket(len(rows))
    tokens = np.zeros((B,), np.int32)
    first_step = np.zeros((B,), np.int32)
    for b, req in enumerate(rows):
      tokens[b] = req.tokens[req.n_computed]
      first_step[b] = len(req.output)
    penalties = any(r.params.uses_penalties for r in rows)
    counts, prompt_mask = self._penalty_arrays(rows, B) if penalties else (None, None)
    start = [r.n_computed for r in rows]
    try:
      return self._dispatch(rows, start, tokens, first_step, counts, prompt_mask)
    except Exception as e:
      if _pool_lost(self.pools):
        raise _PoolLost(rows, e) from e
      for r in rows:  # the mixed step that runs instead finds the failing rows
        self.allocator.truncate(r.id, r.n_computed)
      return None

  def _dispatch(self, rows, start, tokens_B, first_step_B, counts_BV, prompt_mask_BV) -> _Burst:
    K = self.config.decode_burst
    B = self._bucket(len(rows))
    lengths = np.full((B,), -1, np.int32)
    lengths[: len(rows)] = start
    seeds = np.zeros((B,), np.int32)
    seeds[: len(rows)] = [r.params.seed for r in rows]
    params = [r.params for r in rows]
    self.n_steps += 1
    self.n_bursts += 1
    self.n_computed_tokens += K * len(rows)
    self.pools, *outs = self.programs.decode_burst(
      self.states,
      self.pools,
      tokens_B,
      lengths,
      self._block_table([r.id for r in rows], B),
      seeds,
      first_step_B,
      SamplingArrays.from_params(params, pad_to=B),
      counts_BV,
      K,
      counts_BV is not None,
      prompt_mask_BV,
    )
    return _Burst(rows, list(start), first_step_B, prompt_mask_BV, *outs)

  def _chain(self, prev: _Burst) -> _Burst | None:
    """Dispatches the next burst before the host has read `prev`, fed by `prev`'s last draws
    on the device, for the rows that are still running and not certain to stop in `prev`.
    None when a row needs the host first (an admission is possible, or the pool is short)."""
    K = self.config.decode_burst
    keep = [
      b
      for b, r in enumerate(prev.rows)
      if r in self.running and len(r.output) + K < r.params.max_new_tokens
    ]
    if not keep:
      return None
    n_free_seats = self.config.max_num_seqs - len(keep)
    if self.waiting and n_free_seats > 0:
      return None  # finishing rows will free seats: admit rather than burst on
    rows = [prev.rows[b] for b in keep]
    if self._speculates(rows):
      return None  # the batch has shrunk enough to speculate
    copies = self._reserve(rows, 2 * K)  # the burst in flight holds the first K
    if copies is None:
      return None
    self._copy(copies)
    B = self._bucket(len(rows))
    index = np.zeros((B,), np.int32)
    index[: len(keep)] = keep
    tokens_B = prev.tok[K - 1][index]  # on the device: the host has not seen these yet
    first_step = np.zeros((B,), np.int32)
    first_step[: len(keep)] = prev.first_step[keep] + K
    counts, prompt_mask = None, None
    if prev.counts is not None:
      counts, prompt_mask = prev.counts[index], prev.prompt_mask[index]
    start = [prev.start[b] + K for b in keep]
    try:
      burst = self._dispatch(rows, start, tokens_B, first_step, counts, prompt_mask)
    except Exception as e:
      if _pool_lost(self.pools):
        raise _PoolLost(prev.rows, e) from e
      return None  # `_collect` gives back what the rows reserved
    self.n_chained += 1
    return burst

  def _speculate(self) -> list[RequestOutput] | None:
    """One speculative round over every running request, settled at once; None when the pool
    cannot hold k + 1 tokens per row, or the round raised without taking the pools (a mixed step
    then runs and finds the failing rows)."""
    k = self.config.num_speculative_tokens
    rows = list(self.running)
    copies = self._reserve(rows, k + 1)
    if copies is None:
      return None
    self._copy(copies)
    B = self._bucket(len(rows))
    tokens = np.zeros((B,), np.int32)
    lengths = np.full((B,), -1, np.int32)
    seeds = np.zeros((B,), np.int32)
    first_step = np.zeros((B,), np.int32)
    for b, req in enumerate(rows):
      tokens[b] = req.tokens[req.n_computed]
      lengths[b] = req.n_computed
      seeds[b] = req.params.seed
      first_step[b] = len(req.output)
    start = [r.n_computed for r in rows]
    self.n_steps += 1
    self.n_computed_tokens += (k + 1) * len(rows)
    allowed = self._allowed_bits([(r, 1) for r in rows], B)
    arrays = SamplingArrays.from_params([r.params for r in rows], pad_to=B, allowed_bits=allowed)
    table = self._block_table([r.id for r in rows], B)
    round_rows = steps.RoundRows(tokens, lengths, table, seeds, first_step, arrays)
    progs = self.programs
    try:
      if allowed is None:
        self.pools, *outs, accepted_B = progs.speculative_round(
          self.states, self.pools, round_rows, k
        )
      else:  # guided rows: the target's masks at each draft follow the drafts before it
        self.pools, draft_BJ, q_BJV = progs.speculative_draft(
          self.states, self.pools, round_rows, k
        )
        masks = self._draft_masks(rows, np.asarray(draft_BJ), B)
        self.pools, *outs, accepted_B = progs.speculative_verify(
          self.states, self.pools, round_rows, draft_BJ, q_BJV, masks
        )
      accepted_B = np.asarray(accepted_B)[: len(rows)]
    except Exception as e:
      if _pool_lost(self.pools):
        raise _PoolLost(rows, e) from e
      for r in rows:
        self.allocator.truncate(r.id, r.n_computed)
      return None
    self.n_spec_rounds += 1
    self.n_spec_row_rounds += len(rows)
    self.n_drafted += k * len(rows)
    self.n_accepted += int(accepted_B.sum())
    outputs = self._collect(
      _Burst(rows, start, first_step, None, *outs, counts=None, n_draws=accepted_B + 1)
    )
    self.n_spec_emitted += sum(len(out.new_token_ids) for out in outputs)
    return outputs

  def _collect(self, burst: _Burst) -> list[RequestOutput]:
    """Reads a burst's draws, cuts each row at its first stop, and settles the blocks."""
    try:
      tok, lp, top_ids, top_lp = map(np.asarray, (burst.tok, burst.lp, burst.top_ids, burst.top_lp))
    except Exception as e:  # the burst failed on the device, which had taken the pool
      self._inflight = None  # a chained burst read this one's draws: it failed too
      raise _PoolLost(burst.rows, e) from e
    chained = set() if self._inflight is None else {id(r) for r in self._inflight.rows}
    outputs = []
    for b, req in enumerate(burst.rows):
      if req.id not in self._requests:
        continue  # aborted while the burst ran
      start = burst.start[b]
      n = len(tok) if burst.n_draws is None else int(burst.n_draws[b])
      try:
        out, n_kept = self._accept(
          req, tok[:n, b], lp[:n, b], top_ids[:n, b], top_lp[:n, b], release=False
        )
      except Exception as e:  # e.g. the detokenizer: this request's fault only
        outputs.append(self._finish(req, "error", f"{type(e).__name__}: {e}"))
        continue
      outputs.append(out)
      # The pool holds the pending token and every kept draw but the last: register those (a
      # finished request's full blocks then enter the prefix cache). A row that runs on in the
      # next burst keeps its reservation; any other gives back what it did not use.
      self.allocator.append(req.id, req.tokens[start : start + n_kept])
      req.n_computed = start + n_kept
      if out.finished:
        self._release(req)
      elif id(req) not in chained:
        self.allocator.truncate(req.id, req.n_computed)
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

  def _fork_followers(self, leader: _Request) -> None:
    """Starts the leader's sibling completions on its blocks, now that its prompt is computed.

    Each forks the leader's sequence and drops the last prompt token, which it recomputes to
    draw its own first token; a shared partial last block is copied at the start of the next
    step. Siblings that do not fit the batch or the pool wait and are admitted normally (their
    prompt's full blocks then come from the prefix cache).
    """
    late = []
    for f in self._followers.pop(leader.id):
      if len(self.running) >= self.config.max_num_seqs:
        late.append(f)
        continue
      self.allocator.fork(leader.id, f.id)
      try:
        self._pending_copies += self.allocator.truncate(f.id, len(f.prompt) - 1)
      except OutOfBlocksError:
        self.allocator.free(f.id)
        late.append(f)
        continue
      f.n_computed = len(f.prompt) - 1
      self.running.append(f)
    self.waiting.extendleft(reversed(late))
    self.running.sort(key=lambda r: r.arrival)

  def _schedule(self) -> tuple[list[tuple[_Request, int]], list[tuple[int, int]]]:
    """(rows to run as (request, tokens to compute), copy-on-write block pairs to copy first)."""
    cfg = self.config
    budget = cfg.max_num_batched_tokens
    scheduled: list[tuple[_Request, int]] = []
    copies: list[tuple[int, int]] = []
    preempted = False
    i = 0
    while i < len(self.running) and budget > 0:
      req = self.running[i]
      n = min(req.n_pending, cfg.prefill_chunk, budget)
      start = req.n_computed
      while True:
        try:
          copies += self.allocator.append(req.id, req.tokens[start : start + n])
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
    return scheduled, copies

  def _bucket(self, n_rows: int) -> int:
    """The padded row count of a step of `n_rows` rows."""
    return _pow2(n_rows, self.config.min_batch_bucket)

  def _block_table(self, ids: list[RequestId], B: int) -> np.ndarray:
    """i32[B, M]: the rows' blocks (reserved ones included), M the longest row's block count
    rounded up to a power of two, so attention work follows the real lengths."""
    table, _ = self.allocator.block_table(ids, self.max_blocks)
    M = max(1, max(len(self.allocator.blocks(i)) for i in ids))
    M = min(_pow2(M, self._min_blocks), self.max_blocks)
    out = np.zeros((B, M), np.int32)
    out[: len(ids)] = table[:, :M]
    return out

  def _penalty_arrays(self, rows: list[_Request], B: int) -> tuple[np.ndarray, np.ndarray]:
    """(i32[B, V] output token counts, bool[B, V] prompt tokens) for the penalties."""
    V = self.model_config.vocab_size
    counts = np.zeros((B, V), np.int32)
    prompt_mask = np.zeros((B, V), bool)
    for b, req in enumerate(rows):
      np.add.at(counts[b], np.asarray(req.output, np.int64), 1)
      prompt_mask[b, req.prompt] = True
    return counts, prompt_mask

  def _allowed_bits(self, rows: list[tuple[_Request, int]], B: int) -> np.ndarray | None:
    """i32[B, W] packed allowed tokens: guided rows' from their matchers, without the stop ids
    for rows in their min_tokens, all set for the others; None when no row needs a mask."""
    if all(req.matcher is None and not req.suppressing_stops for req, _ in rows):
      return None
    V = self.model_config.vocab_size
    bits = np.full((B, -(-V // 32)), -1, np.int32)
    for b, (req, _) in enumerate(rows):
      if req.matcher is not None:
        bits[b] = req.matcher.allowed_bits()
      if req.suppressing_stops:
        words = bits[b].view(np.uint32)
        for t in req.stop_ids:
          if t < V:
            words[t >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (t & 31)))
    return bits

  def _draft_masks(self, rows: list[_Request], drafts_BJ: np.ndarray, B: int) -> np.ndarray:
    """i32[B, k+1, W]: a guided row's allowed tokens at its pending token and after each of its
    drafts, from its matcher advanced along the drafts and rolled back; all set for the other
    rows, and past a draft the grammar refuses (the target rejects it there, so the positions
    after it are never read)."""
    k = drafts_BJ.shape[1]
    masks = np.full((B, k + 1, -(-self.model_config.vocab_size // 32)), -1, np.int32)
    for b, req in enumerate(rows):
      m = req.matcher
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

  def _run(self, rows: list[tuple[_Request, int]], T: int | None) -> dict:
    """One jitted call over `rows`; returns {id: (token, logprob, top ids, top logprobs)}."""
    B = self._bucket(len(rows))
    if T is None:
      T = min(_pow2(max(n for _, n in rows), 16), self.config.prefill_chunk)
    tokens = np.zeros((B, T), np.int32)
    positions = np.full((B, T), -1, np.int32)
    lengths = np.zeros((B,), np.int32)
    last = np.zeros((B,), np.int32)
    seeds = np.zeros((B,), np.int32)
    step_index = np.zeros((B,), np.int32)
    for b, (req, n) in enumerate(rows):
      start = req.n_computed
      tokens[b, :n] = req.tokens[start : start + n]
      positions[b, :n] = np.arange(start, start + n)
      lengths[b] = start
      last[b] = n - 1
      seeds[b] = req.params.seed
      step_index[b] = len(req.output)
    params = [r.params for r, _ in rows]
    penalties = any(p.uses_penalties for p in params)
    counts, prompt_mask = (
      self._penalty_arrays([r for r, _ in rows], B) if penalties else (None, None)
    )
    self.pools, tok, lp, top_ids, top_lp = self.programs.forward_sample(
      self.states,
      self.pools,
      tokens,
      positions,
      self._block_table([r.id for r, _ in rows], B),
      lengths,
      last,
      seeds,
      step_index,
      SamplingArrays.from_params(params, pad_to=B, allowed_bits=self._allowed_bits(rows, B)),
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
        if _pool_lost(self.pools):
          raise _PoolLost([r for r, _ in group], e) from e  # nothing left to re-run on
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
    """A call failed after the device took the donated pool: every running request's K/V are
    gone. A fresh pool and allocator, every running request recomputes (its outputs so far are
    kept, and its sampling keys make the recomputation draw the same tokens); the rows of the
    failed call fail if there was one, else run alone from now on until the culprit is found.
    """
    outputs = []
    if len(lost.rows) == 1 and lost.rows[0].id in self._requests:
      outputs.append(self._finish(lost.rows[0], "error", _step_error(lost.error)))
    for req in lost.rows:
      req.suspect = True
    self._inflight = None
    self._pending_copies = []
    self.pools = jax.tree.map(
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

  def _accept(self, req: _Request, tokens, logprobs, top_ids, top_logprobs, *, release=True):
    """Appends drawn tokens to a request's output up to its first stop.

    Returns:
      (the RequestOutput, how many of `tokens` were kept). A finished request is released
      unless `release` is False (the caller then releases it).
    """
    n_top = req.params.logprobs or 0
    kept, kept_lp, kept_top = [], [], []
    reason = None
    first = not req.output
    for token, logprob, ids, lps in zip(tokens, logprobs, top_ids, top_logprobs):
      token = int(token)
      req.output.append(token)
      kept.append(token)
      kept_lp.append(float(logprob))
      if req.params.logprobs is not None:
        kept_top.append([(int(t), float(p)) for t, p in zip(ids[:n_top], lps[:n_top])])
      stop_token = token in req.stop_ids
      if stop_token:
        reason = "stop"
      elif req.matcher is not None and self._guide(req.matcher, token):
        reason = "stop"  # the output is whole and only eos could follow
      elif len(req.output) >= req.params.max_new_tokens:
        reason = "length"
      if req.detok is not None:
        if stop_token and not req.params.include_stop_str_in_output:
          req.detok.flush()  # as vLLM, the text leaves out the token it stopped on
        elif self._text(req, token, final=reason is not None):
          reason = "stop"  # a stop string
      if reason is not None:
        break
    text = "" if req.detok is None else self._emit(req, reason)
    out = RequestOutput(
      req.id, kept, kept_lp, kept_top, text, finished=reason is not None, finish_reason=reason
    )
    if first:
      req.t_first = time.perf_counter()
      if req.params.prompt_logprobs is not None:
        out.prompt_logprobs, out.prompt_top_logprobs = self._prompt_logprobs(req)
    if reason is not None and release:
      self._release(req)
    return out, len(kept)

  def _prompt_logprobs(self, req: _Request):
    """(per prompt token its logprob, per prompt token its top `prompt_logprobs` pairs), None
    for the first token, from one pass of the model over the whole prompt."""
    n = len(req.prompt)
    T = max(n, min(_pow2(n, 16), self.max_model_len))
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :n] = req.prompt
    lp, top_ids, top_lp = map(
      np.asarray, self.programs.prompt_logprobs(self.states[0], tokens)
    )  # right padding: causal attention keeps it out of the real positions
    k = req.params.prompt_logprobs
    lps: list[float | None] = [None] + [float(lp[t]) for t in range(n - 1)]
    tops: list[list[tuple[int, float]] | None] = [None] + [
      [(int(i), float(v)) for i, v in zip(top_ids[t, :k], top_lp[t, :k])] for t in range(n - 1)
    ]
    return lps, tops

  @staticmethod
  def _guide(matcher: GuidedMatcher, token: int) -> bool:
    """Advances a guided request's matcher; True when its output is complete."""
    matcher.advance(token)
    return matcher.is_complete

  def _text(self, req: _Request, token: int, *, final: bool) -> bool:
    """Detokenises one more token; True when a stop string now appears in the text."""
    req.detok.push(token)
    if final:
      req.detok.flush()
    if len(req.output) <= req.params.min_tokens:
      return False  # as vLLM: no stop string within the first min_tokens tokens
    full = req.detok.text
    for s in req.params.stop:
      at = full.find(s, max(0, req.n_text_sent - len(s) + 1))
      if at >= 0 and (req.stop_at is None or at < req.stop_at):
        req.stop_at, req.stop_end = at, at + len(s)
    return req.stop_at is not None

  def _emit(self, req: _Request, reason: str | None) -> str:
    """The text a request may send now: up to a stop string, or holding back what could still
    become one."""
    full = req.detok.text
    if req.stop_at is not None:
      end = req.stop_end if req.params.include_stop_str_in_output else req.stop_at
    elif reason is None:
      end = len(full) - max((len(s) - 1 for s in req.params.stop), default=0)
    else:
      end = len(full)
    end = max(end, req.n_text_sent)
    text = full[req.n_text_sent : end]
    req.n_text_sent = end
    return text

  def _release(self, req: _Request) -> None:
    if req.id in self._requests:
      self._finished.append(req)
    if req.id in self.allocator:
      self.allocator.free(req.id)
    if req in self.running:
      self.running.remove(req)
    if req in self.waiting:
      self.waiting.remove(req)
    # A leader that ends before its prompt is computed lets its siblings compute it themselves.
    self.waiting.extendleft(reversed(self._followers.pop(req.id, [])))
    for followers in self._followers.values():
      if req in followers:
        followers.remove(req)
    self._requests.pop(req.id, None)

  def _finish(self, req: _Request, reason: str, error: str | None = None) -> RequestOutput:
    self._release(req)
    return RequestOutput(req.id, [], [], [], "", finished=True, finish_reason=reason, error=error)


def _log_finished(req: _Request, reason: str | None) -> None:
  now = time.perf_counter()
  ttft = "-" if req.t_first is None else f"{req.t_first - req.t_arrival:.3f} s"
  log.info(
    "request %s: %s, %d prompt + %d output tokens, first token %s, total %.3f s",
    req.id,
    reason,
    len(req.prompt),
    len(req.output),
    ttft,
    now - req.t_arrival,
  )


__all__ = ["Engine", "EngineConfig", "RequestError", "RequestOutput"]
