"""An OpenAI-compatible HTTP server over the engine (FastAPI on uvicorn).

The engine runs in one background thread that steps while there is work; request handlers on the
event loop submit requests (checked at once, a bad one a 400; queued in the engine's inbox without
waiting for the step in progress) and read their outputs from per-request asyncio queues, filled
from the engine thread with `call_soon_threadsafe`. A client that disconnects mid-stream aborts its
request, which frees its blocks.

Endpoints: POST /v1/completions, POST /v1/chat/completions (stream as server-sent events ending
in `data: [DONE]`), GET /v1/models, GET /v1/models/{id}, POST /tokenize, POST /detokenize (vLLM's
shapes), GET /health, GET /metrics (Prometheus).

Streaming sends one event per token, as vLLM does, each with its own text and logprobs. A
streamed request runs no decode bursts, so each token leaves as soon as the host has it;
`serve.engine.stream_bursts` keeps bursting (the tokens then arrive `decode_burst` at a time,
still one event each). A token whose text is held back (half a UTF-8 character, or what could
still become a stop string) sends no event of its own unless logprobs are asked for.

Requests are accepted as OpenAI and vLLM clients send them: fields the server does not use are
ignored, with one warning line in the log naming them, as vLLM does; the fields it uses are
checked (type and range), and a bad one is a 400 naming it. `model` must be one of the served
names (a 404 otherwise). A completion's `prompt` may be a string, a list of token ids, or a list
of either (one set of `n` choices per prompt, indexed in order); text prompts are encoded as the
tokenizer encodes by default (a Llama tokenizer adds its BOS; `add_special_tokens: false` does
not), chats as transformers encodes its rendered template (the template writes its own BOS).
Without `seed`, a request draws a fresh one; with it, the output is reproducible. vLLM's
`logit_bias`, `min_tokens`, `skip_special_tokens`, `include_stop_str_in_output` and OpenAI's
`echo` (with `logprobs`: each prompt token's logprob, the first null) are served.

Guided decoding: both completion endpoints take OpenAI's `response_format` (`json_object`,
`json_schema`) and vLLM's `guided_json`, `guided_regex`, `guided_choice`. The constraint is
compiled off the event loop (in a worker thread, itself bounded by the compiler's time limit) and
a bad one (invalid regex, unsupported or unsatisfiable schema, empty choices) is a 400 naming the
field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import (
  AfterValidator,
  BaseModel,
  ConfigDict,
  Field,
  StrictBool,
  StrictInt,
  ValidationError,
)
from starlette.exceptions import HTTPException

from atlas_jax.config import SamplingDefaults, ServerLimits
from atlas_jax.data.tokenizer import encode_prompt
from atlas_jax.decoding.guided import Grammar, GrammarCompiler, GuidedDecodingError
from atlas_jax.decoding.guided import spec_from_request as guided_spec
from atlas_jax.decoding.sampling import INT32_MAX, MAX_LOGPROBS, SamplingParams
from atlas_jax.serving.chat import ChatTemplate, ChatTemplateError, PlainChatTemplate
from atlas_jax.serving.engine import Engine, RequestError, RequestOutput
from atlas_jax.serving.metrics import ServingMetrics


def sampling_defaults(sampling: SamplingDefaults | None = None) -> SamplingParams:
  """The SamplingParams of `serve.sampling` (default: its defaults)."""
  s = SamplingDefaults() if sampling is None else sampling
  return SamplingParams(
    max_new_tokens=s.max_new_tokens,
    temperature=s.temperature,
    top_k=max(0, s.top_k),  # -1 is off, as in the API
    top_p=s.top_p,
    min_p=s.min_p,
    repetition_penalty=s.repetition_penalty,
    seed=s.seed,
  )


class APIError(Exception):
  def __init__(
    self, status: int, message: str, param: str | None = None, kind: str = "", code=None
  ):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code
    self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")


def _error_response(
  status: int, message: str, param=None, kind="invalid_request_error", headers=None, code=None
) -> JSONResponse:
  body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
  return JSONResponse(body, status_code=status, headers=headers)


log = logging.getLogger("atlas_jax.serving")


class _Guard:
  """The outermost layer of the app (raw ASGI): API key, body size, and unexpected errors.

  The body is read here, up to `max_body_bytes` whatever the transfer encoding (a chunked body
  has no Content-Length to check up front), and handed on whole; a larger one gets 413 without
  being read further, and the connection is closed, since the rest of it is still on the way.
  An exception no handler took becomes an OpenAI-shaped 500 (logged with its traceback), so the
  client's keep-alive connection survives it.
  """

  def __init__(self, app, *, api_key: str | None, max_body_bytes: int):
    self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    if self.api_key is not None and scope["path"].startswith("/v1/"):
      if headers.get("authorization", "") != f"Bearer {self.api_key}":
        response = _error_response(401, "invalid or missing API key", kind="authentication_error")
        return await response(scope, receive, send)
    too_large = _error_response(
      413, f"request body over {self.max_body_bytes} bytes", headers={"Connection": "close"}
    )
    size = headers.get("content-length", "")
    if size.isdigit() and int(size) > self.max_body_bytes:
      return await too_large(scope, receive, send)
    chunks, n = [], 0
    while True:
      message = await receive()
      if message["type"] == "http.disconnect":
        return
      chunks.append(message.get("body", b""))
      n += len(chunks[-1])
      if n > self.max_body_bytes:
        return await too_large(scope, receive, send)
      if not message.get("more_body", False):
        break
    body, replayed = b"".join(chunks), False

    async def replay():
      nonlocal replayed
      if not replayed:
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}
      return await receive()  # then the disconnect, which streaming responses listen for

    started = False

    async def watch(message):
      nonlocal started
      started = started or message["type"] == "http.response.start"
      await send(message)

    try:
      await self.app(scope, replay, watch)
    except Exception:
      if started:
        raise  # mid-response: nothing better than closing the connection
      log.exception("unhandled error serving %s %s", scope["method"], scope["path"])
      await _error_response(500, "internal server error", kind="server_error")(scope, replay, send)


# -- the engine thread --------------------------------------------------------------------------


@dataclasses.dataclass
class _Stream:
  queue: asyncio.Queue
  loop: asyncio.AbstractEventLoop
  arrival: float
  n_prompt: int
  first: float | None = None
  last: float | None = None
  n_out: int = 0


class EngineRunner:
  """Drives an Engine from a background thread for asyncio callers.

  The engine thread alone steps the engine, holding no lock the event loop waits on: a
  submission is checked in the caller's thread and put in the engine's inbox
  (`Engine.enqueue`), which the engine thread drains at the start of its next step, so an
  arrival returns to the event loop at once even while a long step runs. Gauges other than the
  request counts are a snapshot the engine thread takes after each step.
  """

  def __init__(self, engine: Engine, metrics: ServingMetrics | None = None):
    self.engine = engine
    self.metrics = metrics or ServingMetrics()
    self._wake = threading.Event()
    self._streams: dict[str, _Stream] = {}
    self._streams_lock = threading.Lock()  # held for dict updates only, never across a step
    self._stop = False
    self.error: BaseException | None = None
    self._gauges = self._read_gauges()
    self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
    self._thread.start()

  def submit(
    self, prompt: list[int], params: SamplingParams, *, stream: bool = False
  ) -> tuple[str, asyncio.Queue]:
    """Queues a request; its RequestOutputs arrive on the returned queue (None ends it)."""
    return self.submit_all([(prompt, [params])], stream=stream)[0]

  def submit_all(
    self, groups: Sequence[tuple[list[int], Sequence[SamplingParams]]], *, stream: bool = False
  ) -> list[tuple[str, asyncio.Queue]]:
    """Queues each (prompt, n params) group: n completions of the prompt, computed once and
    sharing its blocks. All groups or none: a RequestError for any leaves nothing queued.
    `stream`: the client reads each token as it is drawn (`Engine.add_request`). Never waits
    for the step in progress."""
    loop = asyncio.get_running_loop()
    now = time.perf_counter()
    subs: list[tuple[str, asyncio.Queue]] = []
    streams: dict[str, _Stream] = {}
    batch = []
    for prompt, params in groups:
      rids = [uuid.uuid4().hex for _ in params]
      batch.append((rids, prompt, params))
      for rid in rids:
        streams[rid] = _Stream(asyncio.Queue(), loop, now, len(prompt))
        subs.append((rid, streams[rid].queue))
    # Registered first: once enqueued, the engine thread may step them before this returns.
    with self._streams_lock:
      self._streams.update(streams)
    try:
      self.engine.enqueue(batch, stream=stream)
    except RequestError:
      with self._streams_lock:
        for rid in streams:
          self._streams.pop(rid, None)
      raise
    self._wake.set()
    return subs

  def abort(self, rid: str) -> None:
    self.engine.abort(rid)
    self._wake.set()

  def shutdown(self) -> None:
    self._stop = True
    self._wake.set()
    self._thread.join(timeout=10)

  def gauges(self) -> dict[str, Any]:
    """The engine's gauges: the request counts now, the rest as the last step left them."""
    return {**self._gauges, "running": self.engine.n_running, "waiting": self.engine.n_waiting}

  def _read_gauges(self) -> dict[str, Any]:
    s = self.engine.kv_stats()
    return dict(
      running=self.engine.n_running,
      waiting=self.engine.n_waiting,
      kv_usage=self.engine.kv_usage(),
      preemptions=self.engine.n_preemptions,
      prefix_queries=s.prefix_query_tokens,
      prefix_hits=s.prefix_hit_tokens,
      drafted=self.engine.n_drafted,
      accepted=self.engine.n_accepted,
      acceptance_length=self.engine.mean_acceptance_length,
    )

  def _loop(self) -> None:
    while not self._stop:
      if not self.engine.has_unfinished():
        self._wake.wait(0.05)
        self._wake.clear()
        continue
      try:
        outputs = self.engine.step()
      except BaseException as e:  # keep serving: fail the in-flight requests, not the server
        self.error = e
        with self._streams_lock:
          rids = list(self._streams)
        for rid in rids:
          self.engine.abort(rid)
        outputs = self.engine.step()
        for out in outputs:
          out.error = f"engine error: {e}"
      self._gauges = self._read_gauges()
      now = time.perf_counter()
      for out in outputs:
        with self._streams_lock:
          stream = self._streams.get(out.request_id)
          if stream is not None and out.finished:
            del self._streams[out.request_id]
        if stream is None:
          continue
        if out.new_token_ids:
          if stream.first is None:
            stream.first = now
            self.metrics.ttft.observe(now - stream.arrival)
          else:
            self.metrics.itl.observe(now - stream.last)
          stream.last = now
          stream.n_out += len(out.new_token_ids)
        if out.finished:
          self.metrics.e2e.observe(now - stream.arrival)
          self.metrics.finished(out.finish_reason or "stop", stream.n_prompt, stream.n_out)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)


# -- request bodies -----------------------------------------------------------------------------

PositiveInt = Annotated[StrictInt, Field(ge=1)]
TokenId = Annotated[StrictInt, Field(ge=0)]


def encodable(text: str) -> str:
  """`text`, or a ValueError when UTF-8 cannot encode it (a lone surrogate: JSON may escape one,
  and a command line's undecodable bytes arrive as such)."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ValueError(
      f"the text cannot be encoded as UTF-8 (character {e.start} is a lone surrogate "
      f"{text[e.start]!r})"
    ) from None
  return text


# Every string a request carries.
Text = Annotated[str, AfterValidator(encodable)]
# Fields the server does not use are kept aside (and named in one warning line), as vLLM does.
_LENIENT = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class RequestFields(BaseModel):
  """The fields both completion endpoints share (and a line of serve.py's --prompts file)."""

  model_config = _LENIENT

  model: Text | None = None
  max_tokens: PositiveInt | None = None
  max_completion_tokens: PositiveInt | None = None
  temperature: Annotated[float, Field(ge=0, le=2)] | None = None
  top_p: Annotated[float, Field(gt=0, le=1)] | None = None
  top_k: Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)] | None = None
  min_p: Annotated[float, Field(ge=0, le=1)] | None = None
  presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
  frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
  repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
  n: PositiveInt = 1
  stream: StrictBool = False
  stream_options: dict[str, StrictBool] | None = None
  stop: Text | list[Text] | None = None
  stop_token_ids: list[Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]] | None = None
  seed: Annotated[StrictInt, Field(ge=0, lt=2**31)] | None = None
  ignore_eos: StrictBool = False
  user: Text | None = None
  # OpenAI's {"token id": bias}, each bias in [-100, 100]
  logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
  # vLLM's
  min_tokens: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] = 0
  skip_special_tokens: StrictBool = True
  include_stop_str_in_output: StrictBool = False
  add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for a chat
  # guided decoding (OpenAI, then vLLM's fields)
  response_format: dict[str, Any] | None = None
  guided_json: dict[str, Any] | Text | None = None
  guided_regex: Text | None = None
  guided_choice: list[Text] | None = None


# The labels pydantic gives the members of a union in an error's location (not field names).
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def describe_invalid(errors) -> tuple[str, str | None]:
  """(message, param) for pydantic's errors about a request: the field and what was wrong.

  Of a union's errors (one per member), the one that got past the type check says the most.
  """
  errors = list(errors)
  if not errors:
    return "invalid request body", None
  err = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
  loc = [
    str(x)
    for x in err.get("loc", ())
    if x != "body" and not (isinstance(x, str) and ("[" in x or x in _UNION_TAGS))
  ]
  param = ".".join(loc) or None
  msg = str(err.get("msg", "")).removeprefix("Value error, ")
  if err.get("type") == "json_invalid":
    return f"malformed JSON body: {msg}", None
  if param is None:  # the body as a whole: empty, not an object, or not sent as JSON
    return (
      f"the body must be a JSON object sent with Content-Type: application/json ({msg})",
      None,
    )
  return f"invalid value for '{param}': {msg}", param


def check_sampling_fields(**fields) -> None:
  """Applies the API's rules to sampling fields given elsewhere (serve.py's flags), by their API
  names (max_tokens, temperature, top_k, top_p, seed, ...): ValueError with the API's message."""
  try:
    RequestFields.model_validate(fields)
  except ValidationError as e:
    raise ValueError(describe_invalid(e.errors())[0]) from None


def request_params(
  body: RequestFields,
  defaults: SamplingParams,
  *,
  max_tokens: int,
  seed: int,
  logprobs: int | None = None,
  prompt_logprobs: int | None = None,
  guided: Grammar | None = None,
) -> SamplingParams:
  """The SamplingParams of a request's fields; a field not given takes `defaults`' value.

  Raises:
    RequestError naming the field: a logit_bias key that is not a token id, or min_tokens past
    max_tokens (the engine checks the rest against the model).
  """
  bias = {}
  for key, value in (body.logit_bias or {}).items():
    if not (key.isascii() and key.isdigit()) or int(key) > INT32_MAX:
      raise RequestError(f"logit_bias key {key!r} is not a token id", "logit_bias")
    bias[int(key)] = value
  if body.min_tokens > max_tokens:
    raise RequestError(
      f"min_tokens={body.min_tokens} is not allowed: must be <= max_tokens={max_tokens}",
      "min_tokens",
    )
  stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
  pick = lambda v, d: d if v is None else v
  return SamplingParams(
    max_new_tokens=max_tokens,
    temperature=pick(body.temperature, defaults.temperature),
    top_p=pick(body.top_p, defaults.top_p),
    top_k=max(0, pick(body.top_k, defaults.top_k)),
    min_p=pick(body.min_p, defaults.min_p),
    presence_penalty=pick(body.presence_penalty, defaults.presence_penalty),
    frequency_penalty=pick(body.frequency_penalty, defaults.frequency_penalty),
    repetition_penalty=pick(body.repetition_penalty, defaults.repetition_penalty),
    seed=seed,
    stop_token_ids=tuple(body.stop_token_ids or ()),
    stop=tuple(s for s in stop if s),
    ignore_eos=body.ignore_eos,
    logprobs=logprobs,
    guided=guided,
    logit_bias=tuple(bias.items()),
    min_tokens=body.min_tokens,
    skip_special_tokens=body.skip_special_tokens,
    include_stop_str_in_output=body.include_stop_str_in_output,
    prompt_logprobs=prompt_logprobs,
  )


class CompletionBody(RequestFields):
  # Text, token ids, or a list of either: one set of n choices per prompt.
  prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
  logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
  echo: StrictBool = False
  suffix: Text | None = None


class ChatMessage(BaseModel):
  model_config = _LENIENT  # other keys (tool_calls, ...) reach the template as they are
  role: Literal["system", "user", "assistant", "tool", "developer"]
  content: Text | list[dict[str, Any]] | None = None  # a string, or text parts
  name: Text | None = None


class _ChatFields(BaseModel):
  """What renders a chat (the chat endpoint and /tokenize)."""

  add_generation_prompt: StrictBool = True
  continue_final_message: StrictBool = False
  chat_template_kwargs: dict[str, Any] | None = None


class ChatBody(RequestFields, _ChatFields):
  messages: Annotated[list[ChatMessage], Field(min_length=1)]
  logprobs: StrictBool = False
  top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class TokenizeBody(_ChatFields):
  """vLLM's /tokenize: a `prompt`, or a chat's `messages`."""

  model_config = _LENIENT
  model: Text | None = None
  prompt: Text | None = None
  messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
  add_special_tokens: StrictBool | None = None
  return_token_strs: StrictBool = False


class DetokenizeBody(BaseModel):
  model_config = _LENIENT
  model: Text | None = None
  tokens: list[TokenId]


@dataclasses.dataclass
class _Choice:
  """One choice of a response as it is assembled: its prompt, its text, the next token's
  `text_offset`."""

  prompt_ids: list[int]
  prompt_text: str
  text: str = ""
  started: bool = False
  offset: int = 0
  n_out: int = 0
  finish_reason: str | None = None
  logprobs: list[dict] = dataclasses.field(default_factory=list)


def _merge_logprobs(parts: list[dict]) -> dict:
  """Logprobs objects of consecutive pieces as one (their lists concatenated)."""
  if not parts:
    return {}
  return {k: [x for p in parts for x in p[k]] for k in parts[0]}


# -- the app ------------------------------------------------------------------------------------


def build_app(
  runner: EngineRunner,
  *,
  tokenizer,
  model_name: str | Sequence[str],
  chat_template: ChatTemplate | None = None,
  limits: ServerLimits | None = None,
  api_key: str | None = None,
  default_params: SamplingParams | None = None,
  guided: GrammarCompiler | None = None,
) -> FastAPI:
  """The FastAPI app.

  Args:
    tokenizer: has `encode(text, add_special_tokens=)`, `decode(ids, skip_special_tokens=)`,
      `bos_id` and `bos_token` (ByteTokenizer, HFTokenizer).
    model_name: the served model's name, or several (aliases); a request's `model` must be one.
    chat_template: renders messages to a prompt (default: a plain "role: content" transcript
      ending in "assistant:").
    limits: what a request may ask for (`serve.limits`).
    default_params: the sampling defaults of requests that do not set a field (the seed aside:
      a request without one draws a fresh one); default: `serve.sampling`'s defaults. Without
      `max_tokens`, a request gets its `max_new_tokens`, or what the context leaves if less.
    guided: compiles guided-decoding constraints over the model's tokenizer (without it, they are
      refused with a 400).
  """
  app = FastAPI(title="atlas_jax", docs_url=None, redoc_url=None, openapi_url=None)
  names = [model_name] if isinstance(model_name, str) else list(model_name)
  engine = runner.engine
  vocab_size, context = engine.model_config.vocab_size, engine.max_model_len
  limits = ServerLimits() if limits is None else limits
  max_prompt_tokens = limits.max_prompt_tokens or context
  max_tokens_limit = limits.max_tokens or context
  template = chat_template or PlainChatTemplate()
  defaults = default_params or sampling_defaults()
  created = int(time.time())
  encode = lambda text, add: tokenizer.encode(text, add_special_tokens=add)
  token_text = lambda t: tokenizer.decode([t], skip_special_tokens=False)

  @app.exception_handler(RequestValidationError)
  async def _invalid(request, exc: RequestValidationError):
    message, param = describe_invalid(exc.errors())
    return _error_response(400, message, param)

  @app.exception_handler(APIError)
  async def _api_error(request, exc: APIError):
    return _error_response(exc.status, exc.message, exc.param, exc.kind, code=exc.code)

  @app.exception_handler(HTTPException)
  async def _http_error(request, exc: HTTPException):
    # Routing (404, 405) and body parsing (e.g. bytes that are not UTF-8), in OpenAI's shape.
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    if message == "There was an error parsing the body":
      cause = exc.__cause__
      message = "malformed JSON body" + (f": {cause}" if cause is not None else "")
    return _error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

  app.add_middleware(_Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes)

  def not_found(model: str) -> APIError:
    served = ", ".join(repr(n) for n in names)
    return APIError(
      404,
      f"the model {model!r} does not exist; this server serves {served}",
      "model",
      code="model_not_found",
    )

  def check(body: BaseModel) -> None:
    """The model asked for is served; the fields ignored are named in one warning line."""
    if body.model is not None and body.model not in names:
      raise not_found(body.model)
    ignored = sorted(body.model_extra or {})
    if ignored:
      log.warning("request fields ignored: %s", ", ".join(ignored))

  def prompt_ids(text: str, add_special_tokens: bool) -> list[int]:
    return encode_prompt(tokenizer, text, add_special_tokens)

  def chat_ids(messages: list[ChatMessage], fields: _ChatFields, add: bool | None) -> list[int]:
    """A chat's prompt ids: the template's text encoded as transformers encodes it."""
    try:
      text = template.render(
        [m.model_dump(exclude_none=True) for m in messages],
        add_generation_prompt=fields.add_generation_prompt,
        continue_final_message=fields.continue_final_message,
        **(fields.chat_template_kwargs or {}),
      )
      encodable(text)
    except ChatTemplateError as e:  # the request's fault (e.g. the roles' order)
      raise APIError(400, str(e), e.field) from None
    except ValueError as e:
      raise APIError(400, f"the chat's text: {e}", "messages") from None
    return prompt_ids(text, template.adds_special_tokens(text, tokenizer, add))

  async def grammar_of(body: RequestFields) -> Grammar | None:
    """The request's compiled constraint, or None; a 400 naming the field when it is bad."""
    try:
      spec = guided_spec(
        response_format=body.response_format,
        guided_json=body.guided_json,
        guided_regex=body.guided_regex,
        guided_choice=body.guided_choice,
      )
      if spec is None:
        return None
      if guided is None:
        raise APIError(400, "guided decoding is not enabled on this server", spec.field)
      return await asyncio.to_thread(guided.compile, spec)
    except GuidedDecodingError as e:
      raise APIError(400, str(e), e.field) from None

  def max_tokens_of(body: RequestFields, n_prompt: int, where: str) -> int:
    """The request's max_tokens (default: the server's, or what the context leaves), checked
    against the limits with the prompt's length."""
    if n_prompt == 0:
      raise APIError(400, "the prompt is empty", where)
    if n_prompt > max_prompt_tokens:
      raise APIError(
        400, f"the prompt has {n_prompt} tokens; the limit is {max_prompt_tokens}", where
      )
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
      return max(1, min(defaults.max_new_tokens, max_tokens_limit, context - n_prompt))
    if max_tokens > max_tokens_limit:
      raise APIError(
        400, f"max_tokens={max_tokens} exceeds the limit {max_tokens_limit}", "max_tokens"
      )
    return max_tokens

  def submit(body, prompts, logprobs, prompt_logprobs, grammar, where):
    """Queues n choices per prompt (all or none); [(request id, queue)] in choice order."""
    if body.n > limits.max_n:
      raise APIError(400, f"n={body.n} exceeds the limit {limits.max_n}", "n")
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    groups = []
    try:
      for ids, _ in prompts:
        max_tokens = max_tokens_of(body, len(ids), where)
        params = [
          request_params(
            body,
            defaults,
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
      return runner.submit_all(groups, stream=body.stream)
    except ValueError as e:
      field = getattr(e, "field", None) or (where if isinstance(e, RequestError) else None)
      raise APIError(400, str(e), field) from None

  async def merged(subs):
    """(choice index, RequestOutput) in arrival order across the choices."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, q):
      while True:
        out = await q.get()
        await queue.put((i, out))
        if out.finished:
          return

    tasks = [asyncio.create_task(pump(i, q)) for i, (_, q) in enumerate(subs)]
    left = len(subs)
    try:
      while left:
        i, out = await queue.get()
        left -= out.finished
        yield i, out
    finally:
      for t in tasks:
        t.cancel()
      for rid, _ in subs:  # no-op for finished requests; frees the blocks of the others
        runner.abort(rid)

  def completion_logprobs(choice: _Choice, ids, lps, tops) -> dict:
    tokens = [token_text(t) for t in ids]
    offsets = []
    for t in tokens:  # as vLLM: each token's text after the ones before it
      offsets.append(choice.offset)
      choice.offset += len(t)
    return {
      "tokens": tokens,
      "token_logprobs": list(lps),
      "top_logprobs": [
        None if top is None else {token_text(t): lp for t, lp in top} for top in tops
      ],
      "text_offset": offsets,
    }

  def chat_logprobs(ids, lps, tops) -> dict:
    def entry(t, lp):
      text = token_text(t)
      return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {
      "content": [
        {**entry(t, lp), "top_logprobs": [entry(u, v) for u, v in top]}
        for t, lp, top in zip(ids, lps, tops)
      ]
    }

  def piece(choice: _Choice, out: RequestOutput, chat: bool, logprobs, echo: bool):
    """(text, logprobs or None) that `out` adds to `choice`; the first carries the echo."""
    first, choice.started = not choice.started, True
    text, lp = out.text, None
    if logprobs is not None:
      tokens = (out.new_token_ids, out.new_logprobs, out.new_top_logprobs)
      if chat:
        lp = chat_logprobs(*tokens)
      else:
        parts = []
        if first and echo and out.prompt_logprobs is not None:
          prompt = (choice.prompt_ids, out.prompt_logprobs, out.prompt_top_logprobs)
          parts.append(completion_logprobs(choice, *prompt))
        lp = _merge_logprobs([*parts, completion_logprobs(choice, *tokens)])
    if first and echo:
      text = choice.prompt_text + text
    choice.text += text
    choice.n_out += len(out.new_token_ids)
    return text, lp

  async def respond(body, prompts, *, chat: bool, logprobs: int | None, echo: bool = False):
    """Serves n choices for each (ids, text) of `prompts`: a JSON response or an SSE stream."""
    where = "messages" if chat else "prompt"
    prompt_logprobs = logprobs if echo else None
    grammar = await grammar_of(body)
    subs = submit(body, prompts, logprobs, prompt_logprobs, grammar, where)
    choices = [_Choice(ids, text) for ids, text in prompts for _ in range(body.n)]
    rid = ("chatcmpl-" if chat else "cmpl-") + subs[0][0]  # the first choice's, as logged
    obj = "chat.completion" if chat else "text_completion"
    model = body.model or names[0]
    usage_on = bool(body.stream_options and body.stream_options.get("include_usage"))
    n_prompt_tokens = sum(len(ids) for ids, _ in prompts)

    def usage():
      n_out = sum(c.n_out for c in choices)
      return {
        "prompt_tokens": n_prompt_tokens,
        "completion_tokens": n_out,
        "total_tokens": n_prompt_tokens + n_out,
      }

    def error_of(out):
      return out.error or (
        f"request ended: {out.finish_reason}" if out.finish_reason == "error" else None
      )

    def envelope(choice_list, **extra):
      kind = obj + (".chunk" if chat and body.stream else "")
      head = {"id": rid, "object": kind, "created": int(time.time()), "model": model}
      return {**head, "choices": choice_list, **extra}

    if body.stream:

      async def events():
        if chat:
          for i in range(len(choices)):
            delta = {"role": "assistant", "content": ""}
            yield _sse(
              envelope([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
            )
        async for i, whole in merged(subs):
          if error_of(whole):
            yield _sse({"error": {"message": error_of(whole), "type": "server_error"}})
            continue
          for out in one_per_token(whole):
            text, lp = piece(choices[i], out, chat, logprobs, echo)
            if not text and not out.finished and not (lp and out.new_token_ids):
              continue  # a token whose text is held back (half a character, a possible stop)
            reason = out.finish_reason if out.finished else None
            choice = (
              {"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": reason}
              if chat
              else {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
            )
            yield _sse(envelope([choice]))
        if usage_on:
          yield _sse(envelope([], usage=usage()))
        yield "data: [DONE]\n\n"

      return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
      )

    async for i, out in merged(subs):
      if error_of(out):
        raise APIError(500, error_of(out))
      _, lp = piece(choices[i], out, chat, logprobs, echo)
      if lp is not None:
        choices[i].logprobs.append(lp)
      if out.finished:
        choices[i].finish_reason = out.finish_reason

    body_choices = []
    for i, c in enumerate(choices):
      lp = None if logprobs is None else _merge_logprobs(c.logprobs)
      if chat:
        message = {"role": "assistant", "content": c.text}
        body_choices.append(
          {"index": i, "message": message, "logprobs": lp, "finish_reason": c.finish_reason}
        )
      else:
        body_choices.append(
          {"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
        )
    return JSONResponse(envelope(body_choices, usage=usage()))

  @app.post("/v1/completions")
  async def completions(body: CompletionBody):
    check(body)
    if body.suffix:
      raise APIError(400, "suffix is not supported", "suffix")
    add = True if body.add_special_tokens is None else body.add_special_tokens
    one = isinstance(body.prompt, str) or all(isinstance(t, int) for t in body.prompt)
    prompts = []
    for p in [body.prompt] if one and body.prompt != [] else body.prompt:
      if isinstance(p, str):
        prompts.append((prompt_ids(p, add), p))
      else:
        text = (
          tokenizer.decode(p, skip_special_tokens=body.skip_special_tokens) if body.echo else ""
        )
        prompts.append((list(p), text))
    if not prompts:
      raise APIError(400, "the prompt is empty", "prompt")
    return await respond(body, prompts, chat=False, logprobs=body.logprobs, echo=body.echo)

  @app.post("/v1/chat/completions")
  async def chat_completions(body: ChatBody):
    check(body)
    ids = chat_ids(body.messages, body, body.add_special_tokens)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return await respond(body, [(ids, "")], chat=True, logprobs=logprobs)

  @app.post("/tokenize")
  async def tokenize(body: TokenizeBody):
    check(body)
    if (body.prompt is None) == (body.messages is None):
      raise APIError(400, "give one of 'prompt' (text) or 'messages' (a chat)", "prompt")
    if body.prompt is not None:
      ids = encode(
        body.prompt, True if body.add_special_tokens is None else body.add_special_tokens
      )
    else:
      ids = chat_ids(body.messages, body, body.add_special_tokens)
    strs = [token_text(t) for t in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": strs}

  @app.post("/detokenize")
  async def detokenize(body: DetokenizeBody):
    check(body)
    bad = next((t for t in body.tokens if t >= vocab_size), None)
    if bad is not None:
      raise APIError(
        400, f"token id {bad} is not allowed: token ids must be in [0, {vocab_size})", "tokens"
      )
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

  def card(name: str) -> dict:
    return {
      "id": name,
      "object": "model",
      "created": created,
      "owned_by": "atlas_jax",
      "max_model_len": context,
    }

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [card(n) for n in names]}

  @app.get("/v1/models/{model_id:path}")
  async def model(model_id: str):
    if model_id not in names:
      raise not_found(model_id)
    return card(model_id)

  @app.get("/health")
  async def health():
    if runner.error is not None:
      return JSONResponse({"status": "degraded", "error": str(runner.error)}, status_code=200)
    return {"status": "ok"}

  @app.get("/metrics")
  async def metrics():
    return PlainTextResponse(
      runner.metrics.render(**runner.gauges()), media_type="text/plain; version=0.0.4"
    )

  return app


def one_per_token(out: RequestOutput) -> list[RequestOutput]:
  """An output of several tokens (a burst's, a speculative round's) as one output per token,
  each with its own text and logprobs, the prompt's logprobs on the first and the finish on the
  last: a stream sends each token as its own event, as vLLM does."""
  n = len(out.new_token_ids)
  if n <= 1:
    return [out]
  texts = out.new_texts if len(out.new_texts) == n else [out.text] + [""] * (n - 1)
  tops = out.new_top_logprobs
  return [
    dataclasses.replace(
      out,
      new_token_ids=out.new_token_ids[j : j + 1],
      new_logprobs=out.new_logprobs[j : j + 1],
      new_top_logprobs=tops[j : j + 1],
      text=texts[j],
      new_texts=texts[j : j + 1],
      finished=out.finished and j == n - 1,
      finish_reason=out.finish_reason if j == n - 1 else None,
      error=out.error if j == n - 1 else None,
      prompt_logprobs=out.prompt_logprobs if j == 0 else None,
      prompt_top_logprobs=out.prompt_top_logprobs if j == 0 else None,
    )
    for j in range(n)
  ]


def _sse(payload: dict) -> str:
  return f"data: {json.dumps(payload)}\n\n"
