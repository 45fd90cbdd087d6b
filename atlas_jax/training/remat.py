"""Rematerialisation (activation checkpointing) policies for the layer scan.

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

POLICIES = ("none", "full", "every_k", "selective")
# Names tagged in atlas_jax/model/attention.py and layers.py.
MATMUL_NAMES = (
  "q_proj",
  "k_proj",
  "v_proj",
  "attn_out",
  "o_proj",
  "mlp_gate",
  "mlp_up",
  "mlp_down",
)


def default_every(n_layers: int) -> int:
  """The divisor of n_layers closest to sqrt(n_layers)."""
  divisors = [k for k in range(1, n_layers + 1) if n_layers % k == 0]
  return min(divisors, key=lambda k: (abs(k - math.sqrt(n_layers)), k))


def scan_blocks(
  block_fn: Callable,
  x,
  stacked,
  *,
  policy: str = "none",
  every: int | None = None,
  unroll: bool = False,
):
  """Runs `x = block_fn(x, layer_params)` over the stacked layers with the given remat policy.

  Args:
    block_fn: (x, params of one layer) -> x.
    x: the carry (activations [B, T, D]).
    stacked: a pytree whose leaves have a leading [L] axis.
    policy: one of POLICIES.
    every: k for "every_k" (must divide L); default `default_every(L)`.
    unroll: unroll the layer loops. Only for measurement: XLA's cost analysis counts a loop body
      once, whatever its trip count.
  """
  if policy not in POLICIES:
    raise ValueError(f"remat policy {policy!r} is not one of {POLICIES}")
  step = lambda x, params: (block_fn(x, params), None)
  if policy == "none":
    return jax.lax.scan(step, x, stacked, unroll=unroll)[0]
  if policy == "full":
    step = jax.checkpoint(step, policy=jax.checkpoint_policies.nothing_saveable)
    return jax.lax.scan(step, x, stacked, unroll=unroll)[0]
  if policy == "selective":
    step = jax.checkpoint(step, policy=jax.checkpoint_policies.save_only_these_names(*MATMUL_NAMES))
    return jax.lax.scan(step, x, stacked, unroll=unroll)[0]
  n_layers = jax.tree.leaves(stacked)[0].shape[0]
  k = default_every(n_layers) if every is None else every
  if n_layers % k:
    raise ValueError(f"remat every_k: k={k} must divide the number of layers {n_layers}")
  grouped = jax.tree.map(lambda a: a.reshape(n_layers // k, k, *a.shape[1:]), stacked)

  def group(x, params_k):
    # Only the group's input survives the forward; its k blocks are recomputed together.
    return jax.lax.scan(step, x, params_k, unroll=unroll)[0], None

  group = jax.checkpoint(group, policy=jax.checkpoint_policies.nothing_saveable)
  return jax.lax.scan(group, x, grouped, unroll=unroll)[0]
