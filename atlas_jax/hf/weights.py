"""Stored tensors <-> our parameters, for every family: one table, read both ways.

A family describes its checkpoint as `Group`s of `Weights`: the tensors under one prefix
("model.layers.3.", or "" for the embedding, final norm and head) and, for each, the block
parameters they hold. A layer's group goes to one index of one of our stacks (`blocks`,
`dense_blocks`, the MTP heads), as `atlas_jax.model.transformer.layer_stacks` places it. The same
table drives import (every expected tensor present, no unexpected one, each shape exactly as
config.json implies before anything is reshaped, then converted and stacked) and export (each
stored tensor rebuilt from the parameters).

A `Weights` may read several stored tensors (per-expert tensors stacked into one [E, ...]
parameter) or fill several parameters from one (a fused `gate_up_proj`; MLA's `kv_b_proj`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from atlas_jax.config import ModelConfig
from atlas_jax.hf import fp8
from atlas_jax.hf.common import HFLoadError, read_json
from atlas_jax.model import Transformer, build
from atlas_jax.model.transformer import layer_stacks
from atlas_jax.quant import PROJECTIONS, QArray, dequantized

Array = Any  # a jax array when importing, numpy when exporting
Where = tuple[str, ...]  # a parameter's path inside a block (or the model)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class Weights:
  """Stored tensors (names after their group's prefix) and the parameters they hold."""

  names: tuple[str, ...]
  shape: tuple[int, ...]  # each stored tensor's shape, torch's [out, in] layout
  legend: str  # what each dimension is in config.json
  load: Callable[..., dict[Where, Array]]  # the stored tensors -> {parameter path: value}
  save: Callable[[Mapping[Where, np.ndarray]], tuple[np.ndarray, ...]]  # and back


def weight(
  name: str,
  shape: tuple[int, ...],
  legend: str,
  where: Where,
  load: Callable = lambda w: w,
  save: Callable = lambda w: w,
) -> Weights:
  """One stored tensor holding one parameter: `load` maps torch's layout to ours, `save` back."""
  return Weights(
    (name,), tuple(shape), legend, lambda w: {where: load(w)}, lambda p: (save(p[where]),)
  )


def linear(name: str, out: int, inp: int, legend: str, where: Where) -> Weights:
  """A bias-free nn.Linear [out, in] held as our [in, out]."""
  return weight(name, (out, inp), legend, where, lambda w: w.T, lambda w: w.T)


def norm(name: str, dim: int, legend: str, where: Where) -> Weights:
  return weight(name, (dim,), legend, where)


def out_proj(name: str, N: int, H: int, D: int, legend: str) -> Weights:
  """Attention's output projection [D, N * H] held as [N, H, D] (H: a head's value dim)."""
  return weight(
    name,
    (D, N * H),
    f"hidden_size, {legend}",
    ("attn", "wo"),
    lambda w: w.T.reshape(N, H, D),
    lambda w: w.reshape(N * H, D).T,
  )


@dataclasses.dataclass(frozen=True)
class Group:
  """The stored tensors under one prefix and where their parameters go."""

  prefix: str  # "model.layers.3.", or "" for the model's own tensors
  stack: Where  # our stack's path (("blocks",)); () for the model's own parameters
  index: int  # the index in that stack
  weights: tuple[Weights, ...]


@dataclasses.dataclass(frozen=True)
class Spec:
  """A checkpoint's whole table."""

  groups: tuple[Group, ...]
  ignored: frozenset[str] = frozenset()  # stored names that are read by nothing (copies)

  def shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every expected tensor's full name -> (shape, legend)."""
    return {
      g.prefix + name: (w.shape, w.legend)
      for g in self.groups
      for w in g.weights
      for name in w.names
    }


def trunk_groups(cfg: ModelConfig, layer: Callable[[int, str], tuple[Weights, ...]]):
  """A Group per trunk layer, `layer(i, prefix)` giving its weights, in the stack the model
  keeps it in."""
  return tuple(
    Group(f"model.layers.{i}.", (stack,), index, layer(i, f"model.layers.{i}."))
    for i, (stack, index) in enumerate(layer_stacks(cfg))
  )


def model_group(cfg: ModelConfig) -> Group:
  """The embedding, the final norm and (untied) the output head."""
  D, V = cfg.d_model, cfg.vocab_size
  weights = [
    weight("model.embed_tokens.weight", (V, D), "vocab_size, hidden_size", ("embed",)),
    norm("model.norm.weight", D, "hidden_size", ("final_norm", "scale")),
  ]
  if not cfg.tie_embeddings:
    weights.append(linear("lm_head.weight", V, D, "vocab_size, hidden_size", ("lm_head",)))
  return Group("", (), 0, tuple(weights))


# ---------------------------------------------------------------------------------------------
# The feed-forward tensors every family stores alike (names vary; the layouts do not).


def swiglu(prefix: str, D: int, F: int, legend_f: str, where: Where, *, names=None) -> list:
  """A dense SwiGLU MLP: gate_proj, up_proj [F, D], down_proj [D, F] (or other `names`)."""
  gate, up, down = names or ("gate_proj", "up_proj", "down_proj")
  d = "hidden_size"
  return [
    linear(f"{prefix}.{gate}.weight", F, D, f"{legend_f}, {d}", (*where, "w_gate")),
    linear(f"{prefix}.{up}.weight", F, D, f"{legend_f}, {d}", (*where, "w_up")),
    linear(f"{prefix}.{down}.weight", D, F, f"{d}, {legend_f}", (*where, "w_down")),
  ]


@dataclasses.dataclass(frozen=True)
class ExpertNames:
  """Where a family stores its routed experts, after the layer prefix, in both layouts."""

  router: str = "mlp.gate.weight"  # [E, D]
  per_expert: str = "mlp.experts.{e}.{proj}.weight"  # [F, D] / [D, F] per expert
  projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
  fused: str = "mlp.experts"  # transformers v5: {fused}.gate_up_proj [E, 2F, D], .down_proj
  fused_router: str = "mlp.gate.weight"


def experts(
  prefix: str,
  E: int,
  D: int,
  F: int,
  *,
  names: ExpertNames,
  fused: bool,
  legend_f: str = "moe_intermediate_size",
) -> list[Weights]:
  """The router and the routed experts of an MoE layer, per-expert tensors or fused ones."""
  d, e = "hidden_size", "num_experts"
  router = names.fused_router if fused else names.router
  out = [linear(router, E, D, f"{e}, {d}", ("mlp", "router"))]
  swap = lambda w: w.transpose(0, 2, 1)  # [E, out, in] <-> [E, in, out]
  if fused:
    gate_up = f"{names.fused}.gate_up_proj"
    out.append(
      Weights(
        (gate_up,),
        (E, 2 * F, D),
        f"{e}, 2 * {legend_f}, {d}",
        lambda w: {("mlp", "w_gate"): swap(w[:, :F]), ("mlp", "w_up"): swap(w[:, F:])},
        lambda p: (np.concatenate([swap(p["mlp", "w_gate"]), swap(p["mlp", "w_up"])], 1),),
      )
    )
    out.append(
      weight(
        f"{names.fused}.down_proj",
        (E, D, F),
        f"{e}, {d}, {legend_f}",
        ("mlp", "w_down"),
        swap,
        swap,
      )
    )
    return out
  for proj, ours, shape, legend in zip(
    names.projections,
    ("w_gate", "w_up", "w_down"),
    ((F, D), (F, D), (D, F)),
    (f"{legend_f}, {d}", f"{legend_f}, {d}", f"{d}, {legend_f}"),
  ):
    where = ("mlp", ours)
    out.append(
      Weights(
        tuple(names.per_expert.format(e=i, proj=proj) for i in range(E)),
        shape,
        legend,
        lambda *ws, where=where: {where: jnp.stack([w.T for w in ws])},
        lambda p, where=where: tuple(np.ascontiguousarray(w.T) for w in p[where]),
      )
    )
  return out


def uses_fused_experts(stored: set[str] | None, prefix: str, names: ExpertNames) -> bool:
  """Whether a layer's experts are stored fused (transformers v5's layout); export writes the
  per-expert layout every transformers version reads."""
  return stored is not None and f"{prefix}{names.fused}.gate_up_proj" in stored


# ---------------------------------------------------------------------------------------------
# Files.


def _safetensors_files(folder: Path) -> list[Path]:
  index = folder / "model.safetensors.index.json"
  if index.is_file():
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
      raise HFLoadError(f"{index}: 'weight_map' must map tensor names to file names")
    return sorted({folder / name for name in weight_map.values()})
  files = sorted(folder.glob("*.safetensors"))
  if not files:
    raise HFLoadError(f"{folder}: no *.safetensors files (only safetensors weights are supported)")
  return files


def tensor_names(folder: str | Path) -> set[str]:
  """The names of a folder's tensors, from the safetensors headers (no tensor is read)."""
  from safetensors import safe_open

  names: set[str] = set()
  for file in _safetensors_files(Path(folder)):
    try:
      with safe_open(str(file), framework="numpy") as f:
        names.update(f.keys())
    except Exception as e:  # safetensors raises its own error types, and OSError
      raise HFLoadError(f"{file}: not a readable safetensors file: {type(e).__name__}: {e}") from e
  return names


FP8_DTYPES = {"F8_E4M3": jnp.float8_e4m3fn, "F8_E5M2": jnp.float8_e5m2}


def _fp8_tensors(file: Path) -> dict[str, np.ndarray]:
  """A file's FP8 tensors (which safetensors' numpy and flax readers cannot build), read from
  its header's offsets as ml_dtypes arrays."""
  with file.open("rb") as f:
    size = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(size))
    out = {}
    for name, info in header.items():
      if name == "__metadata__" or info.get("dtype") not in FP8_DTYPES:
        continue
      start, end = info["data_offsets"]
      f.seek(8 + size + start)
      data = np.frombuffer(f.read(end - start), np.uint8)
      out[name] = data.view(FP8_DTYPES[info["dtype"]]).reshape(info["shape"])
  return out


def read_safetensors(folder: str | Path) -> dict[str, jax.Array]:
  """All tensors of a folder (single file or sharded), as jax arrays on the host.

  Raises:
    HFLoadError naming the file when one is missing, truncated or not safetensors.
  """
  from safetensors import safe_open

  tensors = {}
  for file in _safetensors_files(Path(folder)):
    if not file.is_file():
      raise HFLoadError(f"{file} is listed in the index but missing")
    try:
      fp8 = _fp8_tensors(file)
      tensors.update(fp8)
      with safe_open(str(file), framework="flax") as f:
        for name in f.keys():
          if name not in fp8:
            tensors[name] = f.get_tensor(name)
    except Exception as e:  # safetensors raises its own error types, and OSError
      raise HFLoadError(
        f"{file}: not a readable safetensors file (truncated or damaged?): {type(e).__name__}: {e}"
      ) from e
  return tensors


# ---------------------------------------------------------------------------------------------
# Import.


def check_tensor_shapes(
  tensors: Mapping[str, Any], expected: Mapping[str, tuple[tuple[int, ...], str]]
) -> None:
  """Checks each stored tensor's shape exactly against `expected` ({name: (shape, legend)})
  before anything is reshaped or transposed: a transposed projection whose transpose would
  still reshape must not load as wrong weights."""
  for name, (shape, legend) in expected.items():
    got = tuple(tensors[name].shape)
    if got != tuple(shape):
      hint = " (stored transposed?)" if got == tuple(shape)[::-1] else ""
      raise HFLoadError(
        f"tensor {name} has shape {got} in the checkpoint, but config.json implies "
        f"{tuple(shape)} = ({legend}){hint}"
      )


def _check_names(tensors: Mapping[str, Any], spec: Spec, cfg: ModelConfig) -> None:
  expected = spec.shapes()
  missing = [n for n in expected if n not in tensors]
  if missing:
    shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
    raise HFLoadError(f"missing tensors: {shown}; expected {len(expected)} tensors in all")
  unused = sorted(
    n
    for n in set(tensors) - set(expected) - spec.ignored
    if not n.endswith(IGNORED_SUFFIXES) and not (cfg.tie_embeddings and n == "lm_head.weight")
  )
  if unused:
    raise HFLoadError(
      f"unexpected tensors (a feature this importer does not support?): {', '.join(unused[:8])}"
    )


def _set(tree: dict, path: Where, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def params_from_tensors(
  tensors: Mapping[str, Any], spec: Spec, cfg: ModelConfig, *, scales: fp8.Scales | None = None
) -> dict:
  """Our pure parameter dict from a checkpoint's tensors; HFLoadError names what is missing,
  unexpected or of the wrong shape. With `scales` (`fp8.split_scales`), the FP8 weights named
  there are kept as QArrays where they can be (`fp8.kept_weight`), and `scales.report` lists
  the parameters kept and expanded."""
  _check_names(tensors, spec, cfg)
  check_tensor_shapes(tensors, spec.shapes())
  dtype = jnp.dtype(cfg.param_dtype)
  params: dict[str, Any] = {}
  stacks: dict[Where, dict[int, Array]] = {}
  for g in spec.groups:
    for w in g.weights:
      full = [g.prefix + n for n in w.names]
      if scales is not None and all(n in scales.by_weight for n in full):
        values, done = fp8.kept_weight(
          w.load,
          [tensors[n] for n in full],
          [scales.by_weight[n] for n in full],
          scales.block_of(full),
          keep=lambda where: where[-1] in PROJECTIONS,
          dtype=dtype,
          names=full,
          inputs=[scales.inputs[n] for n in full] if scales.activations == "static" else None,
        )
        for where, kept in done:
          scales.report["kept" if kept else "expanded"].append(".".join(g.stack + where))
      else:
        values = w.load(*[jnp.asarray(tensors[n]).astype(dtype) for n in full])
      for where, value in values.items():
        if g.stack:
          stacks.setdefault(g.stack + where, {})[g.index] = value
        else:
          _set(params, where, value)
  for path, layers in stacks.items():
    _set(params, path, _stack([layers[i] for i in range(len(layers))]))
  return fit_to_model(params, cfg)


def _stack(values: list) -> Any:
  """Layers' values stacked on a new leading axis; QArrays' codes and scales each stacked."""
  if isinstance(values[0], QArray):
    if any(not isinstance(v, QArray) or v.scale.shape != values[0].scale.shape for v in values):
      raise HFLoadError("FP8 weights kept in some layers but not others, or tiled differently")
    if any(type(v) is not type(values[0]) for v in values):
      raise HFLoadError("FP8 weights with static input scales in some layers but not others")
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *values)
  return jnp.stack([v if not isinstance(v, QArray) else dequantized(v) for v in values])


def abstract_model(cfg: ModelConfig, implementation: str | None = None, *, ops=None) -> Transformer:
  """The model `cfg` calls for, shapes only."""
  return nnx.eval_shape(
    lambda: build(cfg, rngs=nnx.Rngs(0), implementation=implementation, ops=ops)
  )


def fit_to_model(params: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  """`params` in the model's own dtypes (routers stay float32); HFLoadError names the first
  variable that is missing or has the wrong shape."""
  want = nnx.to_pure_dict(nnx.state(abstract_model(cfg)))
  flat_got = dict(jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_q))

  def fit(path, leaf):
    got = flat_got.get(path)
    name = ".".join(str(getattr(k, "key", k)) for k in path)
    if got is None:
      raise HFLoadError(f"no tensor for parameter {name}")
    if tuple(got.shape) != tuple(leaf.shape):
      raise HFLoadError(
        f"parameter {name} has shape {tuple(got.shape)} from the checkpoint but the config "
        f"implies {tuple(leaf.shape)}"
      )
    if isinstance(got, QArray):  # an FP8 weight kept as it shipped: codes and scales as they are
      return got
    return got.astype(leaf.dtype)

  return jax.tree_util.tree_map_with_path(fit, want)


def _is_q(x) -> bool:
  return isinstance(x, QArray)


def build_model(
  cfg: ModelConfig, params: dict[str, Any], *, implementation: str | None = None, ops=None
) -> Transformer:
  """The model holding `params`, never initialising random weights; `ops` as `Transformer`
  takes it (None: the default backend's)."""
  graphdef, state = nnx.split(abstract_model(cfg, implementation, ops=ops))
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------------------------
# Export.


def _flat(tree: Mapping[str, Any], prefix: Where = ()) -> dict[Where, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out.update(_flat(value, (*prefix, key)))
    else:
      out[(*prefix, key)] = value
  return out


def tensors_from_params(model: Transformer, spec: Spec) -> dict[str, np.ndarray]:
  """Every stored tensor of `spec`, float32 (numpy has no bfloat16), from the model's variables."""
  params = nnx.to_pure_dict(nnx.state(model))
  flat = {k: np.asarray(jnp.asarray(v, jnp.float32)) for k, v in _flat(params).items()}
  out = {}
  for g in spec.groups:
    n = len(g.stack)
    ours = {k[n:]: (v[g.index] if n else v) for k, v in flat.items() if k[:n] == g.stack}
    for w in g.weights:
      for name, value in zip(w.names, w.save(ours)):
        out[g.prefix + name] = np.ascontiguousarray(value)
  return out
