"""KV cache accounting: bytes per token, bytes for a length, and how well a paged pool is used.

Plain numbers in, plain numbers out, so any config (dense attention or MLA) can be costed:

    per_token = kv_bytes_per_token(n_layers=32, n_kv_heads=8, head_dim=128, dtype_bytes=2)
    kv_bytes(per_token, n_tokens=8192, batch=4)

Utilisation and prefix-cache hit rate read the counters of
`atlas_jax.cache.allocator.BlockAllocator.stats()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol


class _AllocatorCounters(Protocol):
  block_size: int
  n_used: int
  filled_slots: int
  prefix_query_tokens: int
  prefix_hit_tokens: int


def _check(name: str, value: int, *, minimum: int = 1) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
  """Bytes of cache one token costs with MHA/GQA/MQA: a key and a value per kv head and layer.

  2 * L * K * H * dtype_bytes.
  """
  for name, value in dict(
    n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes
  ).items():
    _check(name, value)
  return 2 * n_layers * n_kv_heads * head_dim * dtype_bytes


def mla_kv_bytes_per_token(
  n_layers: int, kv_lora_rank: int, rope_dim: int, dtype_bytes: int
) -> int:
  """Bytes of cache one token costs with MLA: one latent (C) plus the shared rope key (R) per layer.

  L * (C + R) * dtype_bytes; keys and values are both decompressed from the latent.
  """
  _check("n_layers", n_layers)
  _check("kv_lora_rank", kv_lora_rank)
  _check("rope_dim", rope_dim, minimum=0)
  _check("dtype_bytes", dtype_bytes)
  return n_layers * (kv_lora_rank + rope_dim) * dtype_bytes


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}

# `serve --kv-cache-dtype`: "auto" caches in the compute dtype; "int8" and "fp8" one byte a
# value plus a float32 scale per token and kv head (MLA: per token's latent), as
# `atlas_jax.kernels.quantized_kv` stores them.
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
KV_SCALE_BYTES = 4


def cached_vector_bytes(width: int, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
  """Bytes one cached vector of `width` values takes (a kv head's key, or an MLA latent)."""
  if kv_cache_dtype not in KV_CACHE_DTYPES:
    raise ValueError(f"--kv-cache-dtype={kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
  return width * dtype_bytes if kv_cache_dtype == "auto" else width + KV_SCALE_BYTES


def config_kv_bytes_per_token(model: Any, *, dtype_bytes: int | None = None) -> int:
  """`kv_bytes_per_token` for a model config (`atlas_jax.config.ModelConfig` or alike).

  Reads `n_layers`, `n_kv_heads`, `head_dim` and, unless `dtype_bytes` is given, the cache dtype
  from `dtype` (the cache holds activations). An MLA config costs `mla_kv_bytes_per_token`.
  """
  if dtype_bytes is None:
    dtype = str(getattr(model, "dtype", ""))
    if dtype not in _DTYPE_BYTES:
      raise ValueError(
        f"config_kv_bytes_per_token: cannot size dtype {dtype!r}; pass dtype_bytes or use one "
        f"of {sorted(_DTYPE_BYTES)}"
      )
    dtype_bytes = _DTYPE_BYTES[dtype]
  mla = getattr(model, "mla", None)
  if mla is not None:
    return mla_kv_bytes_per_token(
      model.n_layers, mla.kv_lora_rank, mla.qk_rope_head_dim, dtype_bytes
    )
  return kv_bytes_per_token(model.n_layers, model.n_kv_heads, model.head_dim, dtype_bytes)


def attention_kind(model: Any) -> str:
  """The attention kind of a model config: MLA, MHA (K == N), MQA (K == 1) or GQA."""
  if getattr(model, "mla", None) is not None:
    return "MLA"
  if model.n_kv_heads == model.n_heads:
    return "MHA"
  return "MQA" if model.n_kv_heads == 1 else "GQA"


def mha_kv_bytes_per_token(model: Any, *, dtype_bytes: int) -> int:
  """Bytes per token if the same model cached a key and a value for every query head.

  Dense attention: 2 * L * N * H. MLA: L * N * ((Hn + R) + Hv), the per-head keys and values
  MLA decompresses from its latent (what a cache of expanded K/V would hold).
  """
  mla = getattr(model, "mla", None)
  if mla is None:
    return kv_bytes_per_token(model.n_layers, model.n_heads, model.head_dim, dtype_bytes)
  _check("dtype_bytes", dtype_bytes)
  per_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim
  return model.n_layers * model.n_heads * per_head * dtype_bytes


@dataclasses.dataclass(frozen=True)
class KVReportRow:
  name: str
  kind: str  # MHA, GQA, MQA or MLA
  bytes_per_token: int  # what the model's cache stores
  mha_bytes_per_token: int  # the same model caching K and V for every query head
  reduction: float  # mha_bytes_per_token / bytes_per_token


def kv_report(models: Mapping[str, Any], *, dtype_bytes: int = 2) -> list[KVReportRow]:
  """KV bytes per token of each named model config (MHA, GQA, MQA or MLA) against MHA."""
  rows = []
  for name, model in models.items():
    ours = config_kv_bytes_per_token(model, dtype_bytes=dtype_bytes)
    mha = mha_kv_bytes_per_token(model, dtype_bytes=dtype_bytes)
    rows.append(KVReportRow(name, attention_kind(model), ours, mha, mha / ours))
  return rows


def format_kv_report(rows: list[KVReportRow]) -> str:
  """A markdown table of `kv_report` rows."""
  lines = [
    "| model | attention | KV bytes/token | MHA bytes/token | reduction |",
    "|---|---|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
      f"| {r.name} | {r.kind} | {r.bytes_per_token:,} | {r.mha_bytes_per_token:,} | "
      f"{r.reduction:.2f}x |"
    )
  return "\n".join(lines)


def kv_bytes(bytes_per_token: int, n_tokens: int, *, batch: int = 1) -> int:
  """Cache bytes for `batch` sequences of `n_tokens` tokens each."""
  _check("bytes_per_token", bytes_per_token)
  _check("n_tokens", n_tokens, minimum=0)
  _check("batch", batch, minimum=0)
  return bytes_per_token * n_tokens * batch


def paged_pool_bytes(bytes_per_token: int, *, n_blocks: int, block_size: int) -> int:
  """Bytes of a paged pool of P blocks of Z slots."""
  _check("n_blocks", n_blocks)
  _check("block_size", block_size)
  return kv_bytes(bytes_per_token, n_blocks * block_size)


def utilisation(stats: _AllocatorCounters) -> float:
  """Slots holding real tokens / slots allocated to sequences (1.0 when nothing is allocated).

  A block shared by several sequences is one physical block and counts once on both sides.
  """
  allocated = stats.n_used * stats.block_size
  return 1.0 if allocated == 0 else stats.filled_slots / allocated


def prefix_hit_rate(stats: _AllocatorCounters) -> float:
  """Prompt tokens served from the prefix cache / prompt tokens looked up (0.0 before any)."""
  if stats.prefix_query_tokens == 0:
    return 0.0
  return stats.prefix_hit_tokens / stats.prefix_query_tokens


def preallocated_utilisation(lengths: list[int] | tuple[int, ...], *, max_length: int) -> float:
  """Utilisation when every sequence reserves `max_length` slots up front (the naive cache)."""
  _check("max_length", max_length)
  if not lengths:
    return 1.0
  return sum(lengths) / (len(lengths) * max_length)
