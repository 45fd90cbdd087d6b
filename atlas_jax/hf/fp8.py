"""FP8 Hugging Face folders: config.json's `quantization_config` with `quant_method: fp8`, as
DeepSeek-V3/R1 and transformers' FP8 quantizer write them.

Each quantized projection is stored as an e4m3 (or e5m2) `*.weight` beside its float32 scale:
`*.weight_scale_inv` (a multiplier despite its name: DeepSeek's and transformers' convention) or
`*.weight_scale` (per-tensor checkpoints); transformers v5's fused experts store
`mlp.experts.gate_up_proj` beside `mlp.experts.gate_up_proj_scale_inv`, [E, ...] both.

With `weight_block_size: [bn, bk]` (absent: transformers' [128, 128]) the scale holds one value
per bn x bk block of the [out, in] weight, [ceil(out / bn), ceil(in / bk)], the last blocks
partial; with `null`, or a one-value scale, one value per tensor (or any shape that broadcasts,
e.g. per output row).

Loading multiplies each block by its scale in float32 and casts to the compute dtype: the weights
are served dequantized (weight-only; activations stay in the compute dtype whatever
`activation_scheme` says, and static activation scales are dropped), as the log line says. A
kept-quantized form would start from `dequantize_tensors`' inputs: the e4m3 codes and their block
scales.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from atlas_jax.hf.common import HFLoadError, field

log = logging.getLogger(__name__)

METHODS = ("fp8",)
FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
WEIGHT_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
SCALE_SUFFIXES = (*WEIGHT_SCALE_SUFFIXES, "_proj_scale_inv")
ACTIVATION_SUFFIXES = (".input_scale", ".activation_scale")


def block_size(q: Mapping[str, Any]) -> tuple[int, int] | None:
  """`quantization_config.weight_block_size` checked: None (null: per-tensor scales), or two
  positive integers; absent, transformers' default [128, 128]."""
  value = q.get("weight_block_size", [128, 128])
  if value is None:
    return None
  if (
    not isinstance(value, list | tuple)
    or len(value) != 2
    or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value)
  ):
    raise HFLoadError(
      f"config.json field 'quantization_config.weight_block_size'={value!r} is not allowed: "
      "must be null or two positive integers [out, in]"
    )
  return int(value[0]), int(value[1])


def dequantize(w, scale, block: tuple[int, int] | None, *, name: str = "weight"):
  """`w` (fp8, [..., out, in]) times its scale, in float32: one scale per `block` of the last
  two dimensions, or a scale that broadcasts (per tensor, per row) when `block` is None."""
  w32 = jnp.asarray(w).astype(jnp.float32)
  s = jnp.asarray(scale).astype(jnp.float32)
  if block is not None and s.size > 1:
    bn, bk = block
    out, inp = w32.shape[-2:]
    want = (*w32.shape[:-2], -(-out // bn), -(-inp // bk))
    if tuple(s.shape) != want:
      raise HFLoadError(
        f"{name}: scale of shape {tuple(s.shape)} for a weight of shape {tuple(w32.shape)} in "
        f"{bn} x {bk} blocks; expected {want}"
      )
    s = jnp.repeat(jnp.repeat(s, bn, axis=-2), bk, axis=-1)[..., :out, :inp]
    return w32 * s
  if s.size == 1:
    return w32 * s.reshape(())
  try:
    return w32 * s
  except (ValueError, TypeError) as e:
    raise HFLoadError(
      f"{name}: scale of shape {tuple(s.shape)} does not broadcast against the weight's "
      f"{tuple(w32.shape)} (config.json gives no weight_block_size)"
    ) from e


def dequantize_tensors(
  tensors: Mapping[str, Any],
  hf: Mapping[str, Any],
  *,
  dtype: str = "float32",
  where: str | Path = "",
) -> dict[str, Any]:
  """The folder's tensors with every FP8 weight dequantized to `dtype` and its scales gone; as
  they are when config.json has no `quantization_config`."""
  q = hf.get("quantization_config")
  if q is None:
    return dict(tensors)
  if not isinstance(q, Mapping):
    raise HFLoadError(f"config.json field 'quantization_config'={q!r} must be an object")
  method = field(q, "quant_method", str, where="quantization_config.")
  if method not in METHODS:
    raise HFLoadError(
      f"config.json field 'quantization_config.quant_method'={method!r} is not supported; "
      f"supported: {', '.join(METHODS)} (other formats: dequantize them first)"
    )
  block = block_size(q)
  out = dict(tensors)
  dropped = [n for n in tensors if n.endswith(ACTIVATION_SUFFIXES)]
  for n in dropped:
    del out[n]
  count = 0
  for name in sorted(n for n in tensors if n.endswith(SCALE_SUFFIXES)):
    if name.endswith(WEIGHT_SCALE_SUFFIXES):
      base = name.rsplit(".", 1)[0] + ".weight"
    else:  # fused experts (transformers v5): mlp.experts.gate_up_proj_scale_inv
      base = name.removesuffix("_scale_inv")
    if base not in out:
      raise HFLoadError(f"{where}: scale {name} has no weight {base}")
    if jnp.asarray(out[base]).dtype not in FP8_DTYPES:
      raise HFLoadError(
        f"{where}: {base} has dtype {out[base].dtype} but a scale {name}: expected an FP8 "
        "weight (float8_e4m3fn or float8_e5m2)"
      )
    scale = out.pop(name)
    out[base] = dequantize(out[base], scale, block, name=base).astype(dtype)
    count += 1
  unscaled = [n for n, t in out.items() if jnp.asarray(t).dtype in FP8_DTYPES]
  if unscaled:
    raise HFLoadError(
      f"{where}: FP8 tensors without a scale (weight_scale_inv or weight_scale): "
      f"{', '.join(sorted(unscaled)[:8])}"
    )
  blocks = f"{block[0]}x{block[1]} block scales" if block else "per-tensor scales"
  log.info(
    "%s: FP8 checkpoint (%s, activation_scheme %s): %d weights dequantized to %s at load "
    "(weight-only%s)",
    where,
    blocks,
    q.get("activation_scheme", "dynamic"),
    count,
    dtype,
    f"; {len(dropped)} static activation scales unused" if dropped else "",
  )
  return out
