"""Serving: the continuous-batching engine and the OpenAI-compatible HTTP server."""

from atlas_jax.serving.engine import Engine, EngineConfig, RequestError, RequestOutput

__all__ = ["Engine", "EngineConfig", "RequestError", "RequestOutput"]
