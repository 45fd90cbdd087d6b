"""The endpoints that generate nothing: the served models and LoRA adapters (loaded and unloaded
at run time), the server's health, its metrics."""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel

from atlas_jax.serving.http.protocol import APIError, ModelCard
from atlas_jax.serving.http.state import ServerState, State
from atlas_jax.serving.lora import AdapterError
from atlas_jax.serving.metrics import vllm_names


def model_card(state: ServerState, name: str) -> ModelCard:
  return {
    "id": name,
    "object": "model",
    "created": state.created,
    "owned_by": "atlas_jax",
    "max_model_len": state.context,
  }


def adapter_card(state: ServerState, adapter) -> dict:
  """A loaded LoRA adapter's entry: its parent is the base model (vLLM's card)."""
  return {**model_card(state, adapter.name), "root": adapter.path, "parent": state.names[0]}


def cards(state: ServerState) -> list[dict]:
  served = state.adapters
  adapters = [] if served is None else list(served.by_name.values())
  return [model_card(state, n) for n in state.names] + [adapter_card(state, a) for a in adapters]


async def list_models(state: State):
  """GET /v1/models: each served name (aliases of one model), then each loaded LoRA adapter."""
  return {"object": "list", "data": cards(state)}


async def retrieve_model(model_id: str, state: State):
  """GET /v1/models/{model_id}."""
  card = next((c for c in cards(state) if c["id"] == model_id), None)
  if card is None:
    raise state.not_found(model_id)
  return card


class LoRARequest(BaseModel):
  """vLLM's body of /v1/load_lora_adapter and /v1/unload_lora_adapter."""

  lora_name: str
  lora_path: str | None = None


def _served(state: ServerState):
  if state.adapters is None:
    raise APIError(400, "LoRA adapters are not enabled on this server (--enable-lora)", "lora_name")
  return state.runner.engine


async def load_lora_adapter(body: LoRARequest, state: State):
  """POST /v1/load_lora_adapter: a PEFT folder into a free adapter slot (nothing recompiles)."""
  engine = _served(state)
  if body.lora_name in state.names:
    raise APIError(
      400, f"lora_name={body.lora_name!r} is not allowed: the base model's name", "lora_name"
    )
  if not body.lora_path:
    raise APIError(400, "lora_path is required: the adapter's PEFT folder", "lora_path")
  try:
    await asyncio.to_thread(engine.load_adapter, body.lora_name, body.lora_path)
  except AdapterError as e:
    raise APIError(400, str(e), e.field) from None
  return PlainTextResponse(f"Success: LoRA adapter {body.lora_name!r} added successfully.")


async def unload_lora_adapter(body: LoRARequest, state: State):
  """POST /v1/unload_lora_adapter: frees the adapter's slot."""
  engine = _served(state)
  try:
    engine.unload_adapter(body.lora_name)
  except AdapterError as e:
    raise APIError(400, str(e), e.field) from None
  return PlainTextResponse(f"Success: LoRA adapter {body.lora_name!r} removed successfully.")


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
