"""The OpenAI API as this server speaks it: request bodies, response shapes, the error body.

Requests are accepted as OpenAI and vLLM clients send them: fields the server does not use are
ignored, with one warning line in the log naming them, as vLLM does; the fields it uses are
checked (type and range) by pydantic, and a bad one is a 400 naming it (`describe_invalid`).
`request_params` turns a request's fields into the engine's SamplingParams.

The response shapes are TypedDicts: plain dicts on the wire, typed here so that one file shows
every object the server sends.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired, TypedDict

from fastapi.responses import JSONResponse
from pydantic import (
  AfterValidator,
  BaseModel,
  ConfigDict,
  Field,
  StrictBool,
  StrictInt,
  ValidationError,
)

from atlas_jax.config import SamplingDefaults
from atlas_jax.decoding.guided import Grammar, ReasoningGate
from atlas_jax.decoding.sampling import INT32_MAX, MAX_LOGPROBS, SamplingParams
from atlas_jax.serving.engine import RequestError

# -- errors -------------------------------------------------------------------------------------


class APIError(Exception):
  """An error a handler answers with: its HTTP status and the OpenAI error body's fields."""

  def __init__(
    self, status: int, message: str, param: str | None = None, kind: str = "", code=None
  ):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code
    self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")


def error_response(
  status: int, message: str, param=None, kind="invalid_request_error", headers=None, code=None
) -> JSONResponse:
  """OpenAI's error body: {"error": {message, type, param, code}}."""
  body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
  return JSONResponse(body, status_code=status, headers=headers)


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
  # vLLM's newer form of the same: {"json": ...} | {"regex": ...} | {"choice": [...]} | ...
  structured_outputs: dict[str, Any] | None = None


class CompletionBody(RequestFields):
  """POST /v1/completions."""

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
  tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, as responses carry them
  tool_call_id: Text | None = None  # a tool message: the call it answers


class ChatFields(BaseModel):
  """What renders a chat (the chat endpoint and /tokenize)."""

  add_generation_prompt: StrictBool = True
  continue_final_message: StrictBool = False
  chat_template_kwargs: dict[str, Any] | None = None


class ChatBody(RequestFields, ChatFields):
  """POST /v1/chat/completions."""

  messages: Annotated[list[ChatMessage], Field(min_length=1)]
  logprobs: StrictBool = False
  top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
  # OpenAI's tools: [{"type": "function", "function": {"name", "description", "parameters"}}]
  tools: list[dict[str, Any]] | None = None
  # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
  tool_choice: Text | dict[str, Any] | None = None
  parallel_tool_calls: StrictBool = True


class TokenizeBody(ChatFields):
  """vLLM's /tokenize: a `prompt`, or a chat's `messages`."""

  model_config = _LENIENT
  model: Text | None = None
  prompt: Text | None = None
  messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
  tools: list[dict[str, Any]] | None = None  # rendered by the chat template, as a chat's
  add_special_tokens: StrictBool | None = None
  return_token_strs: StrictBool = False


class DetokenizeBody(BaseModel):
  """vLLM's /detokenize."""

  model_config = _LENIENT
  model: Text | None = None
  tokens: list[TokenId]


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


# -- request fields -> SamplingParams -----------------------------------------------------------


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


def request_params(
  body: RequestFields,
  defaults: SamplingParams,
  *,
  max_tokens: int,
  seed: int,
  logprobs: int | None = None,
  prompt_logprobs: int | None = None,
  guided: Grammar | ReasoningGate | None = None,
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


# -- response shapes ----------------------------------------------------------------------------


class Usage(TypedDict):
  prompt_tokens: int
  completion_tokens: int
  total_tokens: int


class CompletionLogprobs(TypedDict):
  """A completion choice's logprobs, one entry per token in each list."""

  tokens: list[str]
  token_logprobs: list[float | None]  # None: a prompt's first token (with `echo`)
  top_logprobs: list[dict[str, float] | None]
  text_offset: list[int]  # each token's offset in the choice's text


class CompletionChoice(TypedDict):
  """A /v1/completions choice, whole or (as a stream's event) the text since the last."""

  index: int
  text: str
  logprobs: CompletionLogprobs | None
  finish_reason: str | None
  stop_reason: int | str | None


class ChatTokenLogprob(TypedDict):
  token: str
  logprob: float
  bytes: list[int]  # the token's text as UTF-8
  top_logprobs: NotRequired[list[ChatTokenLogprob]]


class ChatLogprobs(TypedDict):
  content: list[ChatTokenLogprob]


class ToolCall(TypedDict):
  id: str
  type: Literal["function"]
  function: dict[str, str]  # {"name": ..., "arguments": JSON text}


class AssistantMessage(TypedDict):
  role: Literal["assistant"]
  content: str | None
  reasoning_content: NotRequired[str | None]  # with --reasoning-parser
  tool_calls: list[ToolCall]


class ChatChoice(TypedDict):
  """A /v1/chat/completions choice."""

  index: int
  message: AssistantMessage
  logprobs: ChatLogprobs | None
  finish_reason: str | None  # "stop", "length", "tool_calls"
  stop_reason: int | str | None  # the stop string or stop token id that ended it


class ChatDelta(TypedDict, total=False):
  role: Literal["assistant"]  # the first event of each choice only
  content: str
  reasoning_content: str
  # per call: first {index, id, type, function: {name, arguments: ""}}, then
  # {index, function: {arguments: fragment}}
  tool_calls: list[dict]


class ChatChunkChoice(TypedDict):
  """A streamed /v1/chat/completions event's choice: what the choice added."""

  index: int
  delta: ChatDelta
  logprobs: ChatLogprobs | None
  finish_reason: str | None
  stop_reason: int | str | None


class Response(TypedDict):
  """A response, or one event of a stream (`object` then ends in ".chunk" for a chat)."""

  id: str
  object: str  # "text_completion", "chat.completion", "chat.completion.chunk"
  created: int  # seconds since the epoch
  model: str
  choices: list[CompletionChoice] | list[ChatChoice] | list[ChatChunkChoice]
  usage: NotRequired[Usage]  # whole responses; a stream's last event with include_usage


class ModelCard(TypedDict):
  """An entry of GET /v1/models, and GET /v1/models/{id}."""

  id: str
  object: Literal["model"]
  created: int  # when the server started
  owned_by: str
  max_model_len: int
