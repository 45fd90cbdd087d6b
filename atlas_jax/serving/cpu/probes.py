"""The CPU runner's start-up probes: what it times to choose its weights' layout and its
programs' dots and reductions, and the plans it draws from the timings.

Each probe times the competing ways on the model's own shapes (the best of a few alternating
calls), and its timings are kept per machine and shapes beside jax's persistent compilation
cache (`remembered`): a later start takes them as they are, so it chooses the same plan and its
programs load from the cache. Without a compilation cache they are kept for the process only.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from atlas_jax.serving.cpu import compile as cpu_compile

log = logging.getLogger("atlas_jax.serving")

# Out-major is taken only when its GEMMs are this much faster: where the two layouts time within
# a few percent of each other (a CPU on which neither wins), which one is faster changes from one
# probe to the next, and in-major (the weights as trained, no copy) is the steadier answer.
LAYOUT_MARGIN = 0.05

# XLA's own dots are timed against YNNPACK's only up to this many rows: past a few dozen rows a
# projection is a GEMM, which YNNPACK's blocked kernels run faster than XLA's loops.
XLA_DOTS_PROBE_ROWS = 64

# XLA's dots are taken at a row count only where the probe times them this much faster than
# YNNPACK's. The probe times the projections alone; inside a step XLA's dots share the cores and
# the caches with the rest of the step's loops, which YNNPACK's threads do not, so a small win
# alone can be a loss in the step.
XLA_DOTS_WIN = 1.5

# YNNPACK's reductions are taken at a row count only where the probe times the decode attention
# this much faster so: the probe times the attention alone, and the rest of the step, compiled
# the same way, gains less.
REDUCE_WIN = 1.1

# Bytes of projections the layout probe times: more than a CPU's last-level cache holds, so that
# the GEMMs read their weights from memory, as a step's do.
LAYOUT_PROBE_BYTES = 64 << 20

# `matmul="xla"`: every step's dots XLA's own, whatever its rows.
ALL_ROWS = 1 << 30

_memory: dict[str, dict] = {}  # this process's probes, by key


def _machine() -> str:
  """The CPU and its cores, as the timings depend on them."""
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
  except OSError:
    pass
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return f"{model} x{cores}"


def _store() -> Path | None:
  folder = jax.config.jax_compilation_cache_dir
  return None if not folder else Path(folder) / "atlas_jax_cpu_probes.json"


def remembered(key: tuple, measure: Callable[[], dict]) -> dict:
  """`measure()`'s timings for `key` on this machine: from this process's or the compilation
  cache's record when there is one, else measured and recorded."""
  name = repr((_machine(), key))
  if name in _memory:
    return _memory[name]
  store = _store()
  saved = {}
  if store is not None and store.exists():
    try:
      saved = json.loads(store.read_text())
    except (OSError, ValueError):
      saved = {}
  if name in saved:
    timings = _decode(saved[name])
  else:
    timings = measure()
    if store is not None:
      saved[name] = _encode(timings)
      try:
        store.write_text(json.dumps(saved, indent=1))
      except OSError as e:
        log.info("cpu probes: not kept in %s (%s)", store, e)
  _memory[name] = timings
  return timings


def _encode(timings: dict) -> dict:
  return {
    str(rows): {"/".join(k) if isinstance(k, tuple) else k: v for k, v in ms.items()}
    for rows, ms in timings.items()
  }


def _decode(data: dict) -> dict:
  return {
    int(rows): {tuple(k.split("/")) if "/" in k else k: v for k, v in ms.items()}
    for rows, ms in data.items()
  }


@functools.cache
def _matmul_programs(xla_dots: bool):
  """The probe's two products, x @ W as stored and x @ W.T held out-major, jitted once each (and
  compiled once per set of shapes) with the step programs' options (YNNPACK's dots or XLA's)."""
  options = cpu_compile.CPU_XLA_DOTS_OPTIONS if xla_dots else cpu_compile.compiler_options()
  jit = lambda f: jax.jit(f, compiler_options=options)
  return jit(lambda xs, ws: [xs[w.shape[0]] @ w for w in ws]), jit(
    lambda xs, ts: [xs[t.shape[1]] @ t.T for t in ts]
  )


def best_ms(calls: dict, rounds: int) -> dict:
  """ms of each of `calls` (no-argument callables), the best of `rounds` calls after one that
  compiles, the calls alternating."""
  for f in calls.values():
    jax.block_until_ready(f())  # compiles
  best = dict.fromkeys(calls, math.inf)
  for _ in range(rounds):
    for key, f in calls.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f())
      best[key] = min(best[key], time.perf_counter() - t0)
  return {k: b * 1e3 for k, b in best.items()}


def time_matmuls(
  mats: Sequence[jax.Array], rows: int, kinds: Sequence[tuple[str, str]], rounds: int = 5
) -> dict[tuple[str, str], float]:
  """ms of x[rows, in] times each [in, out] matrix of `mats`, for each (layout, dots) of `kinds`:
  layout "in_major" as stored or "out_major" held transposed (`weights.OutMajor`'s layout),
  dots "ynnpack" or "xla" (compiled as the step programs would be)."""
  xs = {k: jnp.ones((rows, k), mats[0].dtype) for k in {m.shape[0] for m in mats}}
  held = [jnp.transpose(m) for m in mats] if any(k[0] == "out_major" for k in kinds) else None
  calls = {}
  for layout, dots in kinds:
    in_major, out_major = _matmul_programs(dots == "xla")
    f, ws = (in_major, list(mats)) if layout == "in_major" else (out_major, held)
    calls[layout, dots] = functools.partial(f, xs, ws)
  return best_ms(calls, rounds)


def time_decode_attention(
  rows: int, heads: int, kv_heads: int, head_dim: int, dtype, block_size: int, rounds: int = 7
) -> dict[str, float]:
  """ms of 4 layers' paged decode attention for `rows` queries over 512-token contexts on
  scattered pages, the step programs' way ("xla": XLA's loops, 16 keys an iteration) and with
  YNNPACK's reductions (`CPU_YNN_REDUCE_OPTIONS`, `YNN_REDUCE_KEYS` keys an iteration)."""
  from atlas_jax.kernels.paged_attention import paged_attention_xla

  L, Z = 4, block_size
  pages = -(-512 // Z)
  rng = np.random.default_rng(0)
  pool = jnp.asarray(rng.standard_normal((L, rows * pages, Z, kv_heads, head_dim)), dtype)
  table = jnp.asarray(rng.permutation(rows * pages).reshape(rows, pages), jnp.int32)
  lengths = jnp.full((rows,), pages * Z, jnp.int32)
  q = jnp.asarray(rng.standard_normal((rows, heads, head_dim)), dtype)

  def way(options, keys):
    def layers(q):
      def layer(i, q):
        return q + paged_attention_xla(q, pool, pool, table, lengths, layer=i, keys_per_step=keys)

      return jax.lax.fori_loop(0, L, layer, q)

    return jax.jit(layers, compiler_options=options)

  calls = {
    "xla": way(cpu_compile.compiler_options(), None),
    "ynnpack": way(cpu_compile.reduce_compiler_options(), cpu_compile.YNN_REDUCE_KEYS),
  }
  return best_ms({name: functools.partial(f, q) for name, f in calls.items()}, rounds)


def reduce_plan(timings: dict[int, dict[str, float]]) -> tuple[int, ...]:
  """The row counts at which a step takes YNNPACK's reductions, from the probe's `timings` per
  row count: those where the decode attention ran `REDUCE_WIN` times faster that way."""
  return tuple(
    rows for rows, ms in sorted(timings.items()) if ms["ynnpack"] * REDUCE_WIN <= ms["xla"]
  )


def matmul_plan(
  timings: dict[int, dict[tuple[str, str], float]], layout: str, matmul: str
) -> tuple[bool, int]:
  """(out-major, XLA's dots up to this many rows) from the probe's `timings` per row count.

  The layout whose projections take the least time over every row count, each count with its
  faster dots, out-major only when `LAYOUT_MARGIN` faster; on in-major weights, XLA's dots for
  the row counts from the smallest up to the last where they are `XLA_DOTS_WIN` times faster
  than YNNPACK's, never past the first where they are `LAYOUT_MARGIN` slower (in between, the
  row counts around decide)."""
  best = lambda lay, ms: min(v for (l, _), v in ms.items() if l == lay)
  total = lambda lay: sum(best(lay, ms) for ms in timings.values())
  has = lambda lay: all(any(l == lay for l, _ in ms) for ms in timings.values())
  if layout == "auto" and has("out_major") and has("in_major"):
    out_major = total("out_major") < total("in_major") * (1 - LAYOUT_MARGIN)
  else:
    out_major = layout == "out_major"
  if matmul != "auto" or out_major:
    return out_major, ALL_ROWS if matmul == "xla" else 0
  xla_rows = 0
  for rows in sorted(timings):
    ms = timings[rows]
    xla, ynn = ms.get(("in_major", "xla")), ms.get(("in_major", "ynnpack"))
    if xla is None or ynn is None or xla > ynn * (1 + LAYOUT_MARGIN):
      break
    if xla * XLA_DOTS_WIN <= ynn:
      xla_rows = rows
  return out_major, xla_rows
