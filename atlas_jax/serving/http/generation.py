"""What the two generating endpoints share: a request's checks, its submission as n choices per
prompt, and its response, whole (JSON) or streamed (server-sent events).

`respond` serves both; a `ChoiceFormat` (completions.py's, chat_completions.py's) says what
differs: the ids and object names, and the shape of a choice, a streamed delta and a logprobs
object.

Guided decoding: both endpoints take OpenAI's `response_format` (`json_object`, `json_schema`),
vLLM's `guided_json`, `guided_regex`, `guided_choice` and its newer `structured_outputs`
(`{"json" | "regex" | "choice" | "json_object": ...}`); a chat's forced tool call brings its own.
The constraint is compiled off the event loop (in a worker thread, itself bounded by the
compiler's time limit) and a bad one (invalid regex, unsupported or unsatisfiable schema, empty
choices) is a 400 naming the field.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator, Callable

from fastapi.responses import JSONResponse

from atlas_jax.decoding.guided import Grammar, GuidedDecodingError, GuidedSpec, ReasoningGate
from atlas_jax.decoding.guided import spec_from_request as guided_spec
from atlas_jax.serving import reasoning
from atlas_jax.serving.engine import RequestError, RequestOutput
from atlas_jax.serving.http.protocol import (
  APIError,
  RequestFields,
  Response,
  Usage,
  request_params,
)
from atlas_jax.serving.http.state import ServerState
from atlas_jax.serving.http.streaming import DONE, event_stream, merged, one_per_token, sse
from atlas_jax.serving.reasoning import ReasoningParser

# (prompt ids, prompt text): a prompt as the handlers pass it (the text is what `echo` repeats).
Prompt = tuple[list[int], str]


@dataclasses.dataclass
class Choice:
  """One choice of a response as it is assembled: its prompt, its text, the next token's
  `text_offset`."""

  prompt_ids: list[int]
  prompt_text: str
  text: str = ""
  started: bool = False  # an output has arrived (the first carries the echo)
  offset: int = 0
  n_out: int = 0
  finish_reason: str | None = None
  stop_reason: int | str | None = None  # the stop string or stop token id that ended it
  logprobs: list[dict] = dataclasses.field(default_factory=list)  # one object per output


def merge_logprobs(parts: list[dict]) -> dict:
  """Logprobs objects of consecutive pieces as one (their lists concatenated)."""
  if not parts:
    return {}
  return {k: [x for p in parts for x in p[k]] for k in parts[0]}


class ChoiceFormat(abc.ABC):
  """What differs between /v1/completions and /v1/chat/completions."""

  object: str  # a whole response's "object"
  chunk_object: str  # a streamed event's
  id_prefix: str  # of the response's id
  prompt_field: str  # the request field that errors about the prompt name

  def __init__(self, token_text: Callable[[int], str]):
    self.token_text = token_text  # a token id's text

  def stream_start(self, n_choices: int) -> list[dict]:
    """The choices of the events a stream opens with, one event each (default: none)."""
    return []

  @abc.abstractmethod
  def logprobs(self, choice: Choice, out: RequestOutput, with_prompt: bool) -> dict:
    """The logprobs object of `out`'s tokens (`with_prompt`: the prompt's before them)."""

  @abc.abstractmethod
  def chunk_choice(
    self, index: int, text: str, logprobs: dict | None, reason, stop_reason=None
  ) -> dict | None:
    """A streamed event's choice: `text` added, and the finish (and stop) reason on the last;
    None when there is nothing to send yet."""

  @abc.abstractmethod
  def final_choice(self, index: int, choice: Choice, logprobs: dict | None) -> dict:
    """A whole response's choice."""


def requested_spec(body: RequestFields) -> GuidedSpec | None:
  """The constraint a request's own fields ask for (OpenAI's, vLLM's guided_* and
  structured_outputs), or None; GuidedDecodingError when they are bad."""
  return guided_spec(
    response_format=body.response_format,
    guided_json=body.guided_json,
    guided_regex=body.guided_regex,
    guided_choice=body.guided_choice,
    structured_outputs=body.structured_outputs,
  )


async def grammar_of(
  state: ServerState, body: RequestFields, forced: GuidedSpec | None = None
) -> Grammar | None:
  """The request's compiled constraint (its fields', or `forced`: a tool call's), or None; a 400
  naming the field when it is bad."""
  try:
    spec = requested_spec(body)
    if spec is not None and forced is not None:
      raise APIError(400, f"{spec.field} cannot be combined with a forced tool_choice", spec.field)
    spec = spec or forced
    if spec is None:
      return None
    if state.guided is None:
      raise APIError(400, "guided decoding is not enabled on this server", spec.field)
    return await asyncio.to_thread(state.guided.compile, spec)
  except GuidedDecodingError as e:
    raise APIError(400, str(e), e.field) from None


def max_tokens_of(state: ServerState, body: RequestFields, n_prompt: int, where: str) -> int:
  """The request's max_tokens (default: the server's, or what the context leaves), checked
  against the limits with the prompt's length."""
  if n_prompt == 0:
    raise APIError(400, f"the prompt is empty: '{where}' must not be empty", where)
  if n_prompt > state.max_prompt_tokens:
    raise APIError(
      400, f"the prompt has {n_prompt} tokens; the limit is {state.max_prompt_tokens}", where
    )
  max_tokens = body.max_completion_tokens or body.max_tokens
  if max_tokens is None:
    return max(
      1, min(state.defaults.max_new_tokens, state.max_tokens_limit, state.context - n_prompt)
    )
  if max_tokens > state.max_tokens_limit:
    raise APIError(
      400, f"max_tokens={max_tokens} exceeds the limit {state.max_tokens_limit}", "max_tokens"
    )
  return max_tokens


def submit(
  state: ServerState,
  body: RequestFields,
  prompts: list[Prompt],
  *,
  logprobs: int | None,
  prompt_logprobs: int | None,
  grammar: Grammar | ReasoningGate | None,
  where: str,
) -> list[tuple[str, asyncio.Queue]]:
  """Queues n choices per prompt (all or none); [(request id, queue)] in choice order."""
  if body.n > state.limits.max_n:
    raise APIError(400, f"n={body.n} exceeds the limit {state.limits.max_n}", "n")
  seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
  groups = []
  try:
    for ids, _ in prompts:
      max_tokens = max_tokens_of(state, body, len(ids), where)
      params = [
        request_params(
          body,
          state.defaults,
          max_tokens=max_tokens,
          seed=(seed + i) % 2**31,  # n choices differ, and each is reproducible
          logprobs=logprobs,
          prompt_logprobs=prompt_logprobs,
          guided=grammar,
        )
        for i in range(body.n)
      ]
      groups.append((ids, params))
    # Each prompt's n choices share its computation and blocks.
    adapter = state.adapter_of(body.model)
    return state.runner.submit_all(groups, stream=body.stream, adapter=adapter)
  except ValueError as e:
    field = getattr(e, "field", None) or (where if isinstance(e, RequestError) else None)
    raise APIError(400, str(e), field) from None


def error_of(out: RequestOutput) -> str | None:
  """The error that ended a request, or None."""
  return out.error or (
    f"request ended: {out.finish_reason}" if out.finish_reason == "error" else None
  )


@dataclasses.dataclass
class Generation:
  """A request's choices (n per prompt, in order) as they are served."""

  fmt: ChoiceFormat
  subs: list[tuple[str, asyncio.Queue]]  # (engine request id, its outputs) per choice
  choices: list[Choice]
  id: str  # the response's
  model: str  # the name the response reports
  stream: bool
  logprobs: int | None  # top logprobs per token, or None for none
  echo: bool  # the prompt's text (and logprobs) before each choice's
  n_prompt_tokens: int

  def envelope(self, choices: list[dict], **extra) -> Response:
    kind = self.fmt.chunk_object if self.stream else self.fmt.object
    head = {"id": self.id, "object": kind, "created": int(time.time()), "model": self.model}
    return {**head, "choices": choices, **extra}

  def usage(self) -> Usage:
    n_out = sum(c.n_out for c in self.choices)
    return {
      "prompt_tokens": self.n_prompt_tokens,
      "completion_tokens": n_out,
      "total_tokens": self.n_prompt_tokens + n_out,
    }

  def piece(self, i: int, out: RequestOutput) -> tuple[str, dict | None]:
    """(text, logprobs or None) that `out` adds to choice `i`; the first carries the echo."""
    choice = self.choices[i]
    first, choice.started = not choice.started, True
    text, lp = out.text, None
    if self.logprobs is not None:
      lp = self.fmt.logprobs(choice, out, with_prompt=first and self.echo)
    if first and self.echo:
      text = choice.prompt_text + text
    choice.text += text
    choice.n_out += len(out.new_token_ids)
    return text, lp


async def respond(
  state: ServerState,
  body: RequestFields,
  prompts: list[Prompt],
  fmt: ChoiceFormat,
  *,
  logprobs: int | None,
  echo: bool = False,
  forced: GuidedSpec | None = None,
  after_reasoning: ReasoningParser | None = None,
):
  """Serves n choices for each prompt: a JSON response, or an SSE stream if `body.stream`
  (`forced`: the constraint of a forced tool call; `after_reasoning`: the constraint waits for
  this parser's end of thinking)."""
  if logprobs is not None and logprobs > state.limits.max_logprobs:
    field = "logprobs" if echo or fmt.prompt_field == "prompt" else "top_logprobs"
    raise APIError(
      400,
      f"{field}={logprobs} is not allowed: must be <= {state.limits.max_logprobs} "
      "(the server's --max-logprobs)",
      field,
    )
  grammar = await grammar_of(state, body, forced)
  if grammar is not None and after_reasoning is not None:
    grammar = reasoning.gate(grammar, after_reasoning, state.tokenizer) or grammar
  subs = submit(
    state,
    body,
    prompts,
    logprobs=logprobs,
    prompt_logprobs=logprobs if echo else None,
    grammar=grammar,
    where=fmt.prompt_field,
  )
  gen = Generation(
    fmt=fmt,
    subs=subs,
    choices=[Choice(ids, text) for ids, text in prompts for _ in range(body.n)],
    id=fmt.id_prefix + subs[0][0],  # the first choice's, as logged
    model=body.model or state.names[0],
    stream=body.stream,
    logprobs=logprobs,
    echo=echo,
    n_prompt_tokens=sum(len(ids) for ids, _ in prompts),
  )
  if body.stream:
    usage = bool(body.stream_options and body.stream_options.get("include_usage"))
    return event_stream(stream_events(state, gen, include_usage=usage))
  return await whole_response(state, gen)


async def stream_events(
  state: ServerState, gen: Generation, *, include_usage: bool
) -> AsyncIterator[str]:
  """A streamed response's events: one per token and choice, as the tokens come.

  A token whose text is held back (half a UTF-8 character, or what could still become a stop
  string) sends no event of its own unless logprobs are asked for. A request the engine fails
  sends an error event, and the stream goes on with the other choices.
  """
  for choice in gen.fmt.stream_start(len(gen.choices)):
    yield sse(gen.envelope([choice]))
  async for i, whole in merged(state.runner, gen.subs):
    if error_of(whole):
      yield sse({"error": {"message": error_of(whole), "type": "server_error"}})
      continue
    for out in one_per_token(whole):
      text, lp = gen.piece(i, out)
      if not text and not out.finished and not (lp and out.new_token_ids):
        continue  # a token whose text is held back (half a character, a possible stop)
      reason = out.finish_reason if out.finished else None
      choice = gen.fmt.chunk_choice(i, text, lp, reason, out.stop_reason if out.finished else None)
      if choice is not None:
        yield sse(gen.envelope([choice]))
  if include_usage:
    yield sse(gen.envelope([], usage=gen.usage()))
  yield DONE


async def whole_response(state: ServerState, gen: Generation) -> JSONResponse:
  """The response once every choice has finished; a 500 if the engine failed one."""
  async for i, out in merged(state.runner, gen.subs):
    if error_of(out):
      raise APIError(500, error_of(out))
    _, lp = gen.piece(i, out)
    if lp is not None:
      gen.choices[i].logprobs.append(lp)
    if out.finished:
      gen.choices[i].finish_reason = out.finish_reason
      gen.choices[i].stop_reason = out.stop_reason
  choices = [
    gen.fmt.final_choice(i, c, None if gen.logprobs is None else merge_logprobs(c.logprobs))
    for i, c in enumerate(gen.choices)
  ]
  return JSONResponse(gen.envelope(choices, usage=gen.usage()))
