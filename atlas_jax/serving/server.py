"""The OpenAI-compatible HTTP server: its code is the `atlas_jax.serving.http` package (its
docstring maps the files); the names serve.py and the tests import are re-exported here."""

from atlas_jax.config import ServerLimits
from atlas_jax.serving.http import (
  EngineRunner,
  RequestFields,
  Text,
  build_app,
  check_sampling_fields,
  describe_invalid,
  encodable,
  request_params,
  sampling_defaults,
)

__all__ = [
  "EngineRunner",
  "RequestFields",
  "ServerLimits",
  "Text",
  "build_app",
  "check_sampling_fields",
  "describe_invalid",
  "encodable",
  "request_params",
  "sampling_defaults",
]
