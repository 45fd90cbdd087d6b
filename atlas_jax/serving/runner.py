"""The model runner: owns the device mesh, the placed weights, the pools and the jitted programs,
and executes a step's rows from one `StepInputs` pytree.

The scheduler hands it rows (`Row`: a request, the tokens it computes, where they start, its
blocks); the runner lays them out (each data-parallel replica's rows in its own slice of the
batch, padded to a bucket), builds the step's inputs once for every program, runs the program
and reads back what was drawn. It knows nothing of queues or allocators.

On one device (no mesh) the weights and pools stay where the model put them and the programs
are the plain single-device ones. On a mesh (`atlas_jax.serving.mesh`), weights are placed by
their logical axes, a KV pool's kv heads split over the tensor axis (repeated up to it when
fewer), an MLA latent pool held whole per replica, and every pool's pages split over the data
axis.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from atlas_jax.decoding.drafters import Drafter, hidden_store
from atlas_jax.decoding.sampling import PADDING, SamplingArrays
from atlas_jax.model.scan import out_major_candidates, unstack_layers
from atlas_jax.serving import mesh as placement
from atlas_jax.serving import steps
from atlas_jax.serving.requests import Request
from atlas_jax.serving.steps import StepInputs

Array = jax.Array
log = logging.getLogger("atlas_jax.serving")


def pow2(n: int, minimum: int = 1) -> int:
  return max(minimum, 1 << max(n - 1, 0).bit_length())


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


# Prompt tokens per row of a segmented prefill (`ModelRunner.segment`).
PREFILL_SEGMENT = 16


# Bytes of projections `weight_layout="auto"` times both ways: more than a CPU's last-level cache
# holds, so that the GEMMs read their weights from memory, as a step's do.
LAYOUT_PROBE_BYTES = 64 << 20

# Out-major is taken only when its GEMMs are this much faster: where the two layouts time within
# a few percent of each other (a CPU on which neither wins), which one is faster changes from one
# probe to the next, and in-major (the weights as trained, no copy) is the steadier answer.
LAYOUT_MARGIN = 0.05

# The probe's timings per set of shapes, row counts and settings, for this process: an engine
# built again for the same model takes the same plan, so its programs (cached by the state's
# structure) compile once.
_probes: dict[tuple, dict[int, dict[tuple[str, str], float]]] = {}


# XLA's own dots are timed against YNNPACK's only up to this many rows: past a few dozen rows a
# projection is a GEMM, where YNNPACK's are the faster.
XLA_DOTS_PROBE_ROWS = 64

# XLA's dots are taken at a row count only where the probe times them this much faster than
# YNNPACK's (at most 1 / 1.5 of their time). The probe times the projections alone; inside a step
# program XLA's dots fare worse against YNNPACK's: on a Zen 4 EPYC, projections the probe timed
# 1.1-1.4x faster at 2-16 rows made the whole decode step 3-15% slower (5.79 against 5.59 ms at
# 4 rows, 8.28 against 6.97 at 8, interleaved), and the probe's plan flipped between starts on
# its 1-row tie; on the AVX2 EPYC where they win (BENCHMARKS.md) the probe times them 2-2.5x.
XLA_DOTS_WIN = 1.5

# YNNPACK's reductions are taken at a row count only where the probe times the decode attention
# this much faster so: the probe times the attention alone, and inside a whole step the gain
# was smaller (the tiny preset at 4 rows: 1.3x alone, 1.15x for the 8-step burst).
REDUCE_WIN = 1.1

# `weight_layout="auto"` on one CPU device keeps a model's layer stacks stacked (the layer scan
# slicing each layer's weights, a copy a step) when no layer holds more than this many bytes, and
# holds them one array per layer above. Engine.generate at batch 8 on 2 Zen 4 cores, stacked /
# per-layer (`python bench/serve.py --only layouts`, 32 prompts, 128 new tokens): 1.05-1.34x at
# 1.6 MB a layer (the tiny preset), 0.99-1.09x at 6.3 MB (d_model 384, FFN 1024), 0.78-1.01x at
# 9.4 MB (d_model 512, FFN 1024), 0.78-0.91x at 11.8 MB (d_model 512, FFN 1408). BENCHMARKS.md,
# "Eighth round".
STACKED_LAYER_BYTES = 8 << 20

# `cpu_matmul="xla"`: every step's dots XLA's own, whatever its rows.
ALL_ROWS = 1 << 30


@functools.cache
def _matmul_programs(xla_dots: bool):
  """The probe's two products, x @ W as stored and x @ W.T held out-major, jitted once each (and
  compiled once per set of shapes) with the step programs' options (YNNPACK's dots or XLA's)."""
  options = steps.CPU_XLA_DOTS_OPTIONS if xla_dots else steps.compiler_options()
  jit = lambda f: jax.jit(f, compiler_options=options)
  return jit(lambda xs, ws: [xs[w.shape[0]] @ w for w in ws]), jit(
    lambda xs, ts: [xs[t.shape[1]] @ t.T for t in ts]
  )


def time_matmuls(
  mats: Sequence[Array], rows: int, kinds: Sequence[tuple[str, str]], rounds: int = 5
) -> dict[tuple[str, str], float]:
  """ms of x[rows, in] times each [in, out] matrix of `mats`, for each (layout, dots) of `kinds`:
  layout "in_major" as stored or "out_major" held transposed (`model.scan.OutMajor`'s layout),
  dots "ynnpack" or "xla" (compiled as the step programs would be); each the best of `rounds`
  calls, the kinds alternating."""
  xs = {k: jnp.ones((rows, k), mats[0].dtype) for k in {m.shape[0] for m in mats}}
  held = [jnp.transpose(m) for m in mats] if any(k[0] == "out_major" for k in kinds) else None
  calls = {}
  for layout, dots in kinds:
    in_major, out_major = _matmul_programs(dots == "xla")
    f, ws = (in_major, list(mats)) if layout == "in_major" else (out_major, held)
    calls[layout, dots] = functools.partial(f, xs, ws)
  return best_ms(calls, rounds)


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


def time_decode_attention(
  rows: int, heads: int, kv_heads: int, head_dim: int, dtype, block_size: int, rounds: int = 7
) -> dict[str, float]:
  """ms of 4 layers' paged decode attention for `rows` queries over 512-token contexts on
  scattered pages, the step programs' way ("xla": XLA's loops, 16 keys an iteration) and with
  YNNPACK's reductions (`steps.CPU_YNN_REDUCE_OPTIONS`, `steps.YNN_REDUCE_KEYS` keys an
  iteration: "ynnpack"); each the best of `rounds` calls, the two alternating."""
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
    "xla": way(steps.compiler_options(), None),
    "ynnpack": way(steps.reduce_compiler_options(), steps.YNN_REDUCE_KEYS),
  }
  return best_ms({name: functools.partial(f, q) for name, f in calls.items()}, rounds)


def reduce_plan(timings: dict[int, dict[str, float]]) -> tuple[int, ...]:
  """The row counts at which a step takes YNNPACK's reductions, from the probe's `timings` per
  row count: those where the decode attention ran `REDUCE_WIN` times faster that way."""
  return tuple(
    rows for rows, ms in sorted(timings.items()) if ms["ynnpack"] * REDUCE_WIN <= ms["xla"]
  )


def matmul_plan(
  timings: dict[int, dict[tuple[str, str], float]], layout: str, cpu_matmul: str
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
  if cpu_matmul != "auto" or out_major:
    return out_major, ALL_ROWS if cpu_matmul == "xla" else 0
  xla_rows = 0
  for rows in sorted(timings):
    ms = timings[rows]
    xla, ynn = ms.get(("in_major", "xla")), ms.get(("in_major", "ynnpack"))
    if xla is None or ynn is None or xla > ynn * (1 + LAYOUT_MARGIN):
      break
    if xla * XLA_DOTS_WIN <= ynn:
      xla_rows = rows
  return out_major, xla_rows


@jax.jit
def _carried(tok_IB, counts_BV, prompt_mask_BV, index_B, n_steps):
  """A chained burst's inputs from the burst before it, still on the device: each row's last
  draw (the `n_steps`-th) as its pending token (and its penalty counts), row b taken from
  `index_B[b]`. One dispatch: as eager indexing, each of these ops cost more host time than a
  burst step."""
  take = lambda x: None if x is None else x[index_B]
  last_B = jax.lax.dynamic_index_in_dim(tok_IB, n_steps - 1, keepdims=False)
  return last_B[index_B][:, None], take(counts_BV), take(prompt_mask_BV)


def padding_inputs(B: int, T: int, M: int) -> StepInputs:
  """Inputs of B padding rows (length -1: nothing is written or read), T tokens, M columns."""
  zeros = lambda *shape: np.zeros(shape, np.int32)
  return StepInputs(
    tokens_BT=zeros(B, T),
    positions_BT=np.full((B, T), -1, np.int32),
    block_table_BM=zeros(B, M),
    lengths_B=np.full((B,), -1, np.int32),
    last_B=zeros(B),
    seed_B=zeros(B),
    step_B=zeros(B),
    sampling=SamplingArrays.from_params([], pad_to=B),
  )


def layer_bytes(state, stacks=("blocks", "dense_blocks")) -> int:
  """The weight bytes of the model's largest layer: each stack's parameters over its depth."""
  per_layer = [
    sum(x.nbytes // x.shape[0] for x in jax.tree.leaves(state[name]))
    for name in stacks
    if name in state
  ]
  return max(per_layer, default=0)


@dataclasses.dataclass(frozen=True, eq=False)
class Row:
  """One request's part in a step."""

  req: Request
  n: int  # tokens computed for it (a prompt chunk; 1: the pending token of a decode step)
  start: int  # its tokens in the pool before the step (the first new token's position)
  step: int  # the index of the first token the step draws for it
  blocks: tuple[int, ...]  # its blocks' global ids, reserved ones included


@dataclasses.dataclass
class Drawn:
  """A dispatched burst or round: its rows, and its draws, on the device until read."""

  rows: list[Row]
  slot: np.ndarray  # i32[n rows] each row's index in the step's batch
  prompt_mask_BV: Array | None  # bool[B, V] (penalties), for a burst chained on this one
  tok_IB: Array  # i32[I, B] draws per iteration (a round: its k + 1 positions)
  lp_IB: Array  # f32[I, B]
  top_ids_IBk: Array  # i32[I, B, 5]
  top_lp_IBk: Array  # f32[I, B, 5]
  counts_BV: Array | None  # i32[B, V] output token counts after the burst (penalties)
  n_draws: np.ndarray | None = None  # i32[n rows] real draws per row (a round)
  n_steps: int | None = None  # a burst's iterations: the first n_steps of its I rows are draws


class ModelRunner:
  """Runs the model's programs over the pools.

  Args:
    model: the served Transformer (already repeated to the tensor size where needed).
    draft: the draft model, or None ("mtp" drafts with the model's own heads: `drafter`).
    drafter: the drafter for `draft`, or None.
    mesh: a serving mesh (`placement.serving_mesh`), or None for one device.
    block_size: Z.
    max_blocks: M at most, the block-table columns of the longest context.
    min_batch_bucket: rows per replica are padded to a power of two, at least this many.
  """

  def __init__(
    self,
    model,
    *,
    draft,
    drafter: Drafter | None,
    mesh: Mesh | None,
    block_size: int,
    max_blocks: int,
    min_batch_bucket: int,
    weight_layout: str = "auto",
    cpu_matmul: str = "auto",
    cpu_reductions: str = "auto",
    layout_rows: int = 32,
  ):
    cfg = model.cfg
    self.model_config = cfg
    self.mesh = mesh
    self.n_replicas, self.tensor = (1, 1) if mesh is None else placement.mesh_sizes(mesh)
    self.block_size, self.max_blocks = block_size, max_blocks
    self.min_batch_bucket = min_batch_bucket
    # Block tables narrower than 64 tokens would only add compiled shapes.
    self.min_blocks = pow2(-(-64 // block_size))
    self.model, self.draft, self.drafter = model, draft, drafter
    # Prompt rows cut into segments (`segments`) where attention's work does not grow with the
    # block table's width: XLA's paged loop over a KV pool, which walks only the pages held.
    attn = model.blocks.attn
    paged_loop = jax.default_backend() == "cpu" and attn.implementation in (None, "xla")
    dense_rows = cfg.mla is not None or cfg.sliding_window is not None
    self.segment = PREFILL_SEGMENT if paged_loop and not dense_rows and drafter is None else None
    # Every (program, rows B per replica, tokens T, block-table columns M) a call has run: the
    # shapes warm-up must cover (a program compiles once per shape; see `Engine.warmup_shapes`).
    self.shapes_met: set[tuple[str, int, int, int]] = set()
    self.rules = placement.model_rules(cfg, self.tensor)
    self.layout = placement.layout(mesh, self.rules)
    graphdef, state = nnx.split(model)
    self.graphdef = graphdef
    d_params, self.d_rules, self.d_layout = None, None, None
    out_major, self.xla_dots_rows = self._matmul_plan(weight_layout, cpu_matmul, state, layout_rows)
    self.ynn_reduce_rows = self._reduce_plan(
      cpu_reductions, paged_loop and not dense_rows, layout_rows
    )
    # How the layer stacks are held (`stacked_layers`): as trained, sliced per layer by the layer
    # scan, or one array per layer (`model.scan.Unstacked`), run as a loop of layers.
    self.stacked = self.stacked_layers(weight_layout, out_major, layer_bytes(state))
    if jax.default_backend() == "cpu":
      log.info("weights: layers %s", "stacked" if self.stacked else "one array each")

    def held(placed):
      return placed if self.stacked else unstack_layers(placed, mesh, out_major=out_major)

    if draft is not None:
      self.d_rules = placement.model_rules(draft.cfg, self.tensor)
      if mesh is not None and self.d_rules is not placement.SERVING_RULES:
        log.info(
          "draft: %d query heads, %d kv heads: held whole by each of the %d tensor devices",
          draft.cfg.n_heads,
          draft.cfg.n_kv_heads,
          self.tensor,
        )
      self.d_layout = placement.layout(mesh, self.d_rules)
      d_params = held(placement.place_state(nnx.state(draft), mesh, self.d_rules))
    self.states = (held(placement.place_state(state, mesh, self.rules)), d_params)
    self.pools = None
    self.programs: steps.Programs | None = None

  def stacked_layers(self, layout: str, out_major: bool, layer_bytes: int) -> bool:
    """Whether the layer stacks stay stacked: with `layout` "stacked", or "auto" on one CPU
    device with in-major projections and layers of at most `STACKED_LAYER_BYTES`.

    In a layer scan each layer's weights are a dynamic slice of its stack, which XLA's CPU
    backend copies out before the matmuls; one array per layer copies nothing, the model running
    the layers as a loop unrolled into the step program. On 2 CPU cores the scan's steps
    nonetheless ran faster for small layers from 2 rows up, and slower for larger layers
    (`STACKED_LAYER_BYTES`). Elsewhere (accelerators, meshes, out-major projections) one array
    per layer."""
    if layout == "stacked":
      return True
    small = layer_bytes <= STACKED_LAYER_BYTES
    return layout == "auto" and self._one_cpu() and not out_major and small

  def _one_cpu(self) -> bool:
    """One CPU device whose XLA takes the step programs' options (`steps.compiler_options`):
    where the weights' layout and the dots are chosen by what ran faster."""
    return self.mesh is None and jax.default_backend() == "cpu" and bool(steps.compiler_options())

  def _matmul_plan(self, layout: str, cpu_matmul: str, state, max_rows: int) -> tuple[bool, int]:
    """(whether the projections are held out-major, `model.scan.OutMajor`; the most token rows
    a step may have to compile its dots as XLA's own, not YNNPACK's). As `layout` and
    `cpu_matmul` say; for "auto", on one CPU device, from timing the projections at every
    decode batch bucket up to `max_rows` (`time_matmuls`, `matmul_plan`; which wins differs
    between CPUs: BENCHMARKS.md), once per process for a set of shapes. Elsewhere in-major with
    the backend's dots."""
    if layout == "stacked":  # in-major, as trained
      layout = "in_major"
    if not self._one_cpu():
      return layout == "out_major", 0
    if "auto" not in (layout, cpu_matmul) or layout == "out_major":
      return matmul_plan({}, layout, cpu_matmul)
    mats = out_major_candidates(state, limit_bytes=LAYOUT_PROBE_BYTES)
    if not mats:
      return matmul_plan({}, "in_major" if layout == "auto" else layout, cpu_matmul)
    buckets = sorted({pow2(n, self.min_batch_bucket) for n in range(1, max_rows + 1)})
    layouts = ("in_major", "out_major") if layout == "auto" else (layout,)
    libraries = ("ynnpack", "xla") if cpu_matmul == "auto" else (cpu_matmul,)
    key = (tuple((m.shape, str(m.dtype)) for m in mats), tuple(buckets), layouts, libraries)
    if key not in _probes:
      kinds = lambda rows: [
        (lay, lib)
        for lay in layouts
        for lib in libraries
        # XLA's dots over out-major weights: several times slower wherever measured.
        if not (lib == "xla" and (lay == "out_major" or rows > XLA_DOTS_PROBE_ROWS))
      ]
      _probes[key] = {rows: time_matmuls(mats, rows, kinds(rows)) for rows in buckets}
    timings = _probes[key]
    out_major, xla_rows = matmul_plan(timings, layout, cpu_matmul)
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

  def _reduce_plan(self, cpu_reductions: str, paged_loop: bool, max_rows: int) -> tuple[int, ...]:
    """The token row counts of steps that compile with YNNPACK's reductions too
    (`steps.ByRows`), among the decode batch buckets up to `steps.YNN_REDUCE_ROWS` and
    `max_rows` (the largest batch) above those that take XLA's own dots: none with
    `cpu_reductions` "xla", off one CPU device, or where the decode attention is not XLA's paged
    loop over KV pages; all of them with "ynnpack"; with "auto", the largest of them if the
    start-up probe timed the decode attention faster that way there (`time_decode_attention`,
    `reduce_plan`; it depends on the heads), once per process for a shape."""
    if cpu_reductions == "xla" or not self._one_cpu() or not paged_loop:
      return ()
    if not steps.reduce_compiler_options():
      return ()  # an XLA without the option
    # The decode batch buckets up to YNN_REDUCE_ROWS above XLA's dots; "auto" times only the
    # largest (at 1 and 2 rows the attention never ran faster so: BENCHMARKS.md).
    top = min(steps.YNN_REDUCE_ROWS, max_rows)
    buckets = sorted({pow2(n, self.min_batch_bucket) for n in range(1, top + 1)})
    buckets = [rows for rows in buckets if self.xla_dots_rows < rows <= top]
    if cpu_reductions == "ynnpack" or not buckets:
      return tuple(buckets)
    buckets = buckets[-1:]
    cfg = self.model_config
    shape = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, str(jnp.dtype(cfg.dtype)), self.block_size)
    key = ("reductions", shape, tuple(buckets))
    if key not in _probes:
      _probes[key] = {rows: time_decode_attention(rows, *shape) for rows in buckets}
    timings = _probes[key]
    chosen = reduce_plan(timings)
    log.info(
      "decode attention: reductions %s (ms at %s rows: xla %s, ynnpack %s)",
      f"YNNPACK's at {'/'.join(map(str, chosen))} rows, XLA's elsewhere" if chosen else "XLA's",
      "/".join(map(str, buckets)),
      "/".join(f"{timings[r]['xla']:.2f}" for r in buckets),
      "/".join(f"{timings[r]['ynnpack']:.2f}" for r in buckets),
    )
    return chosen

  # -- memory ------------------------------------------------------------------------------------

  @property
  def weight_bytes(self) -> int:
    """Weight bytes on the most loaded device (the draft's included)."""
    return placement.bytes_per_device(self.states)

  def pool_spec(self, n_blocks: int):
    """The pools' shapes for `n_blocks` blocks per replica (nothing allocated)."""
    P, Z, cfg = n_blocks * self.n_replicas, self.block_size, self.model_config
    target = jax.eval_shape(lambda: self.model.init_pool(P, Z))
    draft = None
    if self.drafter is not None and self.drafter.needs_hidden:
      heads = jax.eval_shape(
        lambda: self.model.mtp.init_pool(
          cfg, P, Z, jnp.dtype(cfg.dtype), n_heads=self.drafter.n_heads
        )
      )
      # The heads' pool, and the trunk's hidden states (final, last-block input) per slot.
      draft = (heads, hidden_store(cfg, P, Z, cfg.dtype))
    elif self.draft is not None:
      draft = jax.eval_shape(lambda: self.draft.init_pool(P, Z))
    return target, draft

  def pool_shardings(self, spec):
    """NamedShardings of the pools (None on one device)."""
    if self.mesh is None:
      return None
    target, draft = spec
    d_rules = self.rules if self.drafter is not None and self.drafter.needs_hidden else self.d_rules
    return (
      placement.pool_shardings(target, self.mesh, self.rules),
      None if draft is None else placement.pool_shardings(draft, self.mesh, d_rules),
    )

  def block_bytes(self) -> int:
    """Bytes one block of every pool takes on one device (per shard: heads split over tensor
    count 1 / tensor of their bytes)."""
    spec = self.pool_spec(1)
    leaves = jax.tree.leaves(spec)
    if self.mesh is None:
      return sum(x.size * x.dtype.itemsize for x in leaves)
    shardings = jax.tree.leaves(
      self.pool_shardings(spec), is_leaf=lambda s: isinstance(s, NamedSharding)
    )
    return sum(placement.shard_bytes(x, s) for x, s in zip(leaves, shardings))

  def allocate(self, n_blocks: int) -> None:
    """Zeroed pools of `n_blocks` blocks per replica, made in place on their devices."""
    spec = self.pool_spec(n_blocks)
    shardings = self.pool_shardings(spec)
    self._pool_spec = (spec, shardings)
    self.programs = self._programs(shardings)
    self.pools = self._zeros()

  def _programs(self, shardings) -> steps.Programs:
    """The step programs for pools laid out as `shardings` (None on one device)."""
    key = steps.sharding_key(shardings)
    return steps.programs(
      self.graphdef,
      self.drafter,
      self.layout,
      self.d_layout,
      key,
      self.xla_dots_rows,
      self.ynn_reduce_rows,
    )

  def _zeros(self):
    spec, shardings = self._pool_spec
    if shardings is None:
      return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), spec)
    return jax.tree.map(lambda x, s: jnp.zeros(x.shape, x.dtype, device=s), spec, shardings)

  @property
  def pool_bytes(self) -> int:
    """Pool bytes on the most loaded device."""
    return placement.bytes_per_device(self.pools)

  def step_bytes(self, b: int, T: int) -> int:
    """Per-device temporaries of a mixed step of `b` rows per replica and T tokens over a block
    table as wide as the context, read from its compiled program (nothing runs or is kept)."""
    B, M = b * self.n_replicas, self.max_blocks
    spec = self.pool_spec(M)
    shardings = self.pool_shardings(spec)
    rows = None if self.mesh is None else NamedSharding(self.mesh, self.layout.spec("batch"))
    abstract = lambda shape, dtype, s=rows: jax.ShapeDtypeStruct(shape, dtype, sharding=s)
    if shardings is not None:
      spec = jax.tree.map(lambda x, s: abstract(x.shape, x.dtype, s), spec, shardings)
    x = jax.tree.map(lambda a: abstract(a.shape, a.dtype), padding_inputs(B, T, M))
    progs = self._programs(shardings)
    compiled = progs.forward_sample.lower(self.states, spec, x).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)

  def pool_lost(self) -> bool:
    """Whether a failed call took the donated pools with it."""
    return any(x.is_deleted() for x in jax.tree.leaves(self.pools))

  def reset_pools(self) -> None:
    """Fresh zeroed pools (after a failure lost them)."""
    self.pools = self._zeros()

  # -- the batch ---------------------------------------------------------------------------------

  def bucket(self, n_rows: int) -> int:
    """The padded row count per replica of a step with `n_rows` rows on its busiest replica."""
    return pow2(n_rows, self.min_batch_bucket)

  def segment_bucket(self, n_rows: int) -> int:
    """The padded row count per replica of a segmented prefill with `n_rows` segments on its
    busiest replica."""
    return fine_bucket(max(n_rows, self.min_batch_bucket))

  def busiest(self, rows: Sequence[Row]) -> int:
    """The most rows any one replica holds."""
    count = [0] * self.n_replicas
    for row in rows:
      count[row.req.replica] += 1
    return max(count)

  def carries(self, prefill: Sequence[Row], decode: Sequence[Row]) -> bool:
    """Whether the segmented prefill of `prefill` takes the `decode` rows (one token each) as
    segments in the padding its segment bucket computes anyway: one call for the step instead
    of a prefill and a decode call, each reading every weight, at no more token slots."""
    if self.segment is None or not prefill or not decode:
      return False
    segments = self.segments(prefill)
    before = self.segment_bucket(self.busiest(segments))
    return self.segment_bucket(self.busiest([*segments, *decode])) == before

  def place(self, rows: Sequence[Row], bucket=None) -> tuple[int, np.ndarray]:
    """(B, each row's index in the batch): replica r's rows fill its slice [r * b, (r + 1) * b),
    b the bucket (`bucket`, default `self.bucket`) of the busiest replica's count, in the order
    given."""
    count = [0] * self.n_replicas
    local = []
    for row in rows:
      local.append(count[row.req.replica])
      count[row.req.replica] += 1
    b = (bucket or self.bucket)(max(count))
    slot = np.asarray([r.req.replica * b + j for r, j in zip(rows, local)], np.int32)
    return b * self.n_replicas, slot

  def width(self, n_blocks: int) -> int:
    """M, the block-table columns of a call whose longest row holds `n_blocks` blocks: a power
    of two, at least `min_blocks`, at most `max_blocks`."""
    return min(pow2(max(1, n_blocks), self.min_blocks), self.max_blocks)

  def widths(self) -> list[int]:
    """Every M a call can have."""
    return sorted({self.width(m) for m in range(1, self.max_blocks + 1)})

  def _met(self, program: str, x: StepInputs, T: int) -> None:
    B, M = x.block_table_BM.shape
    self.shapes_met.add((program, B // self.n_replicas, T, M))

  def _table(self, rows: Sequence[Row], slot, B, M: int | None = None) -> np.ndarray:
    """i32[B, M]: the rows' blocks; M by default the longest row's block count rounded up to a
    power of two, so attention work follows the real lengths."""
    M = self.width(max(len(r.blocks) for r in rows)) if M is None else M
    table = np.zeros((B, M), np.int32)
    for row, b in zip(rows, slot):
      table[b, : len(row.blocks)] = row.blocks[:M]
    return table

  def inputs(
    self,
    rows: Sequence[Row],
    T: int,
    *,
    penalties: bool,
    allowed: bool = True,
    segmented: bool = False,
  ) -> tuple[StepInputs, np.ndarray]:
    """(the step's inputs for these rows, each row's batch index), on the host. Padding rows
    have length -1; `allowed` puts each guided row's mask (and a row in its min_tokens its
    suppressed stops) in the sampling arrays. `segmented` rows (`segments`) take the segment
    bucket and the widest table."""
    B, slot = self.place(rows, self.segment_bucket if segmented else None)
    tokens = np.zeros((B, T), np.int32)
    positions = np.full((B, T), -1, np.int32)
    lengths = np.full((B,), -1, np.int32)
    last = np.zeros((B,), np.int32)
    seeds = np.zeros((B,), np.int32)
    step = np.zeros((B,), np.int32)
    params = [PADDING] * B
    for row, b in zip(rows, slot):
      req, n = row.req, row.n
      known = req.tokens[row.start : row.start + n]  # a chained burst's are on the device
      tokens[b, : len(known)] = known
      positions[b, :n] = np.arange(row.start, row.start + n)
      lengths[b] = row.start
      last[b] = n - 1
      seeds[b] = req.params.seed
      step[b] = row.step
      params[b] = req.params
    counts = prompt_mask = None
    if penalties:
      V = self.model_config.vocab_size
      counts = np.zeros((B, V), np.int32)
      prompt_mask = np.zeros((B, V), bool)
      for row, b in zip(rows, slot):
        np.add.at(counts[b], np.asarray(row.req.output, np.int64), 1)
        prompt_mask[b, row.req.prompt] = True
    bits = self._allowed_bits(rows, slot, B) if allowed else None
    x = StepInputs(
      tokens_BT=tokens,
      positions_BT=positions,
      block_table_BM=self._table(rows, slot, B, self.max_blocks if segmented else None),
      lengths_B=lengths,
      last_B=last,
      seed_B=seeds,
      step_B=step,
      sampling=SamplingArrays.from_params(params, allowed_bits=bits),
      counts_BV=counts,
      prompt_mask_BV=prompt_mask,
    )
    return x, slot

  def _allowed_bits(self, rows: Sequence[Row], slot, B) -> np.ndarray | None:
    """i32[B, W] packed allowed tokens: guided rows' from their matchers, without the stop ids
    for rows in their min_tokens, all set for the others; None when no row needs a mask."""
    if all(r.req.matcher is None and not r.req.suppressing_stops for r in rows):
      return None
    V = self.model_config.vocab_size
    bits = np.full((B, -(-V // 32)), -1, np.int32)
    for row, b in zip(rows, slot):
      req = row.req
      if req.matcher is not None:
        bits[b] = req.matcher.allowed_bits()
      if req.suppressing_stops:
        words = bits[b].view(np.uint32)
        for t in req.stop_ids:
          if t < V:
            words[t >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (t & 31)))
    return bits

  def draft_masks(self, rows: Sequence[Row], slot, drafts_BJ: np.ndarray) -> np.ndarray:
    """i32[B, k+1, W]: a guided row's allowed tokens at its pending token and after each of its
    drafts, from its matcher advanced along the drafts and rolled back; all set for the other
    rows, and past a draft the grammar refuses (the target rejects it there, so the positions
    after it are never read)."""
    B, k = drafts_BJ.shape
    masks = np.full((B, k + 1, -(-self.model_config.vocab_size // 32)), -1, np.int32)
    for row, b in zip(rows, slot):
      m = row.req.matcher
      if m is None:
        continue
      masks[b, 0] = m.allowed_bits()
      n = 0
      while n < k and m.accepts(drafts_BJ[b, n]):
        m.advance(drafts_BJ[b, n])
        n += 1
        masks[b, n] = m.allowed_bits()
      m.rollback(n)
    return masks

  def on_devices(self, x: StepInputs) -> StepInputs:
    """The inputs with every row-leading array split over the data axis (on a mesh)."""
    if self.layout is None:
      return x
    rows = NamedSharding(self.mesh, self.layout.spec("batch"))
    return jax.device_put(x, jax.tree.map(lambda _: rows, x))

  # -- programs ----------------------------------------------------------------------------------

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

  def prefill_shapes(self, max_rows: int, budget: int, prefill_chunk: int, level: str):
    """Every (rows B per replica, tokens T, block-table columns M) a prefill call of at most
    `max_rows` rows and `budget` tokens per replica can have: at level "default" only tables
    holding T tokens from position 0 for padded rows; every shape for segments."""
    if self.segment is not None:
      C = self.segment
      # Each row pads less than a segment; no row is longer than a chunk.
      most = min(-(-(budget + max_rows * (C - 1)) // C), max_rows * -(-prefill_chunk // C))
      buckets = sorted({self.segment_bucket(n) for n in range(1, most + 1)})
      return [(b, C, self.max_blocks) for b in buckets]
    buckets = sorted({self.bucket(n) for n in range(1, max_rows + 1)})
    chunks = sorted({min(pow2(n, 16), prefill_chunk) for n in range(2, prefill_chunk + 1)})
    fresh = lambda T: self.width(-(-T // self.block_size))  # T tokens from position 0
    return [
      (B, T, M)
      for B in buckets
      for T in chunks
      for M in self.widths()
      if M == fresh(T) or (level == "all" and M > fresh(T))
    ]

  def forward(self, rows: Sequence[Row], T: int | None, prefill_chunk: int) -> dict:
    """One mixed call over `rows` (T None: prompt rows, as `segments` where the runner cuts
    them, else padded to the longest chunk, bucketed); returns {request id: (token, logprob,
    top ids, top logprobs)}, a segmented row's from its last segment."""
    segmented = T is None and self.segment is not None
    if segmented:
      rows, T = self.segments(rows), self.segment
    elif T is None:
      T = min(pow2(max(r.n for r in rows), 16), prefill_chunk)
    penalties = any(r.req.params.uses_penalties for r in rows)
    x, slot = self.inputs(rows, T, penalties=penalties, segmented=segmented)
    self._met("prefill" if T > 1 else "decode", x, T)
    self.pools, *outs = self.programs.forward_sample(self.states, self.pools, self.on_devices(x))
    tok, lp, top_ids, top_lp = map(np.asarray, outs)
    return {
      row.req.id: (int(tok[b]), float(lp[b]), top_ids[b], top_lp[b]) for row, b in zip(rows, slot)
    }

  def burst(
    self, rows: Sequence[Row], n_steps: int, capacity: int, chained: Drawn | None = None
  ) -> Drawn:
    """Dispatches `n_steps` decode iterations of `rows` (not waiting for them) in the burst
    program of `capacity` iterations at most. Chained on a burst the host has not read, each
    row's pending token (and penalty counts) is taken from that burst's last draws on the
    device."""
    penalties = any(r.req.params.uses_penalties for r in rows)
    x, slot = self.inputs(rows, 1, penalties=penalties and chained is None, allowed=False)
    self._met("burst", x, capacity)
    prompt_mask = x.prompt_mask_BV
    if chained is not None:
      prev = {id(r.req): b for r, b in zip(chained.rows, chained.slot)}
      index = np.zeros((x.tokens_BT.shape[0],), np.int32)
      index[slot] = [prev[id(r.req)] for r in rows]
      # On the device: the host has not seen these yet.
      tokens_BT, counts, prompt_mask = _carried(
        chained.tok_IB, chained.counts_BV, chained.prompt_mask_BV, index, chained.n_steps
      )
      x = dataclasses.replace(x, tokens_BT=tokens_BT, counts_BV=counts, prompt_mask_BV=prompt_mask)
    self.pools, *outs = self.programs.decode_burst(
      self.states, self.pools, self.on_devices(x), capacity, np.int32(n_steps)
    )
    return Drawn(list(rows), slot, prompt_mask, *outs, n_steps=n_steps)

  def speculate(self, rows: Sequence[Row], k: int) -> Drawn:
    """One speculative round over `rows`, settled at once (guided rows: drafted, masked on the
    host along their drafts, then verified)."""
    x, slot = self.inputs(rows, 1, penalties=False)
    self._met("speculate", x, k + 1)
    x_dev = self.on_devices(x)
    progs = self.programs
    if x.sampling.allowed_bits is None:
      self.pools, *outs, accepted_B = progs.speculative_round(self.states, self.pools, x_dev, k)
    else:  # guided rows: the target's masks at each draft follow the drafts before it
      self.pools, draft_BJ, q_BJV = progs.speculative_draft(self.states, self.pools, x_dev, k)
      masks = self.draft_masks(rows, slot, np.asarray(draft_BJ))
      self.pools, *outs, accepted_B = progs.speculative_verify(
        self.states, self.pools, x_dev, draft_BJ, q_BJV, masks
      )
    accepted = np.asarray(accepted_B)[slot]
    return Drawn(list(rows), slot, None, *outs, counts_BV=None, n_draws=accepted + 1)

  def copy(self, pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: blocks src -> dst (global ids) copied on the device, in every pool."""
    if pairs:
      # Padded to a power of two by repeating the last pair (an idempotent copy).
      pairs = pairs + pairs[-1:] * (pow2(len(pairs)) - len(pairs))
      src, dst = (np.asarray(x, np.int32) for x in zip(*pairs))
      self.pools = self.programs.copy_blocks(self.pools, src, dst)

  def prompt_logprobs(self, prompt: list[int], max_len: int):
    """(f32[T] logprob of each next token, i32[T, 5] top ids, f32[T, 5] top logprobs) of one
    prompt, from one pass of the model over it (right padding: causal attention keeps it out of
    the real positions)."""
    n = len(prompt)
    T = max(n, min(pow2(n, 16), max_len))
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :n] = prompt
    return map(np.asarray, self.programs.prompt_logprobs(self.states[0], tokens))

  def warmup(
    self,
    shapes,
    progress: Callable[[int, int, str], None] | None = None,
    threads: int | None = None,
  ):
    """Compiles every (program, rows per replica B, tokens T, block-table columns M) shape, then
    runs each once on padding rows that write nothing.

    The compiles run `threads` at a time (default: on a CPU one per core the process may use,
    elsewhere one, where a compile may autotune its kernels on the device): XLA compiles off the
    GIL, and a jitted function called on a shape that `lower(...).compile()` compiled runs that
    executable. `progress(i, n, shape)` is called as each compile ends."""
    if threads is None:
      threads = cores() if jax.default_backend() == "cpu" else 1
    calls = [self._warmup_call(*shape) for shape in shapes]
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
      pending = {
        pool.submit(lambda c: c[0].lower(self.states, self.pools, *c[1:]).compile(), c): i
        for i, c in enumerate(calls)
      }
      for done, future in enumerate(concurrent.futures.as_completed(pending)):
        future.result()
        if progress is not None:
          kind, b, T, M = shapes[pending[future]]
          progress(done + 1, len(calls), f"{kind} B={b} T={T} M={M}")
    for program, x, *static in calls:
      self.pools, *outs = program(self.states, self.pools, x, *static)
      if program is self.programs.decode_burst:
        # Again fed from the device, as a chained burst is (`burst`): its pending tokens are
        # the last one's draws.
        index = np.arange(x.tokens_BT.shape[0])
        tokens_BT, _, _ = _carried(outs[0], None, None, index, static[-1])
        x = dataclasses.replace(x, tokens_BT=tokens_BT)
        self.pools, *outs = program(self.states, self.pools, x, *static)
      jax.block_until_ready(outs)

  def _warmup_call(self, kind: str, b: int, T: int, M: int) -> tuple:
    """(program, inputs of b padding rows per replica, its static arguments) of one shape."""
    x = self.on_devices(padding_inputs(b * self.n_replicas, T if kind == "prefill" else 1, M))
    progs = self.programs
    if kind in ("prefill", "decode"):
      return progs.forward_sample, x
    if kind == "burst":  # its T iterations at most; one runs (the count is an input)
      return progs.decode_burst, x, T, np.int32(1)
    return progs.speculative_round, x, T - 1
