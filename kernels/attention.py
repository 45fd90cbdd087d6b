"""`attention`: the one entry point the models call; it picks an implementation per backend.

Implementations (all share the masking semantics documented in `kernels.reference`):

* "xla": the pure-jnp reference (`attention_reference`), which XLA fuses; runs everywhere.
* "pallas": the tiled FlashAttention kernel (`kernels.flash_attention`), O(T) memory.
* "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, NVIDIA GPUs only.
* None: the best available for the default backend, falling back to "xla" when the chosen
  implementation cannot express the requested masking.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from . import flash_attention as flash
from .reference import attention_reference, check_attention_inputs

Array = jax.Array
Implementation = Literal["xla", "pallas", "cudnn"]
IMPLEMENTATIONS = ("xla", "pallas", "cudnn")


def default_implementation(q: Array, **masking) -> Implementation:
  """The implementation `attention(..., implementation=None)` picks for these inputs."""
  platform = jax.default_backend()
  if platform in ("gpu", "tpu") and flash.supports(q, **masking):
    return "pallas"
  return "xla"


def attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  causal: bool = False,
  scale: float | None = None,
  q_segment_ids: Array | None = None,
  kv_segment_ids: Array | None = None,
  sliding_window: int | None = None,
  q_positions: Array | None = None,
  kv_lengths: Array | None = None,
  implementation: Implementation | None = None,
  interpret: bool | None = None,
) -> Array:
  """Multi-head attention with grouped K/V heads (MHA, GQA, MQA).

  Args:
    q: [B, T, N, H] queries.
    k: [B, S, K, H] keys; N must be a multiple of K.
    v: [B, S, K, H] values.
    causal: mask keys after each query's position.
    scale: softmax scale, default H ** -0.5.
    q_segment_ids: i32[B, T], with kv_segment_ids i32[B, S]: attend only within a segment.
    sliding_window: attend only to the last `sliding_window` positions (inclusive of the query).
    q_positions: i32[B, T] absolute query positions (default: the last T valid keys).
    kv_lengths: i32[B] number of valid keys per sequence (default: all S).
    implementation: "xla", "pallas", "cudnn" or None (best available).
    interpret: run a Pallas kernel in interpret mode (default: on CPU).

  Returns:
    [B, T, N, H] in q.dtype.
  """
  masking = dict(
    causal=causal,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    sliding_window=sliding_window,
    q_positions=q_positions,
    kv_lengths=kv_lengths,
  )
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"attention: implementation={implementation!r} is not one of {IMPLEMENTATIONS} or None"
    )
  check_attention_inputs(
    q,
    k,
    v,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    q_positions=q_positions,
    kv_lengths=kv_lengths,
    sliding_window=sliding_window,
  )
  if implementation is None:
    implementation = default_implementation(q, **masking)

  if implementation == "xla":
    return attention_reference(q, k, v, scale=scale, **masking)

  if implementation == "pallas":
    if not flash.supports(q, **masking):
      raise ValueError(
        "attention: implementation='pallas' does not support these inputs "
        f"(q.shape={tuple(q.shape)}, dtype={q.dtype}); use implementation='xla' or None"
      )
    if interpret is None:
      interpret = jax.default_backend() == "cpu"
    return flash.flash_attention(q, k, v, scale=scale, interpret=interpret, **masking)

  # cuDNN through jax.nn.dot_product_attention: it takes GQA natively, but only a subset of masks.
  if q_positions is not None or q_segment_ids is not None:
    raise ValueError(
      "attention: implementation='cudnn' does not take q_positions or segment ids; "
      "use implementation='xla' or 'pallas'"
    )
  if causal and q.shape[1] != k.shape[1]:
    # jax.nn.dot_product_attention aligns causal masks top-left; ours are bottom-right.
    raise ValueError(
      f"attention: implementation='cudnn' needs T == S when causal, got T={q.shape[1]} "
      f"S={k.shape[1]}; use implementation='xla' or 'pallas'"
    )
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"attention: implementation='cudnn' needs bfloat16 or float16, got {q.dtype}")
  local_window = None if sliding_window is None else (sliding_window - 1, 0)
  return jax.nn.dot_product_attention(
    q,
    k,
    v,
    scale=scale,
    is_causal=causal,
    local_window_size=local_window,
    key_value_seq_lengths=kv_lengths,
    implementation="cudnn",
  )
