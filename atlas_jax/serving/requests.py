"""Requests: what the engine holds per request, what it reports back, and the checks at intake.

Every request is a token list (prompt, then output) and a count of tokens whose entries are
already in the pool (`n_computed`). Everything the jitted steps will hold is checked when a
request is made (SamplingParams checks its own fields against i32/f32), so an admitted request
cannot make a batched step fail, and a request that cannot fit the pool (or the context) on its
own is refused here, so the oldest request can always make progress by preempting newer ones.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import time
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from atlas_jax.decoding.guided import GuidedMatcher
from atlas_jax.decoding.sampling import SamplingParams
from atlas_jax.serving.detokenize import IncrementalDetokenizer

RequestId = Hashable


class RequestError(ValueError):
  """A request the engine cannot serve (too long for the context or the pool, bad token ids).
  `field` names the request field at fault, where one is (e.g. "logit_bias")."""

  def __init__(self, message: str, field: str | None = None):
    super().__init__(message)
    self.field = field


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
  # What stopped it (vLLM's stop_reason): the stop string, or a stop_token_ids id; None for eos,
  # a complete guided output, or any other finish.
  stop_reason: int | str | None = None
  # Per new token, the text it let out (joined: `text`), as if each had been drawn in its own
  # step: a streamed burst leaves one event per token.
  new_texts: list[str] = dataclasses.field(default_factory=list)
  # With `params.prompt_logprobs`, on the request's first output: per prompt token, its logprob
  # and the top `prompt_logprobs` (token, logprob) pairs; None for the first token.
  prompt_logprobs: list[float | None] | None = None
  prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclasses.dataclass(eq=False)
class Request:
  """One request's state, shared by the scheduler (where it runs) and the output processor
  (what it has produced). Compared by identity."""

  id: RequestId
  prompt: list[int]
  params: SamplingParams
  arrival: int
  stop_ids: frozenset[int]
  output: list[int] = dataclasses.field(default_factory=list)
  n_computed: int = 0  # tokens of prompt + output whose entries are in the pool
  replica: int = 0  # the data-parallel replica whose pages hold them
  detok: IncrementalDetokenizer | None = None  # the output's text (only with a detokenizer)
  n_text_sent: int = 0
  stop_at: int | None = None  # where the first stop string starts in the text
  stop_end: int | None = None  # and where it ends
  stop_str: str | None = None  # which stop string that is
  n_preemptions: int = 0
  suspect: bool = False  # in a failed call that lost the pool: runs alone from then on
  matcher: GuidedMatcher | None = None  # guided requests: where the output is in the grammar
  stream: bool = False  # its tokens leave as they are drawn: no bursts while it runs
  t_arrival: float = 0.0  # time.perf_counter() when added
  t_first: float | None = None  # when its first token was drawn
  adapter: int = 0  # its LoRA adapter's slot (`atlas_jax.serving.lora`); 0: the base model
  # What its K/V depend on beside its tokens (its adapter's identity, `Adapter.cache_salt`): it
  # shares prefix-cache blocks only with requests of an equal salt.
  cache_salt: bytes = b""

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


@dataclasses.dataclass(frozen=True)
class Intake:
  """Makes validated requests for one engine (its model's vocabulary, context and pool)."""

  vocab_size: int  # V
  max_model_len: int
  n_blocks: int  # blocks of one replica's pool: the most one request may hold
  block_size: int  # Z
  eos_ids: frozenset[int]
  detokenize: Callable[..., str] | None = None
  # The most blocks a request holds at once when a sliding window bounds them (every layer's
  # window: `Scheduler.forget_outside_window`), however long it grows; None: all of its blocks.
  window_blocks: int | None = None
  # The windowed layers' own pool, per replica, for a model mixing windowed and full-attention
  # layers (`HybridAllocator`): `window_blocks` then bounds what a request holds there, and
  # `n_blocks` (the full-attention layers' pool) must hold all of its blocks.
  n_window_blocks: int | None = None

  def make(
    self, request_id: RequestId, prompt: Sequence[int], params: SamplingParams | None, arrival: int
  ) -> Request:
    """A validated request; nothing is queued.

    Raises:
      RequestError: empty prompt, token ids that are not integers in the vocabulary, prompt +
        max_new_tokens past the context, or more blocks than one replica's pool holds.
    """
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
      raise RequestError(f"params={params!r} is not allowed: must be a SamplingParams")
    V = self.vocab_size
    try:
      hash(request_id)
    except TypeError:
      raise RequestError(f"request id {request_id!r} is not allowed: must be hashable") from None
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
    Z = self.block_size
    need = -(-total // Z)
    pools = [(need, self.n_blocks, "the pool")]
    if self.window_blocks is not None:
      windowed = min(need, self.window_blocks)
      if self.n_window_blocks is None:
        pools = [(windowed, self.n_blocks, "the pool")]
      else:
        pools = [
          (need, self.n_blocks, "the full-attention layers' pool"),
          (windowed, self.n_window_blocks, "the windowed layers' pool"),
        ]
    for n, held, where in pools:
      if n > held:
        raise RequestError(
          f"prompt length {len(prompt)} + max_tokens {params.max_new_tokens} needs "
          f"{n} KV blocks of {Z} tokens; {where} holds {held}"
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
    req = Request(request_id, prompt, params, arrival, frozenset(stop))
    req.t_arrival = time.perf_counter()
    if params.guided is not None:
      req.matcher = params.guided.matcher(prompt)  # a ReasoningGate reads the prompt
    if self.detokenize is not None:
      decode = self.detokenize
      if not params.skip_special_tokens:
        decode = functools.partial(decode, skip_special_tokens=False)
      req.detok = IncrementalDetokenizer(decode)
    return req
