"""MXFP4 Hugging Face folders: config.json's `quantization_config` with `quant_method: mxfp4`, as
the released gpt-oss checkpoints store their experts.

A quantized tensor `W` [*, rows, cols] is stored as `W_blocks` u8[*, rows, cols / 32, 16] and
`W_scales` u8[*, rows, cols / 32]: each byte holds two FP4 (e2m1) codes, the low nibble first,
each 32 consecutive values of a row share one power-of-two scale 2 ** (scale - 127). gpt-oss
stores its experts' weights out-major ([E, 2F, D] for `gate_up_proj`, [E, D, F] for `down_proj`);
the dequantized tensor is transposed to transformers' float layout ([E, D, 2F], [E, F, D]), the
one its float checkpoints hold, so the family's table reads either.

Loading dequantizes exactly (every FP4 value times a power of two is representable in bfloat16
and float32) and serves the weights in the compute dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from atlas_jax.hf.common import HFLoadError

log = logging.getLogger(__name__)

# e2m1: sign, two exponent bits, one mantissa bit.
FP4_VALUES = np.array(
  [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
  np.float32,
)
BLOCKS, SCALES = "_blocks", "_scales"


def applies(hf: Mapping[str, Any]) -> bool:
  q = hf.get("quantization_config")
  return isinstance(q, Mapping) and q.get("quant_method") == "mxfp4"


def dequantize(blocks, scales, *, name: str = "weight") -> np.ndarray:
  """f32[*, rows, cols]: u8 blocks [*, rows, G, 16] and u8 scales [*, rows, G], cols = 32 G."""
  blocks, scales = np.asarray(blocks), np.asarray(scales)
  if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
    raise HFLoadError(
      f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
    )
  if blocks.ndim < 2 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
    raise HFLoadError(
      f"{name}: MXFP4 blocks {blocks.shape} must be [..., G, 16] with scales {scales.shape} "
      "[..., G]"
    )
  values = np.empty((*blocks.shape[:-1], 32), np.float32)
  values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
  values[..., 1::2] = FP4_VALUES[blocks >> 4]
  values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
  return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def dequantize_tensors(
  tensors: Mapping[str, Any], *, dtype: str = "float32", where: str | Path = ""
) -> dict[str, Any]:
  """The folder's tensors with every `*_blocks` / `*_scales` pair replaced by its dequantized
  float tensor (its last two axes swapped to the float checkpoint's layout), in `dtype`."""
  out = dict(tensors)
  count = 0
  for name in sorted(n for n in tensors if n.endswith(BLOCKS)):
    base = name.removesuffix(BLOCKS)
    if base + SCALES not in out:
      raise HFLoadError(f"{where}: MXFP4 blocks {name} have no scales {base + SCALES}")
    w = dequantize(out.pop(name), out.pop(base + SCALES), name=base)
    out[base] = jnp.asarray(np.swapaxes(w, -1, -2), dtype)
    count += 1
  stray = sorted(n for n in out if n.endswith(SCALES))
  if stray:
    raise HFLoadError(f"{where}: MXFP4 scales without blocks: {', '.join(stray[:8])}")
  log.info("%s: MXFP4 checkpoint: %d tensors dequantized to %s at load", where, count, dtype)
  return out
