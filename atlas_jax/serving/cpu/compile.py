"""How the CPU runner compiles its step programs: XLA's CPU options, and one program compiled
several ways, picked by the rows of each call (`ByRows`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp

from atlas_jax.serving.batch import StepRecord

log = logging.getLogger("atlas_jax.serving")


# XLA's CPU backend hands dots, elementwise fusions and reductions to YNNPACK by default. A
# serving step is many small ops (the paged attention's page loop, a decode step's norms and
# softmaxes at a few dozen rows), where a library call costs more than XLA's own loop: the step
# programs hand YNNPACK only their dots. XLA also rewrites every reduction of more than 32
# elements into a reduce-window of 32 and a reduction of the windows, and a reduce-window fuses
# nothing before it: the paged decode attention's scores, a product summed over a head's dims,
# would be written out whole a page step and read back. Without that pass the product and its
# sum are one loop. (A training step gains nothing from either, so the trainer keeps XLA's
# defaults.)
CPU_COMPILER_OPTIONS = {
  "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
  "xla_disable_hlo_passes": "tree_reduction_rewriter",
}


@functools.cache
def compiler_options(options: tuple = ()) -> dict:
  """`CPU_COMPILER_OPTIONS` (or the `options` items given) on the CPU backend, if this XLA knows
  them; {} elsewhere."""
  wanted = dict(options) or CPU_COMPILER_OPTIONS
  if jax.default_backend() != "cpu":
    return {}
  try:
    jax.jit(lambda x: x + 1, compiler_options=wanted).lower(jnp.zeros(())).compile()
  except Exception as e:  # an XLA that renamed or dropped an option: without them, said once
    log.info("serving programs: without %s (%s)", sorted(wanted), str(e).splitlines()[0])
    return {}
  return dict(wanted)


# The same with no YNNPACK at all: the dots are XLA's own. At a few rows a projection is a
# matrix-vector product in all but name, bound by reading its weights; some CPUs' YNNPACK dots
# read them slower than XLA's loops do there, and win from a few dozen rows on (the start-up
# probe, `probes.matmul_plan`, finds where).
CPU_XLA_DOTS_OPTIONS = {**CPU_COMPILER_OPTIONS, "xla_cpu_experimental_ynn_fusion_type": ""}


# With YNNPACK's reductions too: at a decode step of a few rows (`YNN_REDUCE_ROWS` at most) the
# paged attention's page step, scored over `YNN_REDUCE_KEYS` keys, is then one YNNPACK call,
# where XLA's loops spend more on each of the small products than they compute. It pays for a
# call per page step, which small heads recover and larger ones do not, so the runner times the
# decode attention both ways at start-up (`serve.engine.cpu.reductions`,
# `probes.time_decode_attention`).
CPU_YNN_REDUCE_OPTIONS = {
  **CPU_COMPILER_OPTIONS,
  "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,"
  "LIBRARY_FUSION_TYPE_REDUCE",
}
YNN_REDUCE_ROWS = 4
YNN_REDUCE_KEYS = 32


def reduce_compiler_options() -> dict:
  """`CPU_YNN_REDUCE_OPTIONS` on the CPU backend, if this XLA knows them; {} elsewhere."""
  return compiler_options(tuple(CPU_YNN_REDUCE_OPTIONS.items()))


@dataclasses.dataclass(frozen=True)
class ByRows:
  """A step program compiled several ways, called by its token rows (the record's R x T):
  the first of `tiers` (most rows, program) whose rows it does not exceed, else `many`. On CPU
  the tiers are XLA's own dots (a few rows, `xla_dots_rows`), then YNNPACK's reductions at the
  row counts of `ynn_reduce_rows` (`many` at those between); `many` is YNNPACK's dots alone."""

  tiers: tuple[tuple[int, Callable], ...]
  many: Callable

  def pick(self, x: StepRecord) -> Callable:
    rows = x.tokens_RT.shape[0] * x.tokens_RT.shape[1]
    return next((f for most, f in self.tiers if rows <= most), self.many)

  def __call__(self, states, pools, x: StepRecord, *args):
    return self.pick(x)(states, pools, x, *args)

  def lower(self, states, pools, x: StepRecord, *args):
    return self.pick(x).lower(states, pools, x, *args)

  def _cache_size(self) -> int:  # as a jitted function's: the shapes compiled, every way
    ways = {id(f): f for f in (self.many, *(f for _, f in self.tiers))}
    return sum(f._cache_size() for f in ways.values())


@dataclasses.dataclass(frozen=True)
class CPUCompile:
  """`steps.programs`' compile hook on a CPU: `CPU_COMPILER_OPTIONS` for every step; a step of at
  most `xla_dots_rows` token rows with XLA's own dots; a step of exactly one of
  `ynn_reduce_rows` rows with YNNPACK's reductions too, its decode attention walking
  `YNN_REDUCE_KEYS` keys an iteration (`ByRows`)."""

  xla_dots_rows: int = 0
  ynn_reduce_rows: tuple[int, ...] = ()

  def tiers(self) -> list[tuple[int, dict | None, int | None]]:
    """(most rows, compiler options, decode attention keys an iteration); None: the default
    way's options."""
    options = compiler_options()
    tiers: list[tuple[int, dict | None, int | None]] = []
    if options and self.xla_dots_rows > 0:
      tiers.append((self.xla_dots_rows, CPU_XLA_DOTS_OPTIONS, None))
    reduce_options = reduce_compiler_options() if options else {}
    for rows in sorted(self.ynn_reduce_rows) if reduce_options else ():
      below = tiers[-1][0] if tiers else 0
      if rows <= below:
        continue
      if rows - 1 > below:  # the row counts in between: YNNPACK's dots alone
        tiers.append((rows - 1, None, None))
      tiers.append((rows, reduce_options, YNN_REDUCE_KEYS))
    return tiers

  def __call__(self, make_run: Callable[[tuple], Callable], **jit_kwargs) -> Callable:
    many = jax.jit(
      make_run(()), donate_argnums=(1,), compiler_options=compiler_options(), **jit_kwargs
    )
    tiers = self.tiers()
    if not tiers:
      return many
    ways = {}  # one jitted function per way, shared by its tiers

    def way(opts, keys):
      if opts is None:
        return many
      key = (tuple(sorted(opts.items())), keys)
      if key not in ways:
        kernel = () if keys is None else (("keys_per_step", keys),)
        ways[key] = jax.jit(
          make_run(kernel), donate_argnums=(1,), compiler_options=dict(opts), **jit_kwargs
        )
      return ways[key]

    return ByRows(tuple((rows, way(opts, keys)) for rows, opts, keys in tiers), many)
