"""Pipeline parallelism: the layer stack split into stages over the `stage` mesh axis.

One SPMD program under `jit`: the stages are a `shard_map` over `stage` (manual over that axis
only, so `fsdp`, `tensor` and `data` shard each stage's work as they shard the unpipelined model),
activations pass to the next stage with `ppermute`, and a `scan` runs the schedule's iterations.

Schedules (p stages, U micro-batches, r repeats; `atlas_jax.schedule.Schedule`):

* GPipe (r = 1): stage s holds layers [s L/p, (s+1) L/p) and runs micro-batch i - s at iteration
  i; U + p - 1 iterations, of which each stage idles p - 1: the bubble (p-1) / (U + p - 1).
* Circular (r > 1): each stage holds r groups of L/(p r) layers, group g of stage s being layers
  [(g p + s) L/(p r), ...); a micro-batch passes through the p stages r times (the last stage
  hands it back to the first), and at step k = i - s stage s runs micro-batch k mod U of repeat
  k div U: U r + p - 1 iterations and a bubble of (p-1) / (U r + p - 1). The first stage must be
  done with a repeat's U micro-batches before the first comes back, so U >= p; for U > p it keeps
  the returning micro-batches until their turn.

Backward is the transpose of the same program (JAX differentiates the scan): the ppermutes run the
other way and each stage's saved residuals are those of its own layers, under the model's remat
policy. GPipe's memory cost: every micro-batch's stage inputs (and residuals) are kept until the
backward pass, all U of them in flight.

Around the pipelined trunk the embedding runs on every stage over its data shard's rows (the
token ids gathered over `stage`: `Pipeline.gather`), since the first stage needs them all; the
last stage's outputs are scattered back over the stages (reduce-scatter), so the final norm,
the head, the loss and the MTP heads split the batch over `stage` as well as (data, fsdp) and
are not repeated on every stage.

A layer may also report something of its rows (an MoE layer's router stats, for the balance
losses and the selection-bias update): each stage records it per layer and micro-batch where it
did real work, and the program returns every layer's, [L, U, ...] in the stored layer order, for
the model to merge over the micro-batches.

Circular stages own non-contiguous layers, so the trainer keeps the stacked layers in the run's
order (`layer_order`: stage-major, each stage's rows one contiguous block, as the `layers` ->
`stage` sharding rule splits them); checkpoints record the order they were saved in and
`reorder_layers` converts, so any run resumes on any mesh.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from atlas_jax.model.scan import scan_layers
from atlas_jax.schedule import Schedule, layer_order  # noqa: F401 (re-exported)
from atlas_jax.training.sharding import BATCH_AXES, data_parallel_size, logical_axes_of

DATA_AXES = tuple(a for a in BATCH_AXES if a != "stage")  # what splits the rows inside a stage

Array = jax.Array
Layout = tuple[
  int, int
]  # (stages, repeats) the stacked layers are stored for; (1, 1): in depth order


def _has_layer_axis(v) -> bool:
  axes = logical_axes_of(v) if isinstance(v, nnx.Variable) else None
  return bool(axes) and axes[0] == "layers"


def reorder_layers(tree, src: Layout, dst: Layout):
  """`tree` (parameters, or optimizer state built from them) with every stacked-layer array's
  rows moved from layout `src` to layout `dst` (a reshape and a transpose each way, which XLA
  lays out as one all-to-all over `stage`). Other leaves are returned as they are."""
  if src[1] == dst[1] == 1 or src == dst:
    return tree

  def move(x):
    L = x.shape[0]
    if src[1] > 1:  # to depth order
      (p, r), rest = src, x.shape[1:]
      x = x.reshape(p, r, L // (p * r), *rest).swapaxes(0, 1).reshape(L, *rest)
    if dst[1] > 1:
      (p, r), rest = dst, x.shape[1:]
      x = x.reshape(r, p, L // (p * r), *rest).swapaxes(0, 1).reshape(L, *rest)
    return x

  return jax.tree.map(
    lambda v: jax.tree.map(move, v) if _has_layer_axis(v) else v,
    tree,
    is_leaf=lambda x: isinstance(x, nnx.Variable),
  )


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """Runs the block stack as a pipeline over `mesh`'s `stage` axis (the model's layer runner).

  Static (hashable): a model holds it as it holds its remat policy."""

  mesh: Mesh
  schedule: Schedule

  def __call__(self, step: Callable, carry, xs, rows, **kwargs):
    """(carry, per-layer outputs) of `run`."""
    return self.run(step, carry, xs, rows, **kwargs)[:2]

  def gather(self, x_B: Array) -> Array:
    """Rows split over the data axes only (gathered over `stage`): the token ids the embedding
    reads, so every stage embeds its data shard's rows (the first stage needs them all; a
    lookup is cheap next to moving the activations) and XLA partitions the lookup as it does
    without stages. The trunk's outputs come back split over BATCH_AXES, and so does what reads
    them (final norm, head, loss, MTP heads): not repeated on every stage."""
    return jax.lax.with_sharding_constraint(x_B, NamedSharding(self.mesh, P(DATA_AXES)))

  def run(
    self,
    step: Callable,
    carry,
    xs,
    rows,
    *,
    policy: str = "none",
    every: int | None = None,
    unroll: bool = False,
  ) -> tuple[Any, Any, Array]:
    """All L layers over the batch, stage by stage.

    Args:
      step: (carry, one layer's slice of xs, rows) -> (carry, y): one block on some rows; y is
        what the layer reports of them (a pytree of arrays, e.g. its router's stats, or None).
      carry: what flows from layer to layer, a pytree of [B, T, D] arrays.
      xs: the stacked block parameters, every leaf [L, ...], rows in `layer_order`.
      rows: per-row inputs every block reads, a pytree of [B, ...] arrays (positions, segment
        ids; None leaves allowed).
      policy, every, unroll: the remat policy of each stage's layer scan (`scan_layers`).

    Returns:
      (carry after the L layers, split over BATCH_AXES; ys, every leaf [L, U, ...]: each layer's
      y on each micro-batch, rows in `layer_order` like xs (None when step's y is); busy
      bool[p, I]: whether stage s did real work at iteration i).
    """
    B, dtype = jax.tree.leaves(carry)[0].shape[0], jax.tree.leaves(carry)[0].dtype
    remat = dict(policy=policy, every=every, unroll=unroll)
    # In: each data shard's rows on every stage (`gather`), handed over in float32 (see `_f32`;
    # the backward pass sums the stages' gradients of them: only the first stage's is not zero).
    # Out: each stage its block of each data shard's rows, [n, p, b']. Without JAX's
    # replication checks, which the Pallas interpreter's loops do not pass inside a shard_map.
    stages = jax.shard_map(
      functools.partial(self._stages, step, dtype=dtype, **remat),
      mesh=self.mesh,
      in_specs=(P(), P("stage"), P()),
      out_specs=(P(None, "stage"), P("stage"), P("stage")),
      axis_names={"stage"},
      check_vma=False,
    )
    carry = jax.tree.map(lambda x: self.gather(x).astype(jnp.float32), carry)
    out, ys, busy_pI = stages(carry, xs, jax.tree.map(self.gather, rows))
    batch = NamedSharding(self.mesh, P(BATCH_AXES))
    out = jax.tree.map(
      lambda x: jax.lax.with_sharding_constraint(x.reshape(B, *x.shape[3:]), batch), out
    )
    return out, ys, busy_pI

  def _stages(self, step, carry, xs, rows, *, dtype, policy, every, unroll):
    """One stage's program (inside shard_map): carry (float32, computed in `dtype`) and rows
    [B, ...], xs [L/p, ...]."""
    sched = self.schedule
    p, U, r = sched.stages, sched.microbatches, sched.repeats
    n = data_parallel_size(self.mesh)
    s = jax.lax.axis_index("stage")
    first, last = s == 0, s == p - 1
    # [B, ...] -> U micro-batches [U, B/U, ...]: micro-batch u takes rows u, u + U, ..., so each
    # data shard's block of rows splits in place.
    to_micro = lambda x: x.reshape(x.shape[0] // U, U, *x.shape[1:]).swapaxes(0, 1)
    on_data = P(DATA_AXES)
    micro = lambda a: jax.lax.with_sharding_constraint(a, on_data)

    # io: the first stage's input micro-batches (and those coming back for their next repeat);
    # the last stage writes its finished micro-batches into its own copy.
    io = jax.tree.map(lambda x: to_micro(x).astype(dtype), carry)
    rows = jax.tree.map(to_micro, rows)
    if r > 1:
      xs = jax.tree.map(lambda a: a.reshape(r, a.shape[0] // r, *a.shape[1:]), xs)  # [r, L/(pr)]
    # Slices and updates of the buffers as dynamic_slice / dynamic_update_slice: linear, so the
    # backward pass keeps only the index (a scatter's JVP would keep the whole buffer).
    get = lambda buf, u: jax.lax.dynamic_index_in_dim(buf, u, keepdims=False)
    put = lambda buf, u, x, keep: jax.lax.dynamic_update_index_in_dim(
      buf, jnp.where(keep, x, get(buf, u)), u, 0
    )
    # Circular: the last stage hands each micro-batch back to the first; GPipe: a chain.
    ring = [(j, (j + 1) % p) for j in range(p if r > 1 else p - 1)]

    # The stage's layers of one repeat on one micro-batch, under the model's remat policy.
    # GPipe: the stage's weights (and their compute-dtype casts) are loop-invariant, so the
    # backward pass reads them once. Circular: each block takes its weights from the stage's
    # stack by index inside its remat region, so the backward pass indexes them again rather
    # than keeping a copy per iteration (without remat that copy is kept).
    remat = dict(policy=policy, every=every, unroll=unroll)

    per = jax.tree.leaves(xs)[0].shape[1 if r > 1 else 0]  # layers per stage and repeat

    def stage(x, rep, rows_u):
      """(y, the layers' outputs [per, ...])."""
      if r == 1:
        return scan_layers(lambda c, layer: step(c, layer, rows_u), x, xs, **remat)
      block = lambda c, j: step(c, jax.tree.map(lambda a: a[rep, j], xs), rows_u)
      return scan_layers(block, x, jnp.arange(per), **remat)

    # Each layer's outputs per micro-batch, [r, per, U, ...]: written where the stage was busy.
    x0 = jax.tree.map(lambda buf: get(buf, 0), io)
    ys_shape = jax.eval_shape(lambda: stage(x0, 0, jax.tree.map(lambda a: get(a, 0), rows))[1])
    ys = jax.tree.map(lambda a: jnp.zeros((r, per, U, *a.shape[1:]), a.dtype), ys_shape)

    def record(buf, y, rep, u, busy):
      at = (rep, 0, u) + (0,) * (buf.ndim - 3)
      old = jax.lax.dynamic_slice(buf, at, (1, per, 1, *buf.shape[3:]))
      y = jnp.where(busy, y[None, :, None], old)
      return jax.lax.dynamic_update_slice(buf, y, at)

    def iteration(loop, i):
      io, received, ys = loop
      # What the last stage finished at iteration i - 1, on its way to another repeat.
      u_back, rep_back, busy_back = sched.work(i - 1, p - 1)
      back = first & busy_back & (rep_back < r - 1)
      io = jax.tree.map(lambda buf, x: put(buf, u_back, x, back), io, received)
      u, rep, busy = sched.work(i, s)
      x = jax.tree.map(lambda buf, x: micro(jnp.where(first, get(buf, u), x)), io, received)
      y, ys_i = stage(x, rep, jax.tree.map(lambda a: micro(get(a, u)), rows))
      ys = jax.tree.map(lambda buf, y: record(buf, y, rep, u, busy), ys, ys_i)
      done = last & busy & (rep == r - 1)
      io = jax.tree.map(lambda buf, y: put(buf, u, y, done), io, y)
      sent = jax.tree.map(lambda a: jax.lax.ppermute(a, "stage", ring), y)
      return (io, sent, ys), busy

    received = jax.tree.map(lambda a: jnp.zeros_like(a[0]), io)
    loop = (io, received, ys)
    (io, _, ys), busy_I = jax.lax.scan(iteration, loop, jnp.arange(sched.iterations))

    # The last stage's outputs, back in row order and as [n, p, b'] blocks (BATCH_AXES's layout:
    # stage last), zero on the other stages, so the reduce-scatter over `stage` hands each stage
    # its block of each data shard. Zeroed by a product, whose backward pass keeps only the 0/1
    # factor (a `where` keeps the whole buffer); the other stages' buffers hold the inputs and
    # micro-batches the real work computed, finite wherever the step is.
    def scatter(x_UB):
      x = x_UB.swapaxes(0, 1).reshape(-1, *x_UB.shape[2:])
      x = (x * last.astype(x.dtype)).reshape(n, p, -1, *x.shape[1:])
      return _f32(lambda y: jax.lax.psum_scatter(y, "stage", scatter_dimension=1, tiled=True), x)

    # [r, per, U, ...] -> rows (g per + j) of this stage's block of `layer_order`.
    ys = jax.tree.map(lambda a: a.reshape(r * per, *a.shape[2:]), ys)
    return jax.tree.map(scatter, io), ys, busy_I[None]


def _f32(collective: Callable, x: Array) -> Array:
  """`collective(x)` summed in float32, cast back: the cross-stage sums (this reduce-scatter,
  and the backward pass's sum of the inputs' gradients) add one non-zero term to zeros, so this
  changes no value. XLA's CPU compiler fails on a bf16/fp16 all-reduce of a partly manual
  shard_map (its reducer holds a sharding annotation its float32 promotion cannot clone)."""
  return collective(x.astype(jnp.float32)).astype(x.dtype)
