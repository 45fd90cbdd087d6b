"""The pipeline schedule: which micro-batch each stage runs at each iteration, read by the
trainer's pipeline (`atlas_jax.training.pipeline`) and by the planner (`atlas_jax.plan`).

p stages, U micro-batches, r repeats (layer groups per stage): at iteration i stage s has taken
k = i - s steps and runs micro-batch k mod U of repeat k div U while 0 <= k < U r, else idles.
GPipe is r = 1; the circular (interleaved) schedule r > 1. A step runs I = U r + p - 1
iterations, each stage idling p - 1 of them: the bubble (p-1) / (U r + p - 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Which micro-batch each stage runs at each iteration (GPipe for repeats 1, else circular)."""

  stages: int  # p
  microbatches: int  # U
  repeats: int = 1  # r

  @property
  def iterations(self) -> int:
    """I = U r + p - 1."""
    return self.microbatches * self.repeats + self.stages - 1

  @property
  def bubble(self) -> float:
    """The share of a stage's iterations that do no work: (p-1) / (U r + p - 1)."""
    return (self.stages - 1) / self.iterations

  def work(self, i, s) -> tuple[Array, Array, Array]:
    """(micro-batch, repeat, busy) of stage `s` at iteration `i` (ints or arrays, broadcast).

    Stage s has taken k = i - s steps; outside 0 <= k < U r it idles (busy false; the micro-batch
    and repeat are then clipped into range, so idle work reads real data and is discarded)."""
    U = self.microbatches
    k = jnp.asarray(i) - jnp.asarray(s)
    busy = (k >= 0) & (k < U * self.repeats)
    k = jnp.clip(k, 0, U * self.repeats - 1)
    return k % U, k // U, busy

  def table(self) -> np.ndarray:
    """i32[I, p]: the micro-batch stage s runs at iteration i (repeat j adds j U), -1 idle."""
    i_Ip, s_Ip = np.meshgrid(np.arange(self.iterations), np.arange(self.stages), indexing="ij")
    u, rep, busy = (np.asarray(a) for a in self.work(i_Ip, s_Ip))
    return np.where(busy, u + rep * self.microbatches, -1).astype(np.int32)


def layer_order(n_layers: int, layout: tuple[int, int]) -> np.ndarray:
  """i32[L]: the layer (depth in the model) stored at each row of the stacked layers.

  Row q = (s r + g) L/(p r) + j holds layer (g p + s) L/(p r) + j: stage s's r groups are
  contiguous rows, so the block split of the `stage` sharding gives each stage its own layers.
  With one repeat this is the identity (GPipe's stages are contiguous layers already)."""
  stages, repeats = layout
  per = n_layers // (stages * repeats)
  return np.arange(n_layers).reshape(repeats, stages, per).transpose(1, 0, 2).reshape(-1)
