"""Kernels: arrays in, arrays out, each beside a pure-jnp reference of the same signature.

Installed as `atlas_jax.kernels`. Models call `attention`, which dispatches to "xla" (the
reference), "pallas" (FlashAttention) or "cudnn" (`attention.select_implementation` picks one
per call when none is named); paged caches call `ragged_paged_attention` (every new token of a
call over its sequence's pages, read in place: decode tokens, speculative rounds and prompt
chunks alike). `paged_attention` and `kernels.mla_decode.mla_decode` are the decode-only kernels
(one or a few tokens per sequence), kept for callers with a rows layout.

Beside the masks, every attention over K/V (all of the above but MLA's) takes `soft_cap` (scores
through c * tanh(s / c), Gemma 2) and `sinks` (a valueless softmax column per query head,
gpt-oss), with the semantics of `kernels.reference`.
"""

from .attention import IMPLEMENTATIONS, attention, default_implementation
from .flash_attention import flash_attention
from .paged_attention import paged_attention, paged_attention_reference, paged_attention_xla
from .ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference
from .reference import attention_mask, attention_reference

__all__ = [
  "IMPLEMENTATIONS",
  "attention",
  "attention_mask",
  "attention_reference",
  "default_implementation",
  "flash_attention",
  "paged_attention",
  "paged_attention_reference",
  "paged_attention_xla",
  "ragged_paged_attention",
  "ragged_paged_attention_reference",
]
