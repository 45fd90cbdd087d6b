"""An OpenAI-compatible HTTP server over the engine (FastAPI on uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (stream as server-sent events ending
in `data: [DONE]`), GET /v1/models, GET /v1/models/{id}, POST /tokenize, POST /detokenize (vLLM's
shapes), GET /health, GET /metrics (Prometheus).

The engine steps in one background thread; handlers on the event loop submit requests to it and
read their outputs from asyncio queues. A client that disconnects mid-stream aborts its request,
which frees its blocks. Without `seed`, a request draws a fresh one; with it, the output is
reproducible. vLLM's `logit_bias`, `min_tokens`, `skip_special_tokens`,
`include_stop_str_in_output` and OpenAI's `echo` are served.

The files, in the order a request meets them:
  app.py              `build_app`: the state, the error handlers, the routes table
  guard.py            the API key, the body's size limit, errors no handler took (raw ASGI)
  protocol.py         request bodies and their checks, response shapes, the error body;
                      a request's fields as SamplingParams
  state.py            `ServerState`, what every endpoint reads (`app.state.server`)
  completions.py      POST /v1/completions (`create_completion`)
  chat_completions.py POST /v1/chat/completions (`create_chat_completion`): chat templates,
                      and the place for tool calling
  generation.py       what the two share: limits, guided decoding, submission, the response
  streaming.py        server-sent events, one per token; the choices' outputs merged
  tokenization.py     POST /tokenize, POST /detokenize
  info.py             GET /v1/models, /v1/models/{id}, /health, /metrics
  engine_thread.py    `EngineRunner`: the engine's thread, and the metrics' timings
"""

from atlas_jax.serving.http.app import build_app
from atlas_jax.serving.http.engine_thread import EngineRunner
from atlas_jax.serving.http.protocol import (
  RequestFields,
  Text,
  check_sampling_fields,
  describe_invalid,
  encodable,
  request_params,
  sampling_defaults,
)

__all__ = [
  "EngineRunner",
  "RequestFields",
  "Text",
  "build_app",
  "check_sampling_fields",
  "describe_invalid",
  "encodable",
  "request_params",
  "sampling_defaults",
]
