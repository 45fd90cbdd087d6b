"""The endpoints that generate nothing: the served models, the server's health, its metrics."""

from __future__ import annotations

from fastapi.responses import JSONResponse, PlainTextResponse

from atlas_jax.serving.http.protocol import ModelCard
from atlas_jax.serving.http.state import ServerState, State
from atlas_jax.serving.metrics import vllm_names


def model_card(state: ServerState, name: str) -> ModelCard:
  return {
    "id": name,
    "object": "model",
    "created": state.created,
    "owned_by": "atlas_jax",
    "max_model_len": state.context,
  }


async def list_models(state: State):
  """GET /v1/models: each served name (aliases of one model)."""
  return {"object": "list", "data": [model_card(state, n) for n in state.names]}


async def retrieve_model(model_id: str, state: State):
  """GET /v1/models/{model_id}."""
  if model_id not in state.names:
    raise state.not_found(model_id)
  return model_card(state, model_id)


async def health(state: State):
  """GET /health: ok, or degraded (still serving) after the engine raised in a step."""
  if state.runner.error is not None:
    error = str(state.runner.error)
    return JSONResponse({"status": "degraded", "error": error}, status_code=200)
  return {"status": "ok"}


async def metrics(state: State):
  """GET /metrics: Prometheus' text format."""
  runner = state.runner
  ours = runner.metrics.render(**runner.gauges())
  text = ours + vllm_names(ours, state.names[0])
  return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
