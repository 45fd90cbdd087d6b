"""How the CPU runner holds the weights: layer stacks one array per layer, projections
optionally out-major.

In a layer scan each layer's weights are a dynamic slice of its stack, which XLA's CPU backend
copies out before the layer's matmuls: every decode step then writes and reads the weights
twice. Held one array per layer (`atlas_jax.model.scan.Unstacked`), the model runs the layers as
an unrolled loop that copies nothing, at the price of a program (and a compile) that grows with
depth. Small layers stay stacked: there the copy is cheap beside what the scan's one loop body
saves in instruction cache and compile time (`runner.STACKED_LAYER_BYTES`).
"""

from __future__ import annotations

import math

import jax

from atlas_jax.model.scan import Unstacked


def layer_bytes(state, stacks=("blocks", "dense_blocks")) -> int:
  """The weight bytes of the model's largest layer: each stack's parameters over its depth."""
  per_layer = [
    sum(x.nbytes // x.shape[0] for x in jax.tree.leaves(state[name]))
    for name in stacks
    if name in state
  ]
  return max(per_layer, default=0)


# Projections the model contracts over their leading axes (`x @ w`, "BTD,DNH->BTNH"), by name:
# (per-layer rank, contracted leading axes), those `unstack_layers(out_major=True)` holds
# transposed. (The experts' [E, D, F] stacks share the MLP's names at a higher rank, and MLA's
# W_UK is contracted both ways: both are left as they are.)
OUT_MAJOR = {"wq": (3, 1), "wk": (3, 1), "wv": (3, 1), "wo": (3, 2), "wq_b": (3, 1)}
OUT_MAJOR |= {"wq_a": (2, 1), "wkv_a": (2, 1), "w_gate": (2, 1), "w_up": (2, 1), "w_down": (2, 1)}


@jax.tree_util.register_pytree_node_class
class OutMajor:
  """A weight W[*in, *out] held transposed, as [prod(out), prod(in)]: each output's weights
  contiguous, as PyTorch's `nn.Linear` holds them.

  Which layout XLA's CPU GEMMs read faster for x [M, in] depends on the CPU (how its kernels tile
  the two operands against its caches and vector width: `python bench/cpu_micro.py --only gemm`
  times both), so `serve.engine.cpu.weight_layout="auto"` times both at start-up (`probes`).
  `w[...]` gives W back as a transpose and a reshape of the stored matrix, which XLA folds into
  the dot's dimension numbers, so the model's einsums read the stored matrix in place.
  """

  def __init__(self, t, shape):
    self.t, self.shape = t, tuple(shape)

  @classmethod
  def of(cls, w, n_in: int = 1):
    return cls(w.reshape(math.prod(w.shape[:n_in]), -1).T, w.shape)

  def __getitem__(self, index):
    if index is not Ellipsis:
      raise TypeError(f"OutMajor: only w[...] is supported, got index {index!r}")
    return self.t.T.reshape(self.shape)

  def tree_flatten(self):
    return (self.t,), self.shape

  @classmethod
  def tree_unflatten(cls, shape, children):
    return cls(children[0], shape)


def _leaf_name(path) -> str | None:
  names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  names = [n for n in names if isinstance(n, str) and n != "value"]
  return names[-1] if names else None


def out_major_candidates(state, stacks=("blocks", "dense_blocks"), limit_bytes=None) -> list:
  """The projections `unstack_layers(out_major=True)` would hold transposed, as 2-D [in, out]
  matrices, layer by layer (every named projection of layer 0, then of layer 1, ...): all of
  them, or the first ones that hold at least `limit_bytes`."""
  named = []
  for name in stacks:
    if name in state:
      for path, x in jax.tree_util.tree_leaves_with_path(state[name]):
        rank, n_in = OUT_MAJOR.get(_leaf_name(path), (None, None))
        if rank == x.ndim - 1:
          named.append((x, n_in))
  out, held = [], 0
  for i in range(max((x.shape[0] for x, _ in named), default=0)):
    for x, n_in in named:
      if i < x.shape[0]:
        w = x[i]
        out.append(w.reshape(math.prod(w.shape[:n_in]), -1))
        held += w.nbytes
        if limit_bytes is not None and held >= limit_bytes:
          return out
  return out


def unstack_layers(state, mesh=None, stacks=("blocks", "dense_blocks"), out_major=False):
  """A model state (`nnx.state(model)`) with its layer stacks' parameters unstacked: each layer
  a separate array, placed as the stack was (its sharding less the leading axis). With
  `out_major`, the projections in `OUT_MAJOR` are held as `OutMajor` matrices (single device
  only: their placement would no longer follow the parameters' logical axes)."""
  from jax.sharding import NamedSharding, PartitionSpec

  if out_major and mesh is not None:
    raise ValueError("unstack_layers: out_major=True is for a single device, got a mesh")
  takes = {}  # one jitted slice per layer placement, shared by every leaf placed alike

  def split(path, x):
    sharding = getattr(x, "sharding", None)
    if mesh is None or not isinstance(sharding, NamedSharding):
      layers = [x[i] for i in range(x.shape[0])]
      rank, n_in = OUT_MAJOR.get(_leaf_name(path), (None, None))
      if out_major and rank == x.ndim - 1:
        layers = [OutMajor.of(w, n_in) for w in layers]
      return Unstacked(layers)
    out = NamedSharding(mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
    if out not in takes:
      takes[out] = jax.jit(lambda a, i: a[i], out_shardings=out)
    return Unstacked(takes[out](x, i) for i in range(x.shape[0]))

  for name in stacks:
    if name in state:
      state[name] = jax.tree_util.tree_map_with_path(split, state[name])
  return state
