"""Sharding declared once: logical axes on every parameter, and rules mapping them to mesh axes.

Every parameter records its logical axis names where it is created (`atlas_jax.model.layers.param`:
"embed", "q_heads", "mlp", ...; the layer scan adds "layers"). A rules table per strategy maps
logical names to mesh axes; nothing is matched by parameter name, and a parameter without logical
axes is an error when the trainer is built, never a silent replication.

Mesh axes, in device order: `data` (pure replication of state; batch split), `fsdp` (batch split;
ZeRO shards state here), `expert` (expert parallelism: the routed experts of mixture-of-experts
layers are split here, and the batch too, so outside the experts it acts as `data`; the tokens
reach their experts inside `atlas_jax.model.moe.expert_parallel`), `stage` (pipeline parallelism:
the stacked-layer axis is split into contiguous stages; outside the pipelined layers the batch is
split here too, see `atlas_jax.training.pipeline`), `context` (context parallelism: each sequence
is striped and split here, `atlas_jax.model.context_parallel`; parameters are replicated over it
and their gradients all-reduced across it like `data`'s), `tensor` (Megatron-style tensor
parallelism: heads and FFN columns/rows, each expert's hidden width, vocab). Tensor is last, so
it stays within a host's devices.

Strategies (train.sharding), each a statement about which state is split over `fsdp`:

  strategy   parameters   gradients   optimizer state
  dp         replicated   replicated  replicated        (gradients all-reduced)
  zero1      replicated   replicated  sharded
  zero2      replicated   sharded     sharded           (gradients reduce-scattered)
  zero3/fsdp sharded      sharded     sharded           (parameters gathered per layer)

Tensor and expert parallelism apply whenever mesh.tensor > 1 or mesh.expert > 1, and pipeline
stages whenever mesh.stage > 1; all combine with any of them (an expert's weights: experts over
`expert`, width over `tensor`, model dim over `fsdp` under ZeRO-3, the MoE layers over `stage`).
A dimension that
the mesh axis does not divide stays replicated (e.g. a 259-token vocab over 2 devices), and a mesh
axis shards at most one dimension of a parameter (the first whose logical axis maps to it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from atlas_jax.config import ConfigError, MeshConfig

AXES = ("data", "fsdp", "expert", "stage", "context", "tensor")
# `stage` last: a pipeline gathers a data-parallel shard's rows from its stages (one block each).
BATCH_AXES = ("data", "fsdp", "expert", "stage")

# Tensor parallelism splits heads, the FFN width (an expert's too) and the vocabulary; expert
# parallelism splits the experts; ZeRO-3 splits the model width and MLA's low-rank bottlenecks
# (the dims of those projections that carry no head axis).
TENSOR_RULES = {
  "q_heads": "tensor",
  "kv_heads": "tensor",
  "mlp": "tensor",
  "expert_mlp": "tensor",
  "vocab": "tensor",
}
EXPERT_RULES = {"experts": "expert"}
FSDP_RULES = {"embed": "fsdp", "q_lora": "fsdp", "kv_lora": "fsdp"}
# Pipeline stages own contiguous slices of the stacked layers, whatever the strategy.
STAGE_RULES = {"layers": "stage"}
STRATEGIES = ("dp", "zero1", "zero2", "zero3", "fsdp")


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, expert, stage, context, tensor) mesh over all devices; one -1 axis takes
  what the others leave."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = {axis: getattr(cfg, axis) for axis in AXES}
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


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def logical_axes_of(variable: nnx.Variable) -> tuple[str, ...] | None:
  """The logical axes a parameter was created with, or None."""
  return variable.get_metadata().get("logical_axes")


def check_declared(params) -> None:
  """Raises ConfigError naming every parameter without logical axes for each of its dims."""
  bad = []
  for path, v in jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_variable):
    axes = logical_axes_of(v) if _is_variable(v) else None
    if axes is None or len(axes) != len(v.shape):
      name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
      bad.append(f"{name} {tuple(v.shape)} axes={axes}")
  if bad:
    raise ConfigError(
      "every parameter must declare one logical axis per dimension (atlas_jax.model.layers.param);"
      " undeclared: " + "; ".join(bad)
    )


def spec_for(
  axes: Sequence[str | None], shape: Sequence[int], rules: dict[str, str], mesh: Mesh
) -> P:
  """The PartitionSpec of an array with these logical axes under `rules`."""
  spec, used = [], set()
  for dim, name in zip(shape, axes):
    mesh_axis = rules.get(name) if name else None
    # Replicate a dimension the mesh axis does not divide rather than pad it; a mesh axis may
    # shard only one dimension.
    if (
      mesh_axis is None
      or mesh_axis in used
      or mesh.shape.get(mesh_axis, 1) == 1
      or dim % mesh.shape[mesh_axis]
    ):
      spec.append(None)
    else:
      spec.append(mesh_axis)
      used.add(mesh_axis)
  return P(*spec)


def tree_shardings(tree, mesh: Mesh, rules: dict[str, str]):
  """NamedShardings for a tree of parameters (or optimizer state built from them).

  Each parameter (an `nnx.Variable`, abstract or not) is laid out by its logical axes; any other
  leaf (the optimizer's step count, say) is replicated. The result has the structure of `tree`.
  """

  def sharding(x):
    axes = logical_axes_of(x) if _is_variable(x) else None
    # Each array under the Variable by its own shape: a quantized weight's (`atlas_jax.quant`)
    # values split as the float weight, its scales too except along the dims they span.
    spec = lambda a: P() if axes is None else spec_for(axes, a.shape, rules, mesh)
    # Mapping over the Variable keeps it (and its metadata) as the node around the sharding.
    return jax.tree.map(lambda a: NamedSharding(mesh, spec(a)), x)

  return jax.tree.map(sharding, tree, is_leaf=_is_variable)


def strategy_rules(strategy: str) -> dict[str, dict[str, str]]:
  """Rules for params, grads and optimizer state under a ZeRO strategy (TP and EP always
  apply)."""
  if strategy not in STRATEGIES:
    raise ConfigError(f"train.sharding={strategy!r} is not one of {STRATEGIES}")
  zero = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}[strategy]
  model_parallel = {**STAGE_RULES, **TENSOR_RULES, **EXPERT_RULES}
  sharded = {**model_parallel, **FSDP_RULES}
  return {
    "params": sharded if zero >= 3 else model_parallel,
    "grads": sharded if zero >= 2 else model_parallel,
    "opt_state": sharded if zero >= 1 else model_parallel,
  }


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES))


def data_parallel_size(mesh: Mesh) -> int:
  """Devices the batch is split over inside the pipelined layers (data x fsdp)."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES if a != "stage")


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def sharded_bytes(abstract_tree, shardings) -> int:
  """Per-device bytes of `abstract_tree` laid out with `shardings` (no allocation); 4-bit
  values (a QLoRA base's int4) two to a byte, as XLA holds them on GPU and TPU."""
  leaves = jax.tree.leaves(abstract_tree)
  specs = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
  return sum(
    (math.prod(sh.shard_shape(tuple(x.shape))) * jax.dtypes.itemsize_bits(x.dtype) + 7) // 8
    for x, sh in zip(leaves, specs)
  )
