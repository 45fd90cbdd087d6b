"""`attention`: the one entry point the models call; it picks an implementation per call.

Implementations (all share the masking semantics documented in `kernels.reference`):

* "xla": pure jnp, which XLA fuses; runs everywhere. Causal self-attention in its default
  alignment (T == S, no query positions, no kv lengths) runs in query blocks that skip the
  masked triangle (`kernels.blocked`); every other call is the reference (`attention_reference`).
* "reference": `attention_reference` for every call, the whole [T, S] score matrix (what the
  planner's activation figures for "xla" count, tensor by tensor).
* "pallas": the tiled FlashAttention kernel (`kernels.flash_attention`), O(T) memory, every mask,
  logit soft-capping and attention sinks.
* "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, NVIDIA GPUs only, a subset of
  the masks (`cudnn_unsupported`).
* None: `select_implementation`, a pure function of the call and the platform:

  - CPU (or any other platform): "xla". Interpreting a Pallas kernel is slower than XLA there.
  - TPU: "pallas" for float32 / bfloat16 / float16, else "xla".
  - GPU: "cudnn" where its masking covers the call, since it was the fastest path measured on
    an H200 at every length (BENCHMARKS.md); otherwise "pallas", which takes every mask, so
    packed training batches (segment ids) run FlashAttention, never the O(T * S) reference;
    "xla" only for what neither takes (other dtypes, head dims past 256).

cuDNN's cover through jax's public API: bfloat16 or float16; head dim a multiple of 8, at most
128 (256 from Hopper, compute capability 9.0, on); no segment ids (jax's public function does not
expose cuDNN's packed layout); no explicit query positions; a causal mask only when T == S and
every key is valid, since cuDNN aligns the causal diagonal top-left and ours is bottom-right
relative to the valid keys; a sliding window only with the causal mask (cuDNN's window has no
right side, ours does without `causal`); no kv lengths (with the causal mask cuDNN's diagonal
ignores them; without it, rows of length zero, which must give zeros, are unchecked there); no
logit soft-cap and no attention sinks (the public function takes neither: a cap is not a bias,
and a sink column is not a key).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from . import flash_attention as flash
from .blocked import blocked_causal_attention
from .reference import attention_reference, check_attention_inputs

Array = jax.Array
Implementation = Literal["xla", "reference", "pallas", "cudnn"]
IMPLEMENTATIONS = ("xla", "reference", "pallas", "cudnn")
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class AttentionCall:
  """What the choice of implementation depends on: shapes, dtype and which masks are given."""

  dtype: jnp.dtype
  q_len: int  # T
  kv_len: int  # S
  head_dim: int  # H
  causal: bool = False
  segments: bool = False  # q_segment_ids / kv_segment_ids given (packed sequences)
  q_positions: bool = False
  kv_lengths: bool = False
  sliding_window: int | None = None
  soft_cap: float | None = None
  sinks: bool = False  # per-head sink logits given
  attention_chunk: int | None = None

  @classmethod
  def of(cls, q: Array, k: Array, **masking) -> AttentionCall:
    """The call `attention(q, k, v, **masking)` makes."""
    return cls(
      dtype=jnp.dtype(q.dtype),
      q_len=q.shape[1],
      kv_len=k.shape[1],
      head_dim=q.shape[-1],
      causal=bool(masking.get("causal", False)),
      segments=masking.get("q_segment_ids") is not None,
      q_positions=masking.get("q_positions") is not None,
      kv_lengths=masking.get("kv_lengths") is not None,
      sliding_window=masking.get("sliding_window"),
      soft_cap=masking.get("soft_cap"),
      sinks=masking.get("sinks") is not None,
      attention_chunk=masking.get("attention_chunk"),
    )


def cudnn_unsupported(
  call: AttentionCall, compute_capability: tuple[int, int] | None
) -> str | None:
  """Why cuDNN (through jax.nn.dot_product_attention) cannot run this call, or None if it can.

  Args:
    call: the call.
    compute_capability: the NVIDIA GPU's (major, minor), or None where there is no cuDNN.
  """
  if compute_capability is None:
    return "no NVIDIA GPU (cuDNN) on this platform"
  if call.dtype not in CUDNN_DTYPES:
    return f"cuDNN needs bfloat16 or float16, got {call.dtype}"
  max_head_dim = 256 if tuple(compute_capability) >= (9, 0) else 128
  if call.head_dim % 8 or call.head_dim > max_head_dim:
    return (
      f"cuDNN needs a head dim that is a multiple of 8 and at most {max_head_dim} on compute "
      f"capability {compute_capability}, got {call.head_dim}"
    )
  if call.segments:
    return "cuDNN's packed layout is not exposed by jax.nn.dot_product_attention (segment ids)"
  if call.q_positions:
    return "cuDNN takes no explicit q_positions"
  if call.causal and call.q_len != call.kv_len:
    # jax.nn.dot_product_attention aligns causal masks top-left; ours are bottom-right.
    return f"cuDNN needs T == S when causal, got T={call.q_len} S={call.kv_len}"
  if call.kv_lengths:
    # Causal: cuDNN's diagonal ignores the lengths (ours ends at each row's last valid key).
    # Not causal: a zero length must give zeros, which cuDNN's padding mask is not checked for.
    return "kv_lengths are not given to cuDNN (causal alignment, zero-length rows)"
  if call.sliding_window is not None and not call.causal:
    return "cuDNN's sliding window is causal; ours without causal=True also sees later keys"
  if call.soft_cap is not None:
    return "jax.nn.dot_product_attention takes no logit soft-cap (soft_cap)"
  if call.attention_chunk is not None:
    return "jax.nn.dot_product_attention takes no chunked mask (attention_chunk)"
  if call.sinks:
    return "jax.nn.dot_product_attention takes no attention sinks (sinks)"
  return None


def pallas_supports(call: AttentionCall, platform: str) -> bool:
  """Whether `flash_attention` compiles this call on `platform` (every mask is handled)."""
  if call.dtype not in flash.SUPPORTED_DTYPES:
    return False
  return not (platform == "gpu" and call.head_dim > flash.MAX_GPU_HEAD_DIM)


def select_implementation(
  call: AttentionCall, *, platform: str, compute_capability: tuple[int, int] | None = None
) -> Implementation:
  """The implementation `attention(..., implementation=None)` runs (see the module docstring).

  Args:
    call: the call (`AttentionCall.of(q, k, **masking)`).
    platform: "cpu", "gpu" or "tpu" ("cuda" and "rocm" count as "gpu").
    compute_capability: the NVIDIA GPU's (major, minor); None where there is no cuDNN.
  """
  platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
  if platform == "gpu":
    if cudnn_unsupported(call, compute_capability) is None:
      return "cudnn"
    return "pallas" if pallas_supports(call, platform) else "xla"
  if platform == "tpu" and pallas_supports(call, platform):
    return "pallas"
  return "xla"


def device_compute_capability() -> tuple[int, int] | None:
  """(major, minor) of the default device when it is an NVIDIA GPU, else None."""
  device = jax.devices()[0]
  capability = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or not capability:
    return None
  major, minor = str(capability).split(".")[:2]
  return int(major), int(minor)


def default_implementation(q: Array, k: Array | None = None, **masking) -> Implementation:
  """The implementation `attention(q, k, v, **masking)` picks on the default backend."""
  call = AttentionCall.of(q, q if k is None else k, **masking)
  return select_implementation(
    call, platform=jax.default_backend(), compute_capability=device_compute_capability()
  )


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
  soft_cap: float | None = None,
  sinks: Array | None = None,
  implementation: Implementation | None = None,
  interpret: bool | None = None,
  attention_chunk: int | None = None,
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
    soft_cap: c (a Python float > 0, static): scores pass through c * tanh(s / c) before the
      softmax (Gemma 2); None: not capped.
    sinks: f32[N] one learned logit per query head that joins the softmax's denominator as a
      column with no value (gpt-oss); differentiable; None: no sink.
    implementation: "xla", "reference", "pallas", "cudnn" or None (`select_implementation`).
    interpret: run a Pallas kernel in interpret mode (default: on CPU).
    attention_chunk: C, each query attends only within its own chunk of C positions (Llama 4's
      chunked local attention, `kernels.reference`); None: no chunks.

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
    soft_cap=soft_cap,
    sinks=sinks,
    attention_chunk=attention_chunk,
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
    soft_cap=soft_cap,
    sinks=sinks,
    attention_chunk=attention_chunk,
  )
  if soft_cap is not None:
    soft_cap = float(soft_cap)
    masking["soft_cap"] = soft_cap
  call = AttentionCall.of(q, k, **masking)
  if implementation is None:
    implementation = select_implementation(
      call, platform=jax.default_backend(), compute_capability=device_compute_capability()
    )

  if implementation == "xla":
    if causal and q.shape[1] == k.shape[1] and q_positions is None and kv_lengths is None:
      return blocked_causal_attention(
        q,
        k,
        v,
        scale=scale,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sinks=sinks,
        attention_chunk=attention_chunk,
      )
    return attention_reference(q, k, v, scale=scale, **masking)

  if implementation == "reference":
    return attention_reference(q, k, v, scale=scale, **masking)

  if implementation == "pallas":
    if not pallas_supports(call, jax.default_backend()):
      raise ValueError(
        "attention: implementation='pallas' does not support these inputs "
        f"(q.shape={tuple(q.shape)}, dtype={q.dtype}); use implementation='xla' or None"
      )
    if interpret is None:
      interpret = jax.default_backend() == "cpu"
    return flash.flash_attention(q, k, v, scale=scale, interpret=interpret, **masking)

  reason = cudnn_unsupported(call, device_compute_capability())
  if reason is not None:
    raise ValueError(
      f"attention: implementation='cudnn' cannot run this call (q.shape={tuple(q.shape)}, "
      f"k.shape={tuple(k.shape)}): {reason}; use implementation='pallas', 'xla' or None"
    )
  local_window = None if sliding_window is None else (sliding_window - 1, 0)
  return jax.nn.dot_product_attention(
    q,
    k,
    v,
    scale=scale,
    is_causal=causal,
    local_window_size=local_window,
    implementation="cudnn",
  )
