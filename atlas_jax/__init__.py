"""atlas_jax: the modern LLM efficiency stack in JAX, written to be read.

Axis glossary, used in every shape suffix (`q_BTNH`) and shape comment in the project:

  B batch            T query length        S key/value length
  N query heads      K kv heads            G group size (N / K)
  H head dim         D model dim           F ffn dim
  V vocab            L layers              P pages (blocks)
  Z block size       C latent dim          R rope dim (MLA)
  E MLA cache entry, C + R                 J MTP heads
  M block-table columns (max blocks per sequence)
  W words of a packed vocabulary bitmask (V / 32, rounded up)
  Q query rows of a kernel tile           X KV splits (flash decoding)
"""

from atlas_jax import hf, kernels
from atlas_jax.cache.contiguous import KVCache, LatentCache
from atlas_jax.cache.paged import KVPool, LatentPool, PagedCache
from atlas_jax.config import (
  AttentionConfig,
  Config,
  ConfigError,
  DataConfig,
  MeshConfig,
  ModelConfig,
  RopeScaling,
  ServeConfig,
  TrainConfig,
  load_config,
)
from atlas_jax.decoding.generate import SamplingParams, generate
from atlas_jax.model import Transformer, build

__version__ = "0.1.0"

__all__ = [
  "AttentionConfig",
  "Config",
  "ConfigError",
  "DataConfig",
  "KVCache",
  "KVPool",
  "LatentCache",
  "LatentPool",
  "MeshConfig",
  "ModelConfig",
  "PagedCache",
  "RopeScaling",
  "SamplingParams",
  "ServeConfig",
  "TrainConfig",
  "Transformer",
  "build",
  "generate",
  "hf",
  "kernels",
  "load_config",
]
