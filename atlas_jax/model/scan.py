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
  """A stacked [L, ...] parameter held as L arrays, one per layer.

  The model runs a stack held this way as a loop of layers, unrolled into the program, each
  layer indexing its own arrays: no layer is sliced out of a stack. A serving runner may hold its
  weights so (`atlas_jax.serving.cpu.weights`). An int index gives that layer's array; a slice,
  a run of layers, still unstacked; `...`, itself.
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
