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

Served as they ship (`load(fp8_weights="keep")`, the default): a projection the model holds
quantized (`atlas_jax.quant.PROJECTIONS`: GQA and MLA attention, dense MLP, experts) keeps its
codes, moved into the model's layout by the family's own mapping (reshapes and transposes, which
move codes without arithmetic), and its scales as a qwix QArray's tiled scale: the block of every
element is tracked through the same mapping (`kept_weight`), and where the blocks land as a
rectangular grid of tiles, one scale per tile is kept. Where they do not (a block cut across the
layout's axes), or for any other FP8 tensor, the weight is multiplied by its scales in float32 and
cast to the compute dtype, as `dequantize_tensors` does for every weight with
`fp8_weights="dequantize"`. The log line says which weights were kept and which expanded.

Kept weights multiply weight-only or W8A8 (`atlas_jax.quant.quantized_product`), the
activations quantized to e4m3 per token by their own amax (dynamic) or, for folders with
activation_scheme "static", by the `*.input_scale` stored beside each weight (`resolve_activations`
picks; the kept weight is then a `StaticQArray` carrying its input scale). Static scales not used
(a dynamic or weight-only step, or a dequantized load) are counted in the log.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

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


def _check_method(hf: Mapping[str, Any]):
  """config.json's `quantization_config` (None when absent), its method checked."""
  q = hf.get("quantization_config")
  if q is None:
    return None
  if not isinstance(q, Mapping):
    raise HFLoadError(f"config.json field 'quantization_config'={q!r} must be an object")
  method = field(q, "quant_method", str, where="quantization_config.")
  if method not in METHODS:
    raise HFLoadError(
      f"config.json field 'quantization_config.quant_method'={method!r} is not supported; "
      f"supported: {', '.join(METHODS)} (other formats: dequantize them first)"
    )
  return q


def _weight_of(name: str) -> str:
  if name.endswith(WEIGHT_SCALE_SUFFIXES):
    return name.rsplit(".", 1)[0] + ".weight"
  return name.removesuffix("_scale_inv")  # fused experts (transformers v5)


@dataclasses.dataclass(frozen=True)
class Scales:
  """A folder's FP8 weights as they ship: weight name -> its scale (float32, as stored)."""

  by_weight: dict[str, np.ndarray]
  block: tuple[int, int] | None
  activation_scheme: str
  report: dict[str, list[str]] = dataclasses.field(
    default_factory=lambda: {"kept": [], "expanded": []}
  )
  # Static activation scales (`*.input_scale`, activation_scheme "static"): weight name -> its
  # float32 scalar; attached to the kept weights when the step runs W8A8 with them.
  inputs: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  # How the kept weights multiply (`resolve_activations`): "static" (W8A8 by `inputs`),
  # "dynamic" (W8A8, each token by its own amax) or "none" (weight-only).
  activations: str = "none"
  # Per-weight block sizes where they differ from `block` (a GGUF file's Q6_K tensors, 1 x 16,
  # beside its Q8_0/Q4_0 ones, 1 x 32).
  blocks: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

  def block_of(self, names) -> tuple[int, int] | None:
    """The block size of weights `names`, which one mapping reads together: one for all."""
    found = {self.blocks.get(n, self.block) for n in names}
    if len(found) > 1:
      raise HFLoadError(f"{', '.join(names)}: quantized in different block sizes {sorted(found)}")
    return found.pop()


def split_scales(
  tensors: Mapping[str, Any], hf: Mapping[str, Any], *, where: str | Path = ""
) -> tuple[dict[str, Any], Scales | None]:
  """The folder's tensors with the FP8 weights' codes left as stored and their scales (and any
  static activation scales) taken out, and the scales by weight; (tensors, None) when config.json
  has no `quantization_config`. Shapes are checked as `dequantize` checks them."""
  q = _check_method(hf)
  if q is None:
    return dict(tensors), None
  block = block_size(q)
  out = {n: t for n, t in tensors.items() if not n.endswith(ACTIVATION_SUFFIXES)}
  inputs = {}
  for name in (n for n in tensors if n.endswith(ACTIVATION_SUFFIXES)):
    base = name.rsplit(".", 1)[0] + ".weight"
    if base not in out:
      raise HFLoadError(f"{where}: activation scale {name} has no weight {base}")
    value = np.asarray(tensors[name], np.float32)
    if value.size != 1 or not np.isfinite(value).all() or float(value.reshape(())) <= 0:
      raise HFLoadError(
        f"{where}: activation scale {name} of shape {value.shape} is not allowed: "
        "one positive finite value per weight (a static per-tensor input scale)"
      )
    inputs[base] = value.reshape(())
  scales = {}
  for name in sorted(n for n in tensors if n.endswith(SCALE_SUFFIXES)):
    base = _weight_of(name)
    if base not in out:
      raise HFLoadError(f"{where}: scale {name} has no weight {base}")
    w = out[base]
    if jnp.asarray(w).dtype not in FP8_DTYPES:
      raise HFLoadError(
        f"{where}: {base} has dtype {w.dtype} but a scale {name}: expected an FP8 "
        "weight (float8_e4m3fn or float8_e5m2)"
      )
    s = np.asarray(out.pop(name), np.float32)
    _block_grid(w.shape, s, block, name=base)  # the shapes checked now, not when mapped
    scales[base] = s
  unscaled = [n for n, t in out.items() if jnp.asarray(t).dtype in FP8_DTYPES and n not in scales]
  if unscaled:
    raise HFLoadError(
      f"{where}: FP8 tensors without a scale (weight_scale_inv or weight_scale): "
      f"{', '.join(sorted(unscaled)[:8])}"
    )
  scheme = str(q.get("activation_scheme", "dynamic"))
  return out, Scales(scales, block, scheme, inputs=inputs)


def resolve_activations(scales: Scales, activations: str | None, backend: str) -> Scales:
  """`scales` with how its kept weights multiply: `activations` "static" (W8A8 by the folder's
  input scales, which it must have), "dynamic" (W8A8 per token) or "none" (weight-only), or
  None: W8A8 where `backend` has FP8 matmuls, static when every FP8 weight has an input
  scale."""
  from atlas_jax import platforms

  if activations is None:
    activations = "none"
    if platforms.has_fp8_matmuls(backend):
      every = scales.inputs and set(scales.by_weight) <= set(scales.inputs)
      activations = "static" if every else "dynamic"
  if activations == "static":
    missing = sorted(set(scales.by_weight) - set(scales.inputs))
    if missing:
      raise HFLoadError(
        f"fp8_activations='static' needs an input_scale beside every FP8 weight "
        f"(activation_scheme {scales.activation_scheme}); none for {', '.join(missing[:4])}"
        + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
      )
  return dataclasses.replace(scales, activations=activations)


def _block_grid(shape, scale: np.ndarray, block, *, name: str, start: int = 0) -> np.ndarray:
  """i64[scale.shape]: the index (from `start`) into the flattened scales of every scale of a
  weight of `shape`, the scale's shape checked against the weight's as `dequantize` applies it."""
  ids = np.arange(start, start + scale.size, dtype=np.int64).reshape(scale.shape)
  if block is not None and scale.size > 1:
    bn, bk = block
    out, inp = shape[-2:]
    want = (*shape[:-2], -(-out // bn), -(-inp // bk))
    if tuple(scale.shape) != want:
      raise HFLoadError(
        f"{name}: scale of shape {tuple(scale.shape)} for a weight of shape {tuple(shape)} in "
        f"{bn} x {bk} blocks; expected {want}"
      )
  elif scale.size > 1:
    try:
      np.broadcast_shapes(scale.shape, tuple(shape))
    except ValueError as e:
      raise HFLoadError(
        f"{name}: scale of shape {tuple(scale.shape)} does not broadcast against the weight's "
        f"{tuple(shape)} (config.json gives no weight_block_size)"
      ) from e
  return ids


def _expanded(grid: np.ndarray, shape, block) -> np.ndarray:
  """`grid` (one value per scale, any dtype) spread over a weight of `shape`, each element
  taking its block's value, by the rule `dequantize` applies the scales."""
  if block is not None and grid.size > 1:
    bn, bk = block
    out, inp = shape[-2:]
    return np.repeat(np.repeat(grid, bn, axis=-2), bk, axis=-1)[..., :out, :inp]
  return np.broadcast_to(grid.reshape(()) if grid.size == 1 else grid, shape)


def _changes(ids: np.ndarray) -> list[np.ndarray]:
  """Per axis, bool[n - 1]: whether `ids` differ anywhere between index i and i + 1."""
  out = []
  for a in range(ids.ndim):
    first = np.moveaxis(ids, a, 0)
    out.append(np.any(first[1:] != first[:-1], axis=tuple(range(1, ids.ndim))))
  return out


def _tile_sizes(changes: list[np.ndarray], shape) -> tuple[int, ...]:
  """Per axis, the largest run length dividing the axis and every distance between changes."""
  return tuple(
    int(np.gcd.reduce(np.append(np.flatnonzero(c) + 1, n)))
    for c, n in zip(changes, shape, strict=True)
  )


def _tiled(values: np.ndarray, tiles) -> np.ndarray | None:
  """`values` at each tile's first element when every tile holds one value, else None."""
  corner = values[tuple(slice(None, None, t) for t in tiles)]
  split = [d for n, t in zip(values.shape, tiles, strict=True) for d in (n // t, t)]
  spread = [d for n in corner.shape for d in (n, 1)]
  same = values.reshape(split) == corner.reshape(spread)
  return corner if bool(np.all(same)) else None


def _tiles(ids: np.ndarray) -> tuple[int, ...] | None:
  """Per axis, the run length over which `ids` is constant, when `ids` is one value per tile of
  a rectangular grid of such runs; None when no grid holds it (a block cut across axes)."""
  tiles = _tile_sizes(_changes(ids), ids.shape)
  return tiles if _tiled(ids, tiles) is not None else None


def kept_scales(out_sizes, in_sizes, block) -> int | None:
  """How many float32 scales `kept_weight` keeps for one stored [out, in] weight whose rows the
  model's layout splits into axes of `out_sizes` and whose columns into axes of `in_sizes` (each
  row-major, in the stored order); None when it dequantizes the weight instead. A block's id is
  row_block * blocks_per_row + column_block, so its tiles along the rows' axes depend on the
  row blocks alone and along the columns' on the column blocks alone: the tiles `_tiles` finds on
  the whole weight are those found on each side's block ids, O(out + in) values, not out x in.
  `block` None: one scale for the tensor."""
  sizes = (*out_sizes, *in_sizes)
  if block is None:
    tiles = sizes
  else:
    bn, bk = block
    rows = np.arange(int(np.prod(out_sizes)), dtype=np.int64) // bn
    cols = np.arange(int(np.prod(in_sizes)), dtype=np.int64) // bk
    row_tiles = _tiles(rows.reshape(tuple(out_sizes)))
    col_tiles = _tiles(cols.reshape(tuple(in_sizes)))
    if row_tiles is None or col_tiles is None:
      return None
    tiles = (*row_tiles, *col_tiles)
  if np.prod(tiles) < 32:
    return None
  return int(np.prod([n // t for n, t in zip(sizes, tiles, strict=True)]))


def kept_weight(
  load, codes: list, scales: list[np.ndarray], block, *, keep, dtype, names, inputs=None
):
  """One spec entry's parameters from FP8 tensors: `load` (the family's mapping of the stored
  tensors to {parameter path: value}) applied to the codes and, alongside, to each element's
  block index; a parameter `keep(path)` accepts whose blocks form a tile grid becomes a QArray
  of the codes and one float32 scale per tile, any other is dequantized to `dtype`. `inputs`
  (one static input scale per stored tensor): the kept weights are `StaticQArray`s carrying the
  largest (a scale too large for some of the tensors' inputs costs precision; one too small
  would clip them).

  The block indices travel through `load` a byte at a time (`planes`): one uint8 table of the
  codes' shape at a time, a byte per element as the codes themselves, where int32 indices for
  all of a layer's experts at once would be four times the codes' size, and as much again in
  each copy. The tiles found on the whole index are those found on its bytes together: it changes
  along an axis where any byte does, and is constant on a tile where every byte is.

  Returns ({path: value}, [(path, kept)])."""
  import qwix

  from atlas_jax.quant import StaticQArray

  grids, start = [], 0
  for c, s, n in zip(codes, scales, names, strict=True):
    grids.append(_block_grid(c.shape, s, block, name=n, start=start))
    start += s.size
  flat = np.concatenate([s.reshape(-1) for s in scales])
  mapped_codes = load(*[jnp.asarray(c) for c in codes])
  shapes = {path: tuple(q.shape) for path, q in mapped_codes.items()}

  def planes():
    """Per byte of the block indices (low first): {path: u8[its shape]}, as `load` maps it."""
    for k in range(max(1, (int(start - 1).bit_length() + 7) // 8)):
      table = [
        _expanded(((g >> (8 * k)) & 0xFF).astype(np.uint8), c.shape, block)
        for g, c in zip(grids, codes, strict=True)
      ]
      yield k, {p: np.asarray(v) for p, v in load(*[jnp.asarray(t) for t in table]).items()}
      del table

  # Where each parameter's block index changes along each axis: where any of its bytes does.
  changes = {p: [np.zeros(max(n - 1, 0), bool) for n in shape] for p, shape in shapes.items()}
  for _, mapped in planes():
    for path, plane in mapped.items():
      for acc, c in zip(changes[path], _changes(plane), strict=True):
        acc |= c
  # Kept when the scales add at most 1/8 of the codes' bytes (a tile of 32 elements or more), or
  # where the blocks themselves are smaller (GGUF's Q6_K groups of 16) a whole block a tile: edge
  # blocks that do not divide the layout's axes cut the grid finer, never per element.
  least = 32 if block is None else min(32, block[0] * block[1])
  tiles = {}
  for path, shape in shapes.items():
    t = _tile_sizes(changes[path], shape) if keep(path) else None
    tiles[path] = t if t is not None and np.prod(t) >= least else None
  # Each tile's block index, a byte at a time; a tile holding more than one block (some byte
  # not constant on it) leaves its weight to be dequantized, with each element's index.
  grid = {p: 0 for p, t in tiles.items() if t is not None}
  for k, mapped in planes():
    for path in list(grid):
      part = _tiled(mapped[path], tiles[path])
      if part is None:
        del grid[path]
      else:
        grid[path] = grid[path] + (part.astype(np.int64) << (8 * k))
  per_element = {p: 0 for p in shapes if p not in grid}
  if per_element:
    for k, mapped in planes():
      for path in per_element:
        per_element[path] = per_element[path] + (mapped[path].astype(np.int32) << (8 * k))
  out, done = {}, []
  for path, q in mapped_codes.items():
    if path in grid:
      scale = jnp.asarray(flat[grid[path]])
      if inputs is None:
        out[path] = qwix.QArray(q, scale, qtype=q.dtype)
      else:
        static = jnp.full((1,) * q.ndim, max(float(v) for v in inputs), jnp.float32)
        out[path] = StaticQArray(q, scale, qtype=q.dtype, input_scale=static)
      done.append((path, True))
    else:
      out[path] = (q.astype(jnp.float32) * jnp.asarray(flat[per_element[path]])).astype(dtype)
      done.append((path, False))
  return out, done


def log_kept(scales: Scales, where, *, dtype: str):
  """Logs which FP8 weights were kept and which expanded, and how the kept ones multiply
  (`scales.activations`, from `resolve_activations`); returns the model's `Ops` for that."""
  import jax

  from atlas_jax import platforms
  from atlas_jax.model.layers import Ops

  backend = jax.default_backend()
  kept, expanded = scales.report["kept"], scales.report["expanded"]
  blocks = f"{scales.block[0]}x{scales.block[1]} block scales" if scales.block else "per-tensor"
  how = {
    "static": "W8A8: activations quantized to e4m3 by the checkpoint's static input scales, "
    "FP8 matmuls accumulating in float32",
    "dynamic": "W8A8: activations quantized to e4m3 per token, FP8 matmuls accumulating in float32",
    "none": "weight-only: codes dequantized in the step's matmuls",
  }[scales.activations]
  unused = len(scales.inputs) if scales.activations != "static" else 0
  log.info(
    "%s: FP8 checkpoint (%s, activation_scheme %s): %d parameters kept in FP8 (%s; backend %s)"
    "; %d dequantized to %s at load%s%s",
    where,
    blocks,
    scales.activation_scheme,
    len(kept),
    how,
    backend,
    len(expanded),
    dtype,
    f" (their blocks do not tile the layout, or not a projection: {', '.join(expanded[:6])})"
    if expanded
    else "",
    f"; {unused} static activation scales unused" if unused else "",
  )
  return Ops(**platforms.model_ops(backend), w8a8=scales.activations != "none")


def dequantize_tensors(
  tensors: Mapping[str, Any],
  hf: Mapping[str, Any],
  *,
  dtype: str = "float32",
  where: str | Path = "",
) -> dict[str, Any]:
  """The folder's tensors with every FP8 weight dequantized to `dtype` and its scales gone; as
  they are when config.json has no `quantization_config`."""
  q = _check_method(hf)
  if q is None:
    return dict(tensors)
  block = block_size(q)
  out = dict(tensors)
  dropped = [n for n in tensors if n.endswith(ACTIVATION_SUFFIXES)]
  for n in dropped:
    del out[n]
  count = 0
  for name in sorted(n for n in tensors if n.endswith(SCALE_SUFFIXES)):
    base = _weight_of(name)
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
