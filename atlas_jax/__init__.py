"""atlas_jax: the modern LLM efficiency stack in JAX, written to be read.

Axis glossary: one letter, one meaning, in every shape suffix (`q_BTNH`), einsum string and
shape comment in the project.

  B batch (rows)                        T query length (tokens per row in this call)
  S key/value length                    N query heads
  K kv heads                            G group size (N / K)
  H head dim (MLA: query/key, h + R)    D model dim
  F ffn dim (an expert's too)           V vocab
  L layers                              P pages (blocks of a pool)
  Z block size (a kernel's key tile)    Q query rows of a kernel tile
  C MLA latent dim (kv_lora_rank)       R rope dim (MLA)
  Y MLA cache entry, C + R              A low-rank dim (MLA's q_lora_rank, a LoRA rank)
  E experts                             J drafted positions (MTP heads, draft tokens per round)
  M block-table columns (blocks per sequence at most)
  W words of a packed vocabulary bitmask (V / 32, rounded up)
  X KV splits (flash decoding)          I loop iterations (decode steps per burst, pipeline steps)
  O output tokens per row (what a decode loop writes)
  U micro-batches

Lower case: an axis local to one mechanism.

  h MLA no-rope head dim (Hn)           v MLA value head dim (Hv)
  k top-k candidates (logprobs; a       s stop ids per row
    token's routed experts)
  c block copies (copy-on-write)        e expert capacity (token slots per expert)
  p pipeline stages                     r circular-pipeline repeats
  t tokens of a flattened batch (B x T) a token-expert assignments (t x k)
  g expert groups (group-limited routing)
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
