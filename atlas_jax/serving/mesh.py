"""The serving layout: a (data, tensor) device mesh, the serving rules table, and the model,
its draft and its pools placed on it.

The rules map the logical axes that parameters declare where they are created
(`atlas_jax.model.layers.param`) and that pools declare (`KVPool.logical_axes`) to mesh axes,
through the same machinery as the trainer's tables (`atlas_jax.training.sharding`):

  logical axis        mesh axis   what it splits
  q_heads, kv_heads   tensor      Q/K/V and W_UK/W_UV column-parallel, the output projection
                                  row-parallel; a KV pool's kv heads
  mlp                 tensor      gate/up column-parallel, down row-parallel
  expert_mlp          tensor      the same within every routed expert (each device holds every
                                  expert's slice; the router and the shared experts as above)
  vocab               tensor      the embedding and the output head (vocabulary-parallel)
  batch, pages        data        a step's rows and a pool's blocks: each replica its own
  tokens              context     a ragged step's tokens (prefill context parallelism): each
                                  device of a replica computes its share of them; the weights
                                  and the pool are whole on each

Everything else is replicated within a replica: norms, the model width, MLA's low-rank
bottlenecks and its latent pool (one latent serves every head, so each tensor device holds it
whole and the heads' absorbed attention runs on its own heads, exactly). XLA's partitioner adds
the all-reduces after the row-parallel matmuls; attention over a pool runs per shard
(`atlas_jax.cache.paged.PoolLayout`).

When a GQA model has fewer kv heads than the tensor axis, its kv heads are repeated up to the
tensor size (`repeat_kv_heads`: each device holds the one its query heads read, the same
numbers), as vLLM does. A draft whose heads the tensor axis does not divide is held whole by
every device of its replica (it is small; only its batch splits over data).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from atlas_jax.cache.paged import KVPool, LatentPool, PoolLayout
from atlas_jax.config import ConfigError, MeshConfig
from atlas_jax.training.sharding import logical_axes_of, make_mesh, spec_for, tree_shardings

log = logging.getLogger("atlas_jax.serving")

ROW_RULES = {"batch": "data", "pages": "data", "tokens": "context"}
SERVING_RULES = {
  **ROW_RULES,
  "q_heads": "tensor",
  "kv_heads": "tensor",
  "mlp": "tensor",
  "expert_mlp": "tensor",
  "vocab": "tensor",
}


def check_devices(data: int, tensor: int, n_devices: int | None = None, context: int = 1) -> None:
  """ConfigError naming serve.engine's fields when more devices are asked for than exist."""
  n = len(jax.devices()) if n_devices is None else n_devices
  if data * tensor * context > n:
    pcp = "" if context == 1 else f" x serve.engine.prefill_context_parallel_size={context}"
    raise ConfigError(
      f"serve.engine.tensor_parallel_size={tensor} x serve.engine.data_parallel_size={data}"
      f"{pcp} needs {data * tensor * context} devices but {n} are available"
    )


def serving_mesh(data: int = 1, tensor: int = 1, devices=None, context: int = 1) -> Mesh:
  """The first data x context x tensor devices as a (data, fsdp=1, context, tensor) mesh.

  Raises:
    ConfigError naming serve.engine's fields when more devices are asked for than exist.
  """
  devices = list(jax.devices() if devices is None else devices)
  check_devices(data, tensor, len(devices), context)
  n = data * tensor * context
  return make_mesh(MeshConfig(data=data, fsdp=1, context=context, tensor=tensor), devices[:n])


def mesh_sizes(mesh: Mesh) -> tuple[int, int]:
  """(data, tensor) sizes of a serving mesh; its context axis may exceed 1 too
  (`context_size`), every other axis must be 1."""
  allowed = ("data", "tensor", "context")
  extra = {a: s for a, s in mesh.shape.items() if a not in allowed and s != 1}
  if extra:
    raise ConfigError(
      f"mesh={dict(mesh.shape)} is not allowed for serving: only data, context and tensor may "
      "exceed 1"
    )
  return mesh.shape.get("data", 1), mesh.shape.get("tensor", 1)


def context_size(mesh: Mesh | None) -> int:
  """The devices of a serving mesh's context axis (prefill context parallelism); 1 without."""
  return 1 if mesh is None else mesh.shape.get("context", 1)


def check_heads(cfg, tensor: int, what: str = "the model") -> None:
  """ConfigError naming serve.engine.tensor_parallel_size when the tensor axis cannot split the
  heads of `cfg` exactly."""
  if tensor == 1:
    return
  where = f"serve.engine.tensor_parallel_size={tensor} is not allowed"
  if cfg.n_heads % tensor:
    raise ConfigError(
      f"{where}: {what}'s {cfg.n_heads} query heads must be divisible by it (allowed: the "
      f"divisors of {cfg.n_heads})"
    )
  K = cfg.n_kv_heads
  if cfg.mla is None and K % tensor and tensor % K:
    raise ConfigError(
      f"{where}: {what}'s {K} kv heads must divide it or be divisible by it (kv heads are "
      "repeated up to the tensor size when fewer)"
    )


def heads_split(cfg, tensor: int) -> bool:
  """Whether the tensor axis splits this model's heads exactly (see `check_heads`)."""
  try:
    check_heads(cfg, tensor)
  except ConfigError:
    return False
  return True


def repeat_kv_heads(model, tensor: int, what: str = "the model"):
  """The model with each kv head repeated tensor / K times when K < tensor (GQA), so every
  tensor device holds the kv head its query heads read; the same model otherwise. Query head n
  reads kv head n // (N / K) before and n // (N / tensor) after: the same numbers."""
  cfg = model.cfg
  if cfg.mla is not None or cfg.n_kv_heads >= tensor:
    return model
  r = tensor // cfg.n_kv_heads
  log.info(
    "%s: %d kv heads repeated %d times to %d, one per tensor device",
    what,
    cfg.n_kv_heads,
    r,
    tensor,
  )
  graphdef, state = nnx.split(model)

  def repeat(v):
    axes = logical_axes_of(v) if isinstance(v, nnx.Variable) else None
    if axes is None or "kv_heads" not in axes:
      return v
    return v.replace(jnp.repeat(v[...], r, axis=axes.index("kv_heads")))

  state = jax.tree.map(repeat, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  repeated = nnx.merge(graphdef, state)
  repeated.cfg = dataclasses.replace(cfg, n_kv_heads=tensor)
  return repeated


def model_rules(cfg, tensor: int) -> dict[str, str]:
  """The rules a model is placed with: the serving table where the tensor axis splits its heads
  exactly, else the rows only (every device of a replica holds the whole model)."""
  return SERVING_RULES if heads_split(cfg, tensor) else ROW_RULES


def layout(mesh: Mesh | None, rules: dict[str, str]) -> PoolLayout | None:
  """The pool layout of a model placed with `rules`; None on one device."""
  if mesh is None:
    return None
  return PoolLayout(mesh, tuple(sorted(rules.items())))


def place_state(state, mesh: Mesh | None, rules: dict[str, str]):
  """A model's state laid out by its parameters' logical axes (a copy on the mesh)."""
  if mesh is None:
    return state
  return jax.device_put(state, tree_shardings(state, mesh, rules))


# An MTP drafter's hidden states beside its pool: [2, P, Z, D] (`DraftCache.hidden`).
HIDDEN_AXES = ("layers", "pages", "page_slots", "embed")


def pool_shardings(pools, mesh: Mesh, rules: dict[str, str]):
  """NamedShardings of a tree of pools (`KVPool`, `LatentPool`, an MTP drafter's hidden states;
  arrays or ShapeDtypeStructs), each array by its logical axes, with the tree's structure."""
  pool_types = (KVPool, LatentPool)

  def place(x):
    if isinstance(x, pool_types):
      return x.with_arrays(
        tuple(NamedSharding(mesh, spec_for(x.logical_axes, a.shape, rules, mesh)) for a in x.arrays)
      )
    return NamedSharding(mesh, spec_for(HIDDEN_AXES, x.shape, rules, mesh))

  return jax.tree.map(place, pools, is_leaf=lambda x: isinstance(x, pool_types))


def bytes_per_device(tree) -> int:
  """The most bytes of `tree`'s arrays that any one device holds."""
  per: dict = {}
  for x in jax.tree.leaves(tree):
    for shard in x.addressable_shards:
      per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
  return max(per.values(), default=0)


def shard_bytes(x: jax.ShapeDtypeStruct, sharding) -> int:
  """Bytes of one device's shard of an array laid out with `sharding` (nothing allocated)."""
  return math.prod(sharding.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
