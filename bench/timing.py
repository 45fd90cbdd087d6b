"""How the benchmarks time things, written once: one call repeated, or a loop of steps.

Both wait for the device before reading the clock (`jax.block_until_ready` passes anything that
is not a jax array, such as a torch tensor, through unchanged).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax


def seconds_per_call(fn: Callable, *args, iters: int, repeat: int = 1) -> float:
  """Median over `repeat` of the mean seconds of `iters` back-to-back calls `fn(*args)`, after
  one warm-up call (which compiles)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeat):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / iters)
  return statistics.median(times)


def seconds_for(
  step: Callable[[Any], Any],
  inputs: Iterable,
  *,
  wait: Callable[[Any], Any] = jax.block_until_ready,
) -> tuple[float, Any]:
  """(seconds, the last result) of `step(x)` for each of `inputs` back to back, then `wait` on
  the last result; a step that carries state (a train step) holds it in its closure."""
  out = None
  t0 = time.perf_counter()
  for x in inputs:
    out = step(x)
  wait(out)
  return time.perf_counter() - t0, out
