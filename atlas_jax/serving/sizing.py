"""The pool sized from device memory, and the batch from the pool, as vLLM users expect.

Per device (every device of a mesh holds the same share): the pool gets what the weights and the
largest step's activations leave,

    pool bytes = gpu_memory_utilization x memory - weights - activations    (the default)
    pool bytes = kv_cache_memory x (memory - weights - activations)           (a fraction)
    pool bytes = kv_cache_memory                                              (bytes)

and holds pool bytes // block bytes blocks per replica, where a block's bytes are per shard: a
KV pool's kv heads split over the tensor axis, so a block costs 1 / tensor of its unsharded
bytes on each device (sizing with the unsharded head count would give a pool tensor times too
small). `weights` are the placed weights' bytes on the most loaded device (or what the device
reports in use, if more); `activations` the temporaries of the largest step, read from its
compiled program (`jax.stages.Compiled.memory_analysis`): the token budget in prefill chunks,
over a block table as wide as the context.

A model mixing sliding-window and full-attention layers keeps the windowed layers' blocks in a
pool of their own (`split_window_pool`): the same bytes, split so that the windowed layers hold
every running request's window and the full-attention layers the rest.

Where a device does not report its memory (a CPU), the pool holds `FULL_CONTEXTS_WITHOUT_MEMORY`
full contexts unless bytes are given. `max_num_seqs` defaults to what the pool holds at a typical
length (`TYPICAL_TOKENS`, or the context if shorter), at most `MAX_DEFAULT_SEQS` (and at most
`max_num_batched_tokens` where that is given: one decode token per running request).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from atlas_jax.config import ConfigError, EngineConfig

TYPICAL_TOKENS = 2048  # a typical request's prompt + output, for the default batch
MAX_DEFAULT_SEQS = 256  # vLLM's default max_num_seqs
FULL_CONTEXTS_WITHOUT_MEMORY = 8
DEFAULT_BATCHED_TOKENS = 512


def device_memory(device: jax.Device) -> tuple[int, int] | None:
  """(bytes the device can allocate, bytes in use), or None where it does not say (a CPU)."""
  stats = device.memory_stats()
  if not stats or "bytes_limit" not in stats:
    return None
  return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


@dataclasses.dataclass(frozen=True)
class PoolSize:
  """How the pool was sized, for the start-up log and the tests."""

  n_blocks: int  # per replica (each device holds this many)
  how: str  # what decided it
  pool_bytes: int  # per device, the blocks' bytes
  block_bytes: int  # per device, one block of every pool
  memory: int | None = None  # the device's memory, where it says
  used: int | None = None  # weights (or what the device had in use) per device
  activations: int | None = None  # the largest step's temporaries per device


def size_pool(
  config: EngineConfig,
  *,
  block_bytes: int,
  weight_bytes: int,
  memory: tuple[int, int] | None,
  activations: Callable[[], int],
  max_model_len: int,
  platform: str,
) -> PoolSize:
  """The pool's blocks per replica for `config` (see the module docstring).

  Args:
    block_bytes: bytes of one block of every pool on one device (per shard).
    weight_bytes: the placed weights' bytes on the most loaded device.
    memory: `device_memory` of the first device, or None.
    activations: the largest step's temporaries per device (called only when needed: it
      compiles that step).

  Raises:
    ConfigError naming serve.engine's field when a pool sized from memory would not hold one
    full context (bytes: one block), or a fraction is asked of a device that does not report
    its memory.
  """
  Z = config.block_size
  per_context = -(-max_model_len // Z)
  m = config.kv_cache_memory
  if config.n_blocks is not None:
    n, how = config.n_blocks, "serve.engine.n_blocks"
    size = PoolSize(n, how, n * block_bytes, block_bytes)
  elif m is not None and m > 1:
    n = int(m) // block_bytes
    size = PoolSize(n, f"serve.engine.kv_cache_memory={int(m)} bytes", n * block_bytes, block_bytes)
  elif memory is None:
    if m is not None:
      raise ConfigError(
        f"serve.engine.kv_cache_memory={m} is not allowed: a fraction of device memory, which "
        f"{platform} devices do not report; give bytes per device (a number > 1) or "
        "serve.engine.n_blocks"
      )
    n = FULL_CONTEXTS_WITHOUT_MEMORY * per_context
    how = f"{FULL_CONTEXTS_WITHOUT_MEMORY} full contexts ({platform} devices report no memory)"
    size = PoolSize(n, how, n * block_bytes, block_bytes)
  else:
    limit, in_use = memory
    used = max(weight_bytes, in_use)
    act = activations()
    if m is not None:
      pool = int(m * (limit - used - act))
      how = f"serve.engine.kv_cache_memory={m} of the memory left"
    else:
      u = config.gpu_memory_utilization
      pool = int(u * limit) - used - act
      how = f"serve.engine.gpu_memory_utilization={u}"
    n = max(0, pool) // block_bytes
    size = PoolSize(n, how, n * block_bytes, block_bytes, limit, used, act)
  least = per_context if size.memory is not None else 1
  if config.n_blocks is None and size.n_blocks < least:
    raise ConfigError(
      f"{size.how} gives a pool of {size.n_blocks} blocks of {Z} tokens per device, less than "
      f"one context of serve.engine.max_model_len={max_model_len} tokens ({per_context} "
      "blocks): shorten the context, give the pool more memory, or split the model over more "
      "tensor-parallel devices"
    )
  return size


def split_window_pool(
  n_blocks: int,
  *,
  n_layers: int,
  n_windowed: int,
  request_blocks: int,
  max_num_seqs: int | None,
  block_size: int,
  max_model_len: int,
) -> tuple[int, int]:
  """(full-attention layers' blocks, windowed layers' blocks) per replica for a model mixing
  the two (`atlas_jax.cache.paged.HybridPool`), in the memory of `n_blocks` blocks of every
  layer. A block of the one pool costs the full-attention layers' bytes, of the other the
  windowed layers'; a request holds at most `request_blocks` in the windowed pool (its window
  and what one step adds). The windowed layers get what the batch's requests hold there: all
  `max_num_seqs` at their most, or, unset, as many requests of a typical length (as
  `default_max_num_seqs` counts) as the memory holds with each layer holding its share; never
  more than `n_blocks`. The full-attention layers get the rest.
  """
  if not 0 < n_windowed < n_layers:
    raise ValueError(f"split_window_pool: {n_windowed} windowed layers of {n_layers}")
  n_full_layers = n_layers - n_windowed
  seats = max_num_seqs
  if seats is None:
    typical = -(-min(max_model_len, TYPICAL_TOKENS) // block_size)
    per_request = n_full_layers * typical + n_windowed * min(typical, request_blocks)
    seats = max(1, min(MAX_DEFAULT_SEQS, n_blocks * n_layers // per_request))
  n_window = min(n_blocks, seats * request_blocks)
  return n_blocks + (n_blocks - n_window) * n_windowed // n_full_layers, n_window


def default_max_num_seqs(n_blocks: int, block_size: int, max_model_len: int) -> int:
  """What the pool holds at a typical length, at least 1, at most MAX_DEFAULT_SEQS."""
  typical = min(max_model_len, TYPICAL_TOKENS)
  return max(1, min(MAX_DEFAULT_SEQS, n_blocks * block_size // typical))


def reserved_seats(n_blocks: int, block_size: int, max_model_len: int) -> int:
  """The requests a pool of `n_blocks` runs at once when each reserves a whole context."""
  return n_blocks // -(-max_model_len // block_size)


def resolve(config: EngineConfig, n_blocks: int, max_model_len: int, k: int) -> EngineConfig:
  """`config` with every field the engine sizes filled in."""
  seqs = config.max_num_seqs
  if seqs is None:  # what the pool holds, within a token budget that was given
    seqs = default_max_num_seqs(n_blocks, config.block_size, max_model_len)
    seqs = min(seqs, config.max_num_batched_tokens or seqs)
  if config.preallocate:
    # The reservations are the admission rule: a seat is a whole context's blocks.
    seats = reserved_seats(n_blocks, config.block_size, max_model_len)
    if seats < 1:
      raise ConfigError(
        f"serve.engine.preallocate=True reserves {max_model_len} tokens per request, more than "
        f"the pool's {n_blocks} blocks of {config.block_size} tokens hold: give the pool more "
        "blocks or shorten serve.engine.max_model_len"
      )
    seqs = seats if config.max_num_seqs is None else min(config.max_num_seqs, seats)
    config = dataclasses.replace(config, enable_prefix_caching=False)
  budget = config.max_num_batched_tokens or max(DEFAULT_BATCHED_TOKENS, seqs)
  return dataclasses.replace(
    config,
    n_blocks=n_blocks,
    max_num_seqs=seqs,
    max_num_batched_tokens=budget,
    max_model_len=max_model_len,
    num_speculative_tokens=k,
  )
