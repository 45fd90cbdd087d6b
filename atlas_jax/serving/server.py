"""An OpenAI-compatible HTTP server over the engine (FastAPI on uvicorn).

The engine runs in one background thread that steps while there is work; request handlers on the
event loop submit requests and read their outputs from per-request asyncio queues, filled from
the engine thread with `call_soon_threadsafe`. A client that disconnects mid-stream aborts its
request, which frees its blocks.

Endpoints: POST /v1/completions, POST /v1/chat/completions (stream as server-sent events ending
in `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus).

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
import threading
import time
import uuid
from collections.abc import Callable
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

from atlas_jax.decoding.guided import Grammar, GrammarCompiler, GuidedDecodingError
from atlas_jax.decoding.guided import spec_from_request as guided_spec
from atlas_jax.decoding.sampling import INT32_MAX, MAX_LOGPROBS, SamplingParams
from atlas_jax.serving.engine import Engine, RequestError, RequestOutput
from atlas_jax.serving.metrics import ServingMetrics


@dataclasses.dataclass(frozen=True)
class ServerLimits:
  max_prompt_tokens: int = 4096
  max_tokens: int = 1024  # per request, the most `max_tokens` may ask for
  max_n: int = 4
  max_body_bytes: int = 1 << 20
  default_max_tokens: int = 64


class APIError(Exception):
  def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
    super().__init__(message)
    self.status, self.message, self.param = status, message, param
    self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")


def _error_response(
  status: int, message: str, param=None, kind="invalid_request_error", headers=None
) -> JSONResponse:
  body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
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
  """Drives an Engine from a background thread for asyncio callers."""

  def __init__(self, engine: Engine, metrics: ServingMetrics | None = None):
    self.engine = engine
    self.metrics = metrics or ServingMetrics()
    self._lock = threading.Lock()
    self._wake = threading.Event()
    self._streams: dict[str, _Stream] = {}
    self._stop = False
    self.error: BaseException | None = None
    self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
    self._thread.start()

  def submit(self, prompt: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
    """Queues a request; its RequestOutputs arrive on the returned queue (None ends it)."""
    return self.submit_all(prompt, [params])[0]

  def submit_all(
    self, prompt: list[int], params: list[SamplingParams]
  ) -> list[tuple[str, asyncio.Queue]]:
    """Queues n completions of one prompt, computed once and sharing its blocks (all or none)."""
    rids = [uuid.uuid4().hex for _ in params]
    loop = asyncio.get_running_loop()
    now = time.perf_counter()
    streams = [_Stream(asyncio.Queue(), loop, now, len(prompt)) for _ in params]
    with self._lock:
      self.engine.add_requests(rids, prompt, params)  # RequestError propagates
      self._streams.update(zip(rids, streams))
    self._wake.set()
    return [(rid, s.queue) for rid, s in zip(rids, streams)]

  def abort(self, rid: str) -> None:
    self.engine.abort(rid)
    self._wake.set()

  def shutdown(self) -> None:
    self._stop = True
    self._wake.set()
    self._thread.join(timeout=10)

  def gauges(self) -> dict[str, Any]:
    with self._lock:
      s = self.engine.allocator.stats()
      return dict(
        running=self.engine.n_running,
        waiting=self.engine.n_waiting,
        kv_usage=s.n_used / s.n_blocks,
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
        with self._lock:
          outputs = self.engine.step()
      except BaseException as e:  # keep serving: fail the in-flight requests, not the server
        self.error = e
        with self._lock:
          for rid in list(self._streams):
            self.engine.abort(rid)
          outputs = self.engine.step()
          for out in outputs:
            out.error = f"engine error: {e}"
      now = time.perf_counter()
      for out in outputs:
        stream = self._streams.get(out.request_id)
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
          del self._streams[out.request_id]
          self.metrics.e2e.observe(now - stream.arrival)
          self.metrics.finished(out.finish_reason or "stop", stream.n_prompt, stream.n_out)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)


# -- request bodies -----------------------------------------------------------------------------

PositiveInt = Annotated[StrictInt, Field(ge=1)]


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


class _Body(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

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
  if err.get("type") == "extra_forbidden":
    return f"unknown field '{param}'", param
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
    _Body.model_validate(fields)
  except ValidationError as e:
    raise ValueError(describe_invalid(e.errors())[0]) from None


class CompletionBody(_Body):
  prompt: Text | list[Annotated[StrictInt, Field(ge=0)]]
  logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
  echo: Literal[False] = False


class ChatMessage(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)
  role: Literal["system", "user", "assistant", "tool", "developer"]
  content: Text
  name: Text | None = None


class ChatBody(_Body):
  messages: Annotated[list[ChatMessage], Field(min_length=1)]
  logprobs: StrictBool = False
  top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None


# -- the app ------------------------------------------------------------------------------------


def build_app(
  runner: EngineRunner,
  *,
  encode: Callable[[str], list[int]],
  decode: Callable[[list[int]], str],
  model_name: str,
  chat_template: Callable[[list[dict]], str] | None = None,
  limits: ServerLimits = ServerLimits(),
  api_key: str | None = None,
  default_params: SamplingParams | None = None,
  guided: GrammarCompiler | None = None,
) -> FastAPI:
  """The FastAPI app. `chat_template` renders messages to a prompt string (default: a plain
  "role: content" transcript ending in "assistant:"); `guided` compiles guided-decoding
  constraints over the model's tokenizer (without it, they are refused with a 400)."""
  app = FastAPI(title="atlas_jax", docs_url=None, redoc_url=None, openapi_url=None)
  defaults = default_params or SamplingParams()
  created = int(time.time())

  @app.exception_handler(RequestValidationError)
  async def _invalid(request, exc: RequestValidationError):
    message, param = describe_invalid(exc.errors())
    return _error_response(400, message, param)

  @app.exception_handler(APIError)
  async def _api_error(request, exc: APIError):
    return _error_response(exc.status, exc.message, exc.param, exc.kind)

  @app.exception_handler(HTTPException)
  async def _http_error(request, exc: HTTPException):
    # Routing (404, 405) and body parsing (e.g. bytes that are not UTF-8), in OpenAI's shape.
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    if message == "There was an error parsing the body":
      cause = exc.__cause__
      message = "malformed JSON body" + (f": {cause}" if cause is not None else "")
    return _error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

  app.add_middleware(_Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes)

  async def grammar_of(body: _Body) -> Grammar | None:
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

  def sampling(
    body: _Body, n_prompt: int, index: int, logprobs: int | None, grammar: Grammar | None
  ) -> SamplingParams:
    default_max = min(limits.default_max_tokens, limits.max_tokens)
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max
    if max_tokens > limits.max_tokens:
      raise APIError(
        400, f"max_tokens={max_tokens} exceeds the limit {limits.max_tokens}", "max_tokens"
      )
    if body.n > limits.max_n:
      raise APIError(400, f"n={body.n} exceeds the limit {limits.max_n}", "n")
    where = "messages" if isinstance(body, ChatBody) else "prompt"
    if n_prompt > limits.max_prompt_tokens:
      raise APIError(
        400, f"the prompt has {n_prompt} tokens; the limit is {limits.max_prompt_tokens}", where
      )
    if n_prompt == 0:
      raise APIError(400, "the prompt is empty", where)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    pick = lambda v, d: d if v is None else v
    seed = pick(body.seed, defaults.seed)
    return SamplingParams(
      max_new_tokens=max_tokens,
      temperature=pick(body.temperature, defaults.temperature),
      top_p=pick(body.top_p, defaults.top_p),
      top_k=max(0, pick(body.top_k, defaults.top_k)),
      min_p=pick(body.min_p, defaults.min_p),
      presence_penalty=pick(body.presence_penalty, 0.0),
      frequency_penalty=pick(body.frequency_penalty, 0.0),
      repetition_penalty=pick(body.repetition_penalty, 1.0),
      seed=(seed + index) % 2**31,  # n choices differ, and each is reproducible
      stop_token_ids=tuple(body.stop_token_ids or ()),
      stop=tuple(s for s in stop if s),
      ignore_eos=body.ignore_eos,
      logprobs=logprobs,
      guided=grammar,
    )

  def submit_all(prompt_ids, body, logprobs, grammar):
    try:
      params = [sampling(body, len(prompt_ids), i, logprobs, grammar) for i in range(body.n)]
      # The n choices share the prompt's computation and blocks (queued all or none).
      return runner.submit_all(prompt_ids, params)
    except (RequestError, ValueError) as e:
      if isinstance(e, APIError):
        raise
      where = "messages" if isinstance(body, ChatBody) else "prompt"
      raise APIError(400, str(e), where if isinstance(e, RequestError) else None) from None

  async def merged(subs):
    """(choice index, RequestOutput) in arrival order across the n choices."""
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

  def completion_logprobs(out: RequestOutput):
    return {
      "tokens": [decode([t]) for t in out.new_token_ids],
      "token_logprobs": out.new_logprobs,
      "top_logprobs": [{decode([t]): lp for t, lp in top} for top in out.new_top_logprobs],
    }

  def chat_logprobs(out: RequestOutput):
    return {
      "content": [
        {
          "token": decode([t]),
          "logprob": lp,
          "bytes": None,
          "top_logprobs": [{"token": decode([u]), "logprob": v, "bytes": None} for u, v in top],
        }
        for t, lp, top in zip(out.new_token_ids, out.new_logprobs, out.new_top_logprobs)
      ]
    }

  async def respond(body: _Body, prompt_ids: list[int], chat: bool, logprobs: int | None):
    subs = submit_all(prompt_ids, body, logprobs, await grammar_of(body))
    rid = ("chatcmpl-" if chat else "cmpl-") + subs[0][0][:24]
    obj = "chat.completion" if chat else "text_completion"
    model = body.model or model_name
    usage_on = bool(body.stream_options and body.stream_options.get("include_usage"))

    def error_of(out):
      return out.error or (
        f"request ended: {out.finish_reason}" if out.finish_reason == "error" else None
      )

    if body.stream:

      async def events():
        n_out = 0
        if chat:
          for i in range(body.n):
            chunk = {
              "index": i,
              "delta": {"role": "assistant", "content": ""},
              "logprobs": None,
              "finish_reason": None,
            }
            yield _sse(
              {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": model,
                "choices": [chunk],
              }
            )
        async for i, out in merged(subs):
          if error_of(out):
            yield _sse({"error": {"message": error_of(out), "type": "server_error"}})
            continue
          n_out += len(out.new_token_ids)
          if not out.text and not out.finished:
            continue
          lp = None if logprobs is None else (chat_logprobs if chat else completion_logprobs)(out)
          reason = out.finish_reason if out.finished else None
          choice = (
            {"index": i, "delta": {"content": out.text}, "logprobs": lp, "finish_reason": reason}
            if chat
            else {"index": i, "text": out.text, "logprobs": lp, "finish_reason": reason}
          )
          yield _sse(
            {
              "id": rid,
              "object": obj + (".chunk" if chat else ""),
              "created": int(time.time()),
              "model": model,
              "choices": [choice],
            }
          )
        if usage_on:
          usage = {
            "prompt_tokens": len(prompt_ids) * body.n,
            "completion_tokens": n_out,
            "total_tokens": len(prompt_ids) * body.n + n_out,
          }
          yield _sse(
            {
              "id": rid,
              "object": obj + (".chunk" if chat else ""),
              "created": int(time.time()),
              "model": model,
              "choices": [],
              "usage": usage,
            }
          )
        yield "data: [DONE]\n\n"

      return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
      )

    texts = [""] * body.n
    reasons = [None] * body.n
    lps: list[list[RequestOutput]] = [[] for _ in range(body.n)]
    n_out = 0
    async for i, out in merged(subs):
      if error_of(out):
        raise APIError(500, error_of(out))
      texts[i] += out.text
      n_out += len(out.new_token_ids)
      lps[i].append(out)
      if out.finished:
        reasons[i] = out.finish_reason

    def merged_logprobs(i):
      parts = [(chat_logprobs if chat else completion_logprobs)(o) for o in lps[i]]
      if chat:
        return {"content": [c for p in parts for c in p["content"]]}
      return {
        k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs")
      }

    choices = []
    for i in range(body.n):
      lp = None if logprobs is None else merged_logprobs(i)
      if chat:
        choices.append(
          {
            "index": i,
            "message": {"role": "assistant", "content": texts[i]},
            "logprobs": lp,
            "finish_reason": reasons[i],
          }
        )
      else:
        choices.append({"index": i, "text": texts[i], "logprobs": lp, "finish_reason": reasons[i]})
    usage = {
      "prompt_tokens": len(prompt_ids) * body.n,
      "completion_tokens": n_out,
      "total_tokens": len(prompt_ids) * body.n + n_out,
    }
    return JSONResponse(
      {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
      }
    )

  @app.post("/v1/completions")
  async def completions(body: CompletionBody):
    prompt_ids = encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    return await respond(body, prompt_ids, chat=False, logprobs=body.logprobs)

  @app.post("/v1/chat/completions")
  async def chat_completions(body: ChatBody):
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
      text = (chat_template or plain_chat_template)(messages)
    except Exception as e:  # a template error is the request's fault (e.g. role order)
      raise APIError(400, f"chat template failed: {e}", "messages") from None
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return await respond(body, encode(text), chat=True, logprobs=logprobs)

  @app.get("/v1/models")
  async def models():
    return {
      "object": "list",
      "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "atlas_jax"}],
    }

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


def _sse(payload: dict) -> str:
  return f"data: {json.dumps(payload)}\n\n"


def plain_chat_template(messages: list[dict]) -> str:
  """The fallback template: one "role: content" line per message, then "assistant:"."""
  return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def jinja_chat_template(template: str, *, bos_token: str = "", eos_token: str = ""):
  """A Hugging Face `chat_template` (Jinja) as a messages -> prompt function."""
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise ValueError(message)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.globals["raise_exception"] = raise_exception
  compiled = env.from_string(template)
  return lambda messages: compiled.render(
    messages=messages, bos_token=bos_token, eos_token=eos_token, add_generation_prompt=True
  )
