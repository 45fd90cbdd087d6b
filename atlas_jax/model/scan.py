"""The layer scan and its rematerialisation (activation checkpointing) policies.

Layers are stored stacked (every block parameter has a leading [L] axis) and run with
`jax.lax.scan`, so compile time does not grow with depth. The policies decide what the forward
pass keeps for the backward pass:

* none: keep every residual the backward pass needs.
* full: keep only each block's input; recompute the whole block in the backward pass.
* every_k: keep only the input of every k-th block (groups of k blocks recomputed together), so
  activation memory grows as L/k + k, which is O(sqrt(L)) at k = sqrt(L).
* selective: keep the outputs of the matmuls (named with `checkpoint_name` in the model) and
  recompute the cheap elementwise work: norms, RoPE, SwiGLU and the attention softmax.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from flax import nnx

POLICIES = ("none", "full", "every_k", "selective")
# Names tagged in atlas_jax/model/attention.py, mla.py, layers.py and moe.py: every matmul output
# and the attention output (whose recomputation would rerun the attention kernel).
MATMUL_NAMES = (
  "q_lora_proj",  # MLA: the query bottleneck
  "kv_lora_proj",  # MLA: the latent and rope key, before the latent norm
  "q_proj",
  "k_proj",
  "v_proj",
  "attn_out",
  "o_proj",
  "mlp_gate",
  "mlp_up",
  "mlp_down",
  "expert_gate",  # the routed experts' matmuls (atlas_jax/model/moe.py)
  "expert_up",
  "expert_down",
)


def default_every(n_layers: int) -> int:
  """The divisor of n_layers closest to sqrt(n_layers)."""
  divisors = [k for k in range(1, n_layers + 1) if n_layers % k == 0]
  return min(divisors, key=lambda k: (abs(k - math.sqrt(n_layers)), k))


def remat(step: Callable, policy: str) -> Callable:
  """`step` under one block's remat policy: "full" keeps only its inputs, "selective" also the
  named matmul and attention outputs; "none" (and "every_k", which groups blocks in
  `scan_layers`) returns it unchanged."""
  if policy == "full":
    return jax.checkpoint(step, policy=jax.checkpoint_policies.nothing_saveable)
  if policy == "selective":
    return jax.checkpoint(step, policy=jax.checkpoint_policies.save_only_these_names(*MATMUL_NAMES))
  return step


def scan_layers(
  step: Callable,
  carry,
  xs,
  *,
  policy: str = "none",
  every: int | None = None,
  unroll: bool = False,
):
  """`jax.lax.scan(step, carry, xs)` over the stacked layers, under a remat policy.

  Args:
    step: (carry, one layer's slice of xs) -> (carry, y).
    carry: what flows from layer to layer (activations [B, T, D]).
    xs: a pytree whose leaves have a leading [L] axis (layer parameters, cache layers).
    policy: one of POLICIES.
    every: k for "every_k" (must divide L); default `default_every(L)`.
    unroll: unroll the layer loops: no stacked residuals to zero, write and slice (faster on a
      CPU at a few layers), and XLA's cost analysis counts every layer (it prices a loop body
      once, whatever its trip count); compile time grows with depth.

  Returns:
    (final carry, ys stacked on a leading [L] axis).
  """
  if policy not in POLICIES:
    raise ValueError(f"remat policy {policy!r} is not one of {POLICIES}")
  if policy != "every_k":
    return jax.lax.scan(remat(step, policy), carry, xs, unroll=unroll)
  n_layers = jax.tree.leaves(xs)[0].shape[0]
  k = default_every(n_layers) if every is None else every
  if n_layers % k:
    raise ValueError(f"remat every_k: k={k} must divide the number of layers {n_layers}")
  grouped = jax.tree.map(lambda a: a.reshape(n_layers // k, k, *a.shape[1:]), xs)

  def group(carry, xs_k):
    # Only the group's input survives the forward; its k blocks are recomputed together.
    return jax.lax.scan(step, carry, xs_k, unroll=unroll)

  group = jax.checkpoint(group, policy=jax.checkpoint_policies.nothing_saveable)
  carry, ys = jax.lax.scan(group, carry, grouped, unroll=unroll)
  return carry, jax.tree.map(lambda a: a.reshape(n_layers, *a.shape[2:]), ys)


def stacked(
  make: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs, *, axis: str = "layers"
) -> nnx.Module:
  """One module whose parameters carry a leading [n] axis, initialised independently per copy.

  Each variable's logical axes (parameters', and any other variable that declares them) gain
  that leading axis, named `axis` ("layers" for the stack pipeline stages split), so the
  sharding rules see it.
  """
  keys = jax.random.split(rngs.params(), n)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
  state = jax.vmap(lambda key: nnx.state(make(nnx.Rngs(key))))(keys)

  def add_layer_axis(v):
    axes = v.get_metadata().get("logical_axes") if isinstance(v, nnx.Variable) else None
    if axes is None:
      return v
    return v.replace(logical_axes=(axis, *axes))

  state = jax.tree.map(add_layer_axis, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdef, state)


# -- layers held one array each ------------------------------------------------------------------


@jax.tree_util.register_pytree_node_class
class Unstacked:
  """A stacked [L, ...] parameter held as L arrays, one per layer (`unstack_layers`).

  In a layer scan each layer's weights are a dynamic slice of the stack, which XLA's CPU backend
  copies out before the matmul: every decode step writes and reads the weights twice. The
  serving engine holds its stacks unstacked where that costs more than it saves (accelerators,
  meshes, out-major projections; `serving.runner.ModelRunner.stacked_layers`), and the model
  runs such a stack as a loop of layers indexing this tuple, which copies nothing. An int index
  gives that layer's array; a slice, a run of layers, still unstacked; `...`, itself.
  """

  def __init__(self, arrays):
    self.arrays = tuple(arrays)

  def __getitem__(self, index):
    if index is Ellipsis:  # `variable[...]`: the value itself
      return self
    if isinstance(index, slice):
      return Unstacked(self.arrays[index])
    return self.arrays[index]

  def __len__(self) -> int:
    return len(self.arrays)

  def tree_flatten(self):
    return self.arrays, None

  @classmethod
  def tree_unflatten(cls, _, arrays):
    return cls(arrays)


def is_unstacked_leaf(x) -> bool:
  return isinstance(x, Unstacked)


def layer_count(state) -> int:
  """L of a stack's state, stacked or unstacked."""
  leaf = jax.tree.leaves(state, is_leaf=is_unstacked_leaf)[0]
  return len(leaf) if isinstance(leaf, Unstacked) else leaf.shape[0]


def is_unstacked(state) -> bool:
  return any(map(is_unstacked_leaf, jax.tree.leaves(state, is_leaf=is_unstacked_leaf)))


def run_unstacked(step: Callable, carry, state, extra=None):
  """What `jax.lax.scan(step, carry, (state, extra))` computes, for an unstacked state: a loop
  of layers, each given its own arrays (and `extra[i]`); the ys stacked on a leading [L] axis."""
  ys = []
  for i in range(layer_count(state)):
    layer = jax.tree.map(lambda u, i=i: u[i], state, is_leaf=is_unstacked_leaf)
    carry, y = step(carry, layer if extra is None else (layer, extra[i]))
    ys.append(y)
  if all(y is None for y in ys):
    return carry, None
  return carry, jax.tree.map(lambda *a: jax.numpy.stack(a), *ys)


# Projections the model contracts over their leading axes (`x @ w`, "BTD,DNH->BTNH"), by name:
# (per-layer rank, contracted leading axes), those `unstack_layers(out_major=True)` holds
# transposed. (The experts' [E, D, F] stacks share the MLP's names at a higher rank, and MLA's
# W_UK is contracted both ways: both are left as they are.)
OUT_MAJOR = {"wq": (3, 1), "wk": (3, 1), "wv": (3, 1), "wo": (3, 2), "wq_b": (3, 1)}
OUT_MAJOR |= {"wq_a": (2, 1), "wkv_a": (2, 1), "w_gate": (2, 1), "w_up": (2, 1), "w_down": (2, 1)}


@jax.tree_util.register_pytree_node_class
class OutMajor:
  """A weight W[*in, *out] held transposed, as [prod(out), prod(in)]: each output's weights
  contiguous.

  On some CPUs XLA's GEMMs multiply x [M, in] by such a matrix faster than by W itself, on
  others slower (a decode step's projections at 32 rows, `python bench/cpu_micro.py --only
  gemm`: 9.74 -> 7.82 ms on one 2-core machine, 5.40 -> 6.19 ms on another, with AVX-512), so
  the serving engine's `weight_layout="auto"` times both at start-up (`serving.runner`).
  PyTorch's `nn.Linear` holds its weights this way.
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
