"""Sharding declared once: logical axis names per parameter, and rules mapping them to mesh axes.

Mesh axes: `data` (pure replication of state; batch split), `fsdp` (batch split; ZeRO shards state
here), `tensor` (Megatron-style tensor parallelism: heads and FFN columns/rows, vocab).

Strategies (train.sharding), each a statement about which state is split over `fsdp`:

  strategy   parameters   gradients   optimizer state
  dp         replicated   replicated  replicated        (gradients all-reduced)
  zero1      replicated   replicated  sharded
  zero2      replicated   sharded     sharded           (gradients reduce-scattered)
  zero3/fsdp sharded      sharded     sharded           (parameters gathered per layer)

Tensor parallelism applies whenever mesh.tensor > 1 and combines with any of them. A dimension that
the mesh axis does not divide stays replicated (e.g. a 259-token vocab over 2 devices).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from atlas_jax.config import ConfigError, MeshConfig

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Logical axes of every parameter, by (parent, name); blocks get a leading "layers" axis.
_LOGICAL = {
  "embed": ("vocab", "embed"),
  "lm_head": ("embed", "vocab"),
  "wq": ("embed", "q_heads", "head_dim"),
  "wk": ("embed", "kv_heads", "head_dim"),
  "wv": ("embed", "kv_heads", "head_dim"),
  "wo": ("q_heads", "head_dim", "embed"),
  "bq": ("q_heads", "head_dim"),
  "bk": ("kv_heads", "head_dim"),
  "bv": ("kv_heads", "head_dim"),
  "w_gate": ("embed", "mlp"),
  "w_up": ("embed", "mlp"),
  "w_down": ("mlp", "embed"),
  "q_norm/scale": ("head_dim",),
  "k_norm/scale": ("head_dim",),
  "scale": ("embed",),
}
TENSOR_RULES = {"q_heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
FSDP_RULES = {"embed": "fsdp"}
STRATEGIES = ("dp", "zero1", "zero2", "zero3", "fsdp")


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh over all devices; one -1 axis takes what the others leave."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = {"data": cfg.data, "fsdp": cfg.fsdp, "tensor": cfg.tensor}
  known = math.prod(s for s in sizes.values() if s != -1)
  for name, size in sizes.items():
    if size == -1:
      if len(devices) % known:
        raise ConfigError(
          f"mesh.{name}=-1: the other axes ({known} devices) do not divide {len(devices)} devices"
        )
      sizes[name] = len(devices) // known
  if math.prod(sizes.values()) != len(devices):
    raise ConfigError(
      f"mesh={sizes} needs {math.prod(sizes.values())} devices but {len(devices)} are available"
    )
  grid = np.asarray(devices).reshape(tuple(sizes[a] for a in AXES))
  return Mesh(grid, AXES)


def _names(path) -> list[str]:
  names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  return [n for n in names if isinstance(n, str) and n != "value"]


def logical_axes(path, ndim: int) -> tuple[str | None, ...]:
  """Logical axis names of the parameter (or optimizer-state leaf) at `path`."""
  names = _names(path)
  if not names or ndim == 0:
    return (None,) * ndim
  key = "/".join(names[-2:])
  axes = _LOGICAL.get(key, _LOGICAL.get(names[-1]))
  if axes is None:
    return (None,) * ndim
  if "blocks" in names:
    axes = ("layers", *axes)
  return axes if len(axes) == ndim else (None,) * ndim


def spec_for(path, shape: tuple[int, ...], rules: dict[str, str], mesh: Mesh) -> P:
  axes = []
  for dim, name in zip(shape, logical_axes(path, len(shape))):
    mesh_axis = rules.get(name) if name else None
    # Replicate a dimension the mesh axis does not divide rather than pad it.
    if mesh_axis is None or mesh.shape[mesh_axis] == 1 or dim % mesh.shape[mesh_axis]:
      axes.append(None)
    else:
      axes.append(mesh_axis)
  return P(*axes)


def tree_shardings(tree, mesh: Mesh, rules: dict[str, str]):
  """NamedShardings for every leaf of `tree` (arrays or ShapeDtypeStructs)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, x: NamedSharding(mesh, spec_for(path, tuple(x.shape), rules, mesh)), tree
  )


def strategy_rules(strategy: str) -> dict[str, dict[str, str]]:
  """Rules for params, grads and optimizer state under a ZeRO strategy (TP always applies)."""
  if strategy not in STRATEGIES:
    raise ConfigError(f"train.sharding={strategy!r} is not one of {STRATEGIES}")
  stage = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}[strategy]
  sharded = {**TENSOR_RULES, **FSDP_RULES}
  return {
    "params": sharded if stage >= 3 else TENSOR_RULES,
    "grads": sharded if stage >= 2 else TENSOR_RULES,
    "opt_state": sharded if stage >= 1 else TENSOR_RULES,
  }


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def sharded_bytes(abstract_tree, shardings) -> int:
  """Per-device bytes of `abstract_tree` laid out with `shardings` (no allocation)."""
  leaves = jax.tree.leaves(abstract_tree)
  specs = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
  return sum(
    math.prod(sh.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
    for x, sh in zip(leaves, specs)
  )
