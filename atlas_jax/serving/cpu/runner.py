"""`CPUModelRunner`: the serving runner specialised for XLA's CPU backend (see the package's
docstring for what changes and why)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from atlas_jax.config import CPUConfig
from atlas_jax.serving import batch, sizing
from atlas_jax.serving.batch import Row, pow2
from atlas_jax.serving.cpu import compile as cpu_compile
from atlas_jax.serving.cpu import probes
from atlas_jax.serving.cpu.weights import layer_bytes, out_major_candidates, unstack_layers
from atlas_jax.serving.runner import ModelRunner, Shape, first_of_each_kind
from atlas_jax.serving.scheduler import burst_capacity

log = logging.getLogger("atlas_jax.serving")

# Prompt tokens per row of a segmented prefill (`CPUModelRunner.segment`): XLA's paged loop over
# a row walks its own pages, so a prompt costs its own segments, padded to 16 at most.
PREFILL_SEGMENT = 16

# `weight_layout="auto"` keeps a model's layer stacks stacked (the layer scan slicing each
# layer's weights, a copy a step) when no layer holds more than this many bytes, and holds them
# one array per layer above. The copy grows with a layer's bytes while what the scan saves (one
# loop body in the instruction cache, a compile time flat in depth) does not: the crossover sits
# where a layer's weights stop fitting the caches next to its activations, a few MiB on the
# CPUs measured (`python bench/serve.py --only layouts` times both).
STACKED_LAYER_BYTES = 8 << 20

# `weight_layout="auto"` keeps a deeper model stacked whatever its layers' bytes: a program of
# layers held one array each is unrolled, its machine code growing with the depth (on the
# 135M-parameter, 30-layer shape of `bench/startup.py`: about 80 MB resident and 600-1,100 memory
# maps per compiled step program, against about 20 MB and 300 stacked), and a server holds a few
# dozen programs: deep unrolled programs would exhaust its memory and its maps.
UNROLLED_MAX_LAYERS = 8


def cores() -> int:
  """The CPU cores this process may run on."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fine_bucket(n: int) -> int:
  """n rounded up to a power of two up to 16, then to four steps per power of two (20, 24, 28,
  32, 40, ...): above 16, at most a fifth of a bucket is padding, where a power of two can waste
  half; below, a few shapes more would buy little."""
  if n <= 16:
    return pow2(n)
  step = pow2(n) // 8
  return -(-n // step) * step


class CPUModelRunner(ModelRunner):
  """The accelerator runner with XLA's CPU backend's own weights, calls and compiles.

  Args (besides `ModelRunner`'s):
    cpu: `serve.engine.cpu` (weight layout, dots, reductions).
    layout_rows: the largest decode batch the probes time.

  With `lora` (served LoRA adapters), the layer stacks stay stacked and in-major whatever
  `cpu.weight_layout` says: loading an adapter writes its slot of the held [L, S, ...] adapter
  stacks in place (`ServedAdapters`), so the held state must keep the model's own layout.
  """

  def __init__(
    self,
    model,
    *,
    draft,
    drafter,
    mesh,
    block_size: int,
    max_blocks: int,
    min_batch_bucket: int | None = None,
    cpu: CPUConfig | None = None,
    layout_rows: int = 32,
    kv_cache_dtype: str = "auto",
    lora: bool = False,
  ):
    cpu = CPUConfig() if cpu is None else cpu
    cfg = model.cfg
    self.mesh = mesh
    self.min_batch_bucket = 1 if min_batch_bucket is None else min_batch_bucket
    self.model_config, self.block_size = cfg, block_size
    # Prompt rows cut into segments where attention's work follows each row's own pages (XLA's
    # paged loop); with a drafter, rows padded to the longest chunk, as its windows expect.
    attn = model.blocks.attn
    paged_loop = attn.implementation in (None, "xla")
    self.segment = PREFILL_SEGMENT if paged_loop and drafter is None else None
    state = nnx.state(model)
    layout = cpu.weight_layout
    if layout == "auto" and cfg.n_layers > UNROLLED_MAX_LAYERS:
      layout = "stacked"  # `UNROLLED_MAX_LAYERS`
    if lora and layout != "stacked":
      log.info("weights: layers stacked, as served LoRA adapters are written into the stacks")
      layout = "stacked"
    out_major, self.xla_dots_rows = self._matmul_plan(layout, cpu.matmul, state, layout_rows)
    self.ynn_reduce_rows = self._reduce_plan(cpu.reductions, paged_loop, layout_rows)
    self.out_major = out_major
    # How the layer stacks are held (`stacked_layers`): as trained, sliced per layer by the layer
    # scan, or one array per layer (`model.scan.Unstacked`), run as a loop of layers.
    self.stacked = self.stacked_layers(layout, out_major, layer_bytes(state))
    log.info("weights: layers %s", "stacked" if self.stacked else "one array each")
    super().__init__(
      model,
      draft=draft,
      drafter=drafter,
      mesh=mesh,
      block_size=block_size,
      max_blocks=max_blocks,
      min_batch_bucket=self.min_batch_bucket,
      kv_cache_dtype=kv_cache_dtype,
      lora=lora,
    )

  # -- the hooks ---------------------------------------------------------------------------------

  def hold(self, placed_state):
    if self.stacked:
      return placed_state
    return unstack_layers(placed_state, self.mesh, out_major=self.out_major)

  def compile_programs(self):
    return cpu_compile.CPUCompile(self.xla_dots_rows, self.ynn_reduce_rows)

  # -- the plans ---------------------------------------------------------------------------------

  def _one_cpu(self) -> bool:
    """One device whose XLA takes the step programs' options: where the weights' layout and
    the dots are chosen by what runs faster."""
    return self.mesh is None and bool(cpu_compile.compiler_options())

  def stacked_layers(self, layout: str, out_major: bool, layer_bytes: int) -> bool:
    """Whether the layer stacks stay stacked: with `layout` "stacked" (which "auto" becomes past
    `UNROLLED_MAX_LAYERS` layers), or "auto" on one device with in-major projections and layers
    of at most `STACKED_LAYER_BYTES`."""
    if layout == "stacked":
      return True
    small = layer_bytes <= STACKED_LAYER_BYTES
    return layout == "auto" and self._one_cpu() and not out_major and small

  def _matmul_plan(self, layout: str, matmul: str, state, max_rows: int) -> tuple[bool, int]:
    """(whether the projections are held out-major, `weights.OutMajor`; the most token rows a
    step may have to compile its dots as XLA's own). As `layout` and `matmul` say; for "auto",
    on one device, from timing the projections at every decode batch bucket up to `max_rows`
    (`probes.time_matmuls`, `probes.matmul_plan`), remembered per machine and shapes."""
    if layout == "stacked":  # in-major, as trained
      layout = "in_major"
    if not self._one_cpu():
      return layout == "out_major", 0
    if "auto" not in (layout, matmul) or layout == "out_major":
      return probes.matmul_plan({}, layout, matmul)
    mats = out_major_candidates(state, limit_bytes=probes.LAYOUT_PROBE_BYTES)
    if not mats:
      return probes.matmul_plan({}, "in_major" if layout == "auto" else layout, matmul)
    buckets = sorted({pow2(n, self.min_batch_bucket) for n in range(1, max_rows + 1)})
    layouts = ("in_major", "out_major") if layout == "auto" else (layout,)
    libraries = ("ynnpack", "xla") if matmul == "auto" else (matmul,)
    key = ("matmuls", tuple((m.shape, str(m.dtype)) for m in mats), tuple(buckets), layouts)
    key += (libraries,)

    def kinds(rows):
      # XLA's dots over out-major weights: several times slower wherever measured.
      return [
        (lay, lib)
        for lay in layouts
        for lib in libraries
        if not (lib == "xla" and (lay == "out_major" or rows > probes.XLA_DOTS_PROBE_ROWS))
      ]

    timings = probes.remembered(
      key, lambda: {rows: probes.time_matmuls(mats, rows, kinds(rows)) for rows in buckets}
    )
    out_major, xla_rows = probes.matmul_plan(timings, layout, matmul)
    column = lambda kind: "/".join(
      f"{timings[r][kind]:.2f}" if kind in timings[r] else "-" for r in buckets
    )
    probed = sorted({k for ms in timings.values() for k in ms})
    log.info(
      "weights: projections held %s, dots %s (%d of them, %d MB; ms at %s rows: %s)",
      "out-major" if out_major else "in-major",
      f"XLA's up to {xla_rows} rows, YNNPACK's above" if xla_rows else "YNNPACK's",
      len(mats),
      sum(m.nbytes for m in mats) >> 20,
      "/".join(map(str, buckets)),
      ", ".join(f"{lay.replace('_', '-')} {lib} {column((lay, lib))}" for lay, lib in probed),
    )
    return out_major, xla_rows

  def _reduce_plan(self, reductions: str, paged_loop: bool, max_rows: int) -> tuple[int, ...]:
    """The token row counts of steps that compile with YNNPACK's reductions too (`ByRows`),
    among the decode batch buckets up to `YNN_REDUCE_ROWS` and `max_rows` above those that take
    XLA's own dots: none with "xla", off one device, or where the decode attention is not XLA's
    paged loop over KV pages; all of them with "ynnpack"; with "auto", the largest of them if the
    probe timed the decode attention `probes.REDUCE_WIN` faster that way there."""
    kv_pages = self.model_config.mla is None
    if reductions == "xla" or not self._one_cpu() or not paged_loop or not kv_pages:
      return ()
    if not cpu_compile.reduce_compiler_options():
      return ()  # an XLA without the option
    top = min(cpu_compile.YNN_REDUCE_ROWS, max_rows)
    buckets = sorted({pow2(n, self.min_batch_bucket) for n in range(1, top + 1)})
    buckets = [rows for rows in buckets if self.xla_dots_rows < rows <= top]
    if reductions == "ynnpack" or not buckets:
      return tuple(buckets)
    # "auto" times the largest: a call per page step pays off, if at all, at the most rows.
    buckets = buckets[-1:]
    cfg = self.model_config
    shape = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, str(jnp.dtype(cfg.dtype)), self.block_size)
    timings = probes.remembered(
      ("reductions", shape, tuple(buckets)),
      lambda: {rows: probes.time_decode_attention(rows, *shape) for rows in buckets},
    )
    chosen = probes.reduce_plan(timings)
    log.info(
      "decode attention: reductions %s (ms at %s rows: xla %s, ynnpack %s)",
      f"YNNPACK's at {'/'.join(map(str, chosen))} rows, XLA's elsewhere" if chosen else "XLA's",
      "/".join(map(str, buckets)),
      "/".join(f"{timings[r]['xla']:.2f}" for r in buckets),
      "/".join(f"{timings[r]['ynnpack']:.2f}" for r in buckets),
    )
    return chosen

  # -- shapes ------------------------------------------------------------------------------------

  def segment_bucket(self, n_rows: int) -> int:
    """The padded rows per replica of a segmented prefill with `n_rows` segments on its
    busiest replica."""
    return fine_bucket(max(n_rows, self.min_batch_bucket))

  def record_rows(self, shape: Shape) -> int:
    return shape.b * self.n_replicas  # one row per sequence slot, every kind

  def widths(self) -> list[int]:
    """One block-table width, the context's: XLA's paged loop walks each row's pages up to the
    longest length held, whatever the table's width, so a narrower table would save no work
    and cost a compiled program (each is tens of MB of machine code on a CPU)."""
    return [self.max_blocks]

  def largest_step_bytes(self, config) -> int:
    budget = config.max_num_batched_tokens or sizing.DEFAULT_BATCHED_TOKENS
    if self.segment is not None:  # the budget in segments
      b = self.segment_bucket(-(-budget // self.segment))
      return self.step_bytes(Shape("prefill", b, self.segment, self.max_blocks))
    T = config.prefill_chunk
    return self.step_bytes(Shape("prefill", self.bucket(-(-budget // T)), T, self.max_blocks))

  def prefill_shapes(self, max_rows: int, budget: int, prefill_chunk: int, level: str):
    """Every (rows b per replica, tokens T, block-table columns M) a prefill call of at most
    `max_rows` rows and `budget` tokens per replica can have (one table width: `widths`)."""
    del level  # every level: a prompt after a cached prefix takes the same shapes
    if self.segment is not None:
      C = self.segment
      # Each row pads less than a segment; no row is longer than a chunk.
      most = min(-(-(budget + max_rows * (C - 1)) // C), max_rows * -(-prefill_chunk // C))
      buckets = sorted({self.segment_bucket(n) for n in range(1, most + 1)})
      return [(b, C, self.max_blocks) for b in buckets]
    buckets = sorted({self.bucket(n) for n in range(1, max_rows + 1)})
    chunks = sorted({min(pow2(n, 16), prefill_chunk) for n in range(2, prefill_chunk + 1)})
    return [(B, T, self.max_blocks) for B in buckets for T in chunks]

  def shapes(self, config, level: str, *, capacity: int) -> tuple[list[Shape], list[str]]:
    """(every shape of the CPU runner's calls at warm-up `level`, what is left to first use):
    prefills (segments, or rows padded to their chunk), bursts (which run decode steps too,
    `decode`; decode steps of their own with bursts off) and rounds at every batch bucket,
    over the one table width."""
    always = ["penalties, logit bias, guided masks, min_tokens, prompt logprobs, n > 1 copies"]
    if level == "none":
      return [], ["every step shape", *always]
    buckets = sorted({self.bucket(n) for n in range(1, config.max_num_seqs + 1)})
    widths = self.widths()
    prefills = self.prefill_shapes(
      config.max_num_seqs, config.max_num_batched_tokens, config.prefill_chunk, level
    )
    out = [Shape("prefill", b, T, M) for b, T, M in prefills]
    if capacity < 2:  # no burst program to run a decode step (`decode`): one of its own
      out += [Shape("decode", b, 1, M) for M in widths for b in buckets]
    return first_of_each_kind(out + self.decode_shapes(config, capacity)), always

  def _warmup_call(self, shape: Shape) -> tuple:
    if shape.kind in ("prefill", "decode"):
      return super()._warmup_call(dataclasses.replace(shape, kind="step"))
    return super()._warmup_call(shape)

  def _compile_threads(self) -> int:
    return cores()

  # -- calls -------------------------------------------------------------------------------------

  def segments(self, rows: Sequence[Row]) -> list[Row]:
    """Each row cut into rows of `segment` tokens at most, in order.

    One call computes them all: every layer writes the new keys and values of all its rows
    before any row attends, so a segment sees the ones before it as cached context. Rows padded
    to a common T pad each prompt to the longest (and the batch to a power of two); segments pad
    each prompt to a multiple of `segment`, and their count to a `fine_bucket`.
    """
    C = self.segment
    return [
      dataclasses.replace(row, n=min(C, row.n - j), start=row.start + j)
      for row in rows
      for j in range(0, row.n, C)
    ]

  def carries(self, prefill: Sequence[Row], decode: Sequence[Row]) -> bool:
    """Whether the segmented prefill of `prefill` takes the `decode` rows (one token each) as
    segments in the padding its segment bucket computes anyway: one call for the step instead
    of a prefill and a decode call, each reading every weight, at no more token slots."""
    if self.segment is None or not prefill or not decode:
      return False
    segments = self.segments(prefill)
    before = self.segment_bucket(self.busiest(segments))
    return self.segment_bucket(self.busiest([*segments, *decode])) == before

  def execute(self, rows: Sequence[Row]) -> dict:
    """A step as one call when the decode rows ride in the prompts' segments (`carries`), else
    a prefill call and a decode call (`decode`)."""
    prefill = [row for row in rows if row.n > 1]
    decode = [row for row in rows if row.n == 1]
    if self.carries(prefill, decode):
      return self.forward([*prefill, *decode], None)
    out = {}
    if prefill:
      out.update(self.forward(prefill, None))
    if decode:
      out.update(self.decode(decode))
    return out

  def decode(self, rows: Sequence[Row]) -> dict:
    """One decode iteration of `rows` (a pending token each), as `forward` returns it: the
    burst program run for one iteration (its count is an input), so that a decode step and a
    burst of the same batch bucket share one compiled program, where each program a CPU holds
    costs tens of MB. A forward call instead where a row's sampling needs a mask (a guided row,
    a row in its min_tokens: a burst carries none) or bursts are off."""
    capacity = burst_capacity(self.limits)
    if capacity < 2 or self.needs_masks(rows):
      return self.forward(rows, 1)
    drawn = self.burst(rows, 1, capacity)
    tok, lp, top_ids, top_lp = (
      np.asarray(a[0]) for a in (drawn.tok_IB, drawn.lp_IB, drawn.top_ids_IBk, drawn.top_lp_IBk)
    )
    return {
      row.req.id: (int(tok[b]), float(lp[b]), top_ids[b], top_lp[b])
      for row, b in zip(rows, drawn.slot)
    }

  def forward(self, rows: Sequence[Row], T: int | None) -> dict:
    """One call over `rows` in rows form (T None: prompt rows, as `segments` where the runner
    cuts them, else padded to the longest chunk, bucketed); returns {request id: (token,
    logprob, top ids, top logprobs)}, a segmented row's from its last segment."""
    segmented = T is None and self.segment is not None
    if segmented:
      rows, T = self.segments(rows), self.segment
      b, M = self.segment_bucket(self.busiest(rows)), self.max_blocks
    else:
      if T is None:
        T = min(pow2(max(r.n for r in rows), 16), self.limits.prefill_chunk)
      b, M = self.bucket(self.busiest(rows)), self.width(max(len(r.blocks) for r in rows))
    layout = batch.rows_layout(rows, self._replica, self.n_replicas, b, T)
    penalties = any(r.req.params.uses_penalties for r in rows)
    x = self.record(rows, layout, M, penalties=penalties)
    self._met("prefill" if T > 1 else "decode", x)
    return self._forward(rows, x, layout.slot)


__all__ = ["CPUModelRunner", "STACKED_LAYER_BYTES", "UNROLLED_MAX_LAYERS", "cores", "fine_bucket"]
