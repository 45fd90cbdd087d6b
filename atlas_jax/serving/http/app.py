"""The app's assembly: its state, its error handlers, the guard in front, and the routes."""

from __future__ import annotations

import json
from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from atlas_jax.config import ServerLimits
from atlas_jax.decoding.guided import GrammarCompiler
from atlas_jax.decoding.sampling import SamplingParams
from atlas_jax.serving import reasoning, tool_parsers
from atlas_jax.serving.chat import ChatTemplate
from atlas_jax.serving.http import info, tokenization
from atlas_jax.serving.http.chat_completions import create_chat_completion
from atlas_jax.serving.http.completions import create_completion
from atlas_jax.serving.http.engine_thread import EngineRunner
from atlas_jax.serving.http.guard import Guard
from atlas_jax.serving.http.protocol import APIError, describe_invalid, error_response
from atlas_jax.serving.http.state import ServerState

# (method, path, endpoint): the whole API.
ROUTES = [
  ("POST", "/v1/completions", create_completion),
  ("POST", "/v1/chat/completions", create_chat_completion),
  ("GET", "/v1/models", info.list_models),
  ("GET", "/v1/models/{model_id:path}", info.retrieve_model),
  ("POST", "/v1/load_lora_adapter", info.load_lora_adapter),
  ("POST", "/v1/unload_lora_adapter", info.unload_lora_adapter),
  ("POST", "/tokenize", tokenization.tokenize),
  ("POST", "/detokenize", tokenization.detokenize),
  ("GET", "/health", info.health),
  ("GET", "/metrics", info.metrics),
]


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
  tool_parser: str | None = None,
  reasoning_parser: str | None = None,
) -> FastAPI:
  """The FastAPI app.

  Args:
    tokenizer: has `encode(text, add_special_tokens=)`, `decode(ids, skip_special_tokens=)`,
      `bos_id` and `bos_token` (ByteTokenizer, HFTokenizer).
    model_name: the served model's name, or several (aliases); a request's `model` must be one.
    chat_template: renders messages to a prompt (default: a plain "role: content" transcript
      ending in "assistant:").
    limits: what a request may ask for (`serve.limits`).
    api_key: when given, every /v1/ request must carry it as `Authorization: Bearer KEY`.
    default_params: the sampling defaults of requests that do not set a field (the seed aside:
      a request without one draws a fresh one); default: `serve.sampling`'s defaults. Without
      `max_tokens`, a request gets its `max_new_tokens`, or what the context leaves if less.
    guided: compiles guided-decoding constraints over the model's tokenizer (without it, they are
      refused with a 400).
    tool_parser: reads the model's own tool-call syntax back as `tool_calls` (vLLM's
      `--tool-call-parser` names, `atlas_jax.serving.tool_parsers`); without it, `tool_choice:
      "auto"` is a 400 (`required` and named functions are guided, and need `guided`).
    reasoning_parser: splits the thinking into `reasoning_content` (`deepseek_r1`, `qwen3`).
  """
  if tool_parser is not None:
    tool_parsers.get_parser(tool_parser)  # a ValueError naming the choices
  if reasoning_parser is not None:
    reasoning.get_parser(reasoning_parser)
  app = FastAPI(title="atlas_jax", docs_url=None, redoc_url=None, openapi_url=None)
  state = ServerState.create(
    runner,
    tokenizer=tokenizer,
    model_name=model_name,
    chat_template=chat_template,
    limits=limits,
    default_params=default_params,
    guided=guided,
    tool_parser=tool_parser,
    reasoning_parser=reasoning_parser,
  )
  app.state.server = state  # what the endpoints' `State` parameter receives
  app.add_exception_handler(RequestValidationError, invalid_request)
  app.add_exception_handler(APIError, api_error)
  app.add_exception_handler(HTTPException, http_error)
  app.add_middleware(Guard, api_key=api_key, max_body_bytes=state.limits.max_body_bytes)
  for method, path, endpoint in ROUTES:
    app.add_api_route(path, endpoint, methods=[method])
  return app


async def invalid_request(request, exc: RequestValidationError):
  """A body pydantic refused: a 400 naming the field."""
  message, param = describe_invalid(exc.errors())
  return error_response(400, message, param)


async def api_error(request, exc: APIError):
  return error_response(exc.status, exc.message, exc.param, exc.kind, code=exc.code)


async def http_error(request, exc: HTTPException):
  """Routing (404, 405) and body parsing (e.g. bytes that are not UTF-8), in OpenAI's shape."""
  message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
  if message == "There was an error parsing the body":
    cause = exc.__cause__
    message = "malformed JSON body" + (f": {cause}" if cause is not None else "")
  return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))
