"""Kernels: arrays in, arrays out, each beside a pure-jnp reference of the same signature.

Installed as `atlas_jax.kernels`. Models call `attention`, which dispatches to "xla" (the
reference), "pallas" (FlashAttention) or "cudnn" (`attention.select_implementation` picks one
per call when none is named); caches call the decode kernels `paged_attention` and
`kernels.mla_decode.mla_decode`.
"""

from .attention import IMPLEMENTATIONS, attention, default_implementation
from .flash_attention import flash_attention
from .paged_attention import paged_attention, paged_attention_reference, paged_attention_xla
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
]
