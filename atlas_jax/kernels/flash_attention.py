"""FlashAttention in Pallas: tiled forward and backward with online softmax, O(T) memory.

The forward never materialises the [T, S] score matrix: each program streams key blocks through
an online softmax and saves only the output and the per-row log-sum-exp for the backward, which
recomputes the probabilities block by block (FlashAttention-2, Dao 2023). Grouped K/V heads
(GQA/MQA) are read in place: query head n reads kv head n // (N // K), and the dk/dv kernel sums
over the query heads of a group inside the kernel, so K and V are never repeated in memory.

Masking follows `kernels.reference` exactly (bottom-right aligned causal mask, kv lengths,
query positions, sliding window, attention chunks, packed-sequence segment ids). The wrapper folds
all of it into two per-query-row key bounds `klo <= s < khi` before the kernels run (see
`kernels.flash_kernels`); key tiles wholly outside a query tile's bounds (past the causal diagonal,
before a sliding window or the query's chunk) are skipped, in the forward and the backward alike,
with no change to the kernel bodies. A logit soft-cap and attention sinks are applied inside the
online softmax (forward and backward); the sinks' gradient, d sink_n = -sum_t exp(sink_n - lse_t)
delta_t over the rows of head n, is a reduction of the per-row statistics the backward already has.

Lengths that are not multiples of the block sizes are padded here and the tail is masked;
head dims the GPU backend cannot tile directly (not a power of two) are zero-padded, which leaves
the scores unchanged.

Backends: `interpret=True` runs anywhere (CPU in CI). Compiled, the loop-shaped bodies in
`kernels.flash_kernels` lower to Triton through the Pallas GPU backend, and the grid-shaped bodies
in `kernels.flash_tpu` (same math, sequential grid axes and VMEM scratch) lower to Mosaic on TPU;
`backend=` picks the body, and either runs in interpret mode on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import flash_kernels
from .flash_kernels import out_struct
from .reference import check_attention_inputs, chunk_start, default_q_positions

Array = jax.Array

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
BACKENDS = ("cpu", "gpu", "tpu")
# (block_q, block_k, block_q_bwd, block_k_bwd) per backend. On GPU the forward wants a tall query
# tile and a short key tile (registers hold the [Q, H] accumulator); the backward holds two
# accumulators, so it uses smaller square tiles. TPU prefers 128-lane-aligned tiles. Interpret
# mode on CPU pays per loop step, so it takes the largest tiles.
DEFAULT_BLOCK_SIZES = {
  "cpu": (128, 128, 128, 128),
  "gpu": (128, 64, 64, 64),
  "tpu": (128, 128, 128, 128),
}
# GPU tiles must be powers of two (Triton tensors) and at least 16 (tensor-core matmuls); TPU
# query tiles must fill whole sublanes and key tiles whole lanes.
_MIN_GPU_BLOCK = 16
_TPU_Q_ALIGN, _TPU_K_ALIGN = 8, 128
MAX_GPU_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static configuration of one kernel launch (hashable: it is a nondiff argument)."""

  scale: float
  groups: int  # G = N // K query heads per kv head
  block_q: int
  block_k: int
  block_q_bwd: int
  block_k_bwd: int
  has_segments: bool
  backend: str
  interpret: bool
  soft_cap: float | None = None


def _canonical_backend(backend: str | None) -> str:
  backend = jax.default_backend() if backend is None else backend
  backend = {"cuda": "gpu", "rocm": "gpu"}.get(backend, backend)
  if backend not in BACKENDS:
    raise ValueError(f"flash_attention: backend={backend!r} is not one of {BACKENDS} or None")
  return backend


def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _check_block(name: str, value: int | None, *, backend: str, align: int) -> None:
  if value is None:
    return
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"flash_attention: {name} must be a positive int or None, got {value!r}")
  if backend == "gpu" and (value < _MIN_GPU_BLOCK or value & (value - 1)):
    raise ValueError(
      f"flash_attention: {name}={value} cannot be tiled on GPU; it must be a power of two "
      f">= {_MIN_GPU_BLOCK}"
    )
  if backend == "tpu" and value % align:
    raise ValueError(f"flash_attention: {name}={value} must be a multiple of {align} on TPU")


def _fit_block(block: int, length: int, *, backend: str, align: int) -> int:
  """Shrinks a block to the (aligned) sequence length so short inputs are not over-padded."""
  if backend == "gpu":
    return min(block, max(_MIN_GPU_BLOCK, _next_pow2(length)))
  return min(block, _round_up(length, align))


def _block_sizes(
  T: int, S: int, backend: str, blocks: dict[str, int | None]
) -> tuple[int, int, int, int]:
  aligns = {
    "block_q": _TPU_Q_ALIGN,
    "block_k": _TPU_K_ALIGN,
    "block_q_bwd": _TPU_Q_ALIGN,
    "block_k_bwd": _TPU_K_ALIGN,
  }
  for name, value in blocks.items():
    _check_block(name, value, backend=backend, align=aligns[name] if backend == "tpu" else 1)
  defaults = dict(zip(aligns, DEFAULT_BLOCK_SIZES[backend]))
  sized = []
  for name in aligns:
    block = defaults[name] if blocks[name] is None else blocks[name]
    length = T if name.startswith("block_q") else S
    align = aligns[name] if backend == "tpu" else 1
    sized.append(_fit_block(block, length, backend=backend, align=align))
  return tuple(sized)


def _key_bounds(
  B: int,
  T: int,
  S: int,
  Tp: int,
  Sp: int,
  *,
  causal: bool,
  sliding_window: int | None,
  q_positions: Array | None,
  kv_lengths: Array | None,
  attention_chunk: int | None = None,
) -> tuple[Array, Array]:
  """i32[B, Tp, 1] klo, khi: query row t sees keys klo <= s < khi (see kernels.reference).

  Rows with no visible key, and the padded tail rows, get klo = Sp, khi = 0, so they neither
  see a key nor widen the range of key blocks a query block visits.
  """
  qpos_BT = default_q_positions(T, S, kv_lengths, B) if q_positions is None else q_positions
  qpos_BT = qpos_BT.astype(jnp.int32)
  kvlen_B1 = jnp.full((B, 1), S, jnp.int32)
  if kv_lengths is not None:
    kvlen_B1 = jnp.minimum(kv_lengths.astype(jnp.int32)[:, None], S)
  khi_BT = jnp.broadcast_to(kvlen_B1, (B, T))
  if causal:
    khi_BT = jnp.minimum(khi_BT, qpos_BT + 1)
  klo_BT = jnp.zeros((B, T), jnp.int32)
  if sliding_window is not None:
    klo_BT = jnp.maximum(klo_BT, qpos_BT - sliding_window + 1)
  if attention_chunk is not None:
    # A chunk is one more pair of bounds: its first position, and (without the causal mask)
    # the next chunk's first.
    first_BT = chunk_start(qpos_BT, attention_chunk)
    klo_BT = jnp.maximum(klo_BT, first_BT)
    khi_BT = jnp.minimum(khi_BT, first_BT + attention_chunk)
  empty_BT = khi_BT <= klo_BT
  klo_BT = jnp.where(empty_BT, Sp, klo_BT)
  khi_BT = jnp.where(empty_BT, 0, khi_BT)
  klo_BT = jnp.pad(klo_BT, ((0, 0), (0, Tp - T)), constant_values=Sp)
  khi_BT = jnp.pad(khi_BT, ((0, 0), (0, Tp - T)), constant_values=0)
  return klo_BT[:, :, None], khi_BT[:, :, None]


def _query_block_range(klo_BT1: Array, khi_BT1: Array, block_q: int, block_k: int, Sp: int):
  """i32[B, 1, Sp] qfirst, qlast: for each key, the query blocks [qfirst, qlast) that may see it
  (`flash_kernels.query_blocks_per_key_block`, repeated over the keys of each key block)."""
  qfirst_BJ, qlast_BJ = flash_kernels.query_blocks_per_key_block(
    klo_BT1, khi_BT1, block_q, block_k, Sp
  )
  qfirst_B1S = jnp.repeat(qfirst_BJ, block_k, axis=1)[:, None, :]
  qlast_B1S = jnp.repeat(qlast_BJ, block_k, axis=1)[:, None, :]
  return qfirst_B1S, qlast_B1S


def _compiler_params(cfg: _Config, head_dim: int):
  if cfg.interpret or cfg.backend != "gpu":
    return None
  # Select the Triton lowering explicitly: it is not the default Pallas GPU backend everywhere.
  from jax.experimental.pallas import triton as pltriton

  return pltriton.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def _sink_rows(sinks_N, block_q: int):
  """f32[N, Q, 1]: each head's sink logit on every row of a query block (None without sinks)."""
  if sinks_N is None:
    return None
  return jnp.broadcast_to(
    sinks_N.astype(jnp.float32)[:, None, None], (sinks_N.shape[0], block_q, 1)
  )


def _forward(cfg: _Config, q, k, v, klo, khi, qseg, kvseg, sinks):
  """out [B, Tp, N, H] (TPU: [B, N, Tp, H]), lse f32[B, N, Tp, 1] from padded inputs."""
  sink_NQ1 = _sink_rows(sinks, cfg.block_q)
  if cfg.backend == "tpu":
    from . import flash_tpu

    return flash_tpu.forward(cfg, q, k, v, klo, khi, qseg, kvseg, sink_NQ1)
  B, Tp, N, H = q.shape
  Sp = k.shape[1]
  G, bq = cfg.groups, cfg.block_q
  row_spec = pl.BlockSpec((None, bq, 1), lambda b, n, i: (b, i, 0))
  kv_spec = pl.BlockSpec((None, Sp, None, H), lambda b, n, i: (b, 0, lax.div(n, G), 0))
  q_spec = pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0))
  in_specs = [q_spec, kv_spec, kv_spec, row_spec, row_spec]
  args = [q, k, v, klo, khi]
  if sink_NQ1 is not None:
    in_specs = [pl.BlockSpec((None, bq, 1), lambda b, n, i: (n, 0, 0)), *in_specs]
    args = [sink_NQ1, *args]
  if cfg.has_segments:
    in_specs += [row_spec, pl.BlockSpec((None, 1, Sp), lambda b, n, i: (b, 0, 0))]
    args += [qseg, kvseg]
  kernel = functools.partial(
    flash_kernels.flash_fwd_kernel,
    scale=cfg.scale,
    block_k=cfg.block_k,
    has_segments=cfg.has_segments,
    soft_cap=cfg.soft_cap,
    has_sinks=sink_NQ1 is not None,
  )
  return pl.pallas_call(
    kernel,
    grid=(B, N, Tp // bq),
    in_specs=in_specs,
    out_specs=[q_spec, pl.BlockSpec((None, None, bq, 1), lambda b, n, i: (b, n, i, 0))],
    out_shape=[
      out_struct(q.shape, q.dtype, q, k, v),
      out_struct((B, N, Tp, 1), jnp.float32, q, k, v),
    ],
    compiler_params=_compiler_params(cfg, H),
    interpret=cfg.interpret,
    name="flash_attention_fwd",
  )(*args)


def _backward(cfg: _Config, q, k, v, klo, khi, qseg, kvseg, sinks, out, lse, do, dlse):
  """dq, dk, dv, dsinks from padded inputs; dlse is the cotangent of the log-sum-exp output."""
  # delta_t = sum_s p_ts dp_ts = <do_t, o_t>; a cotangent on lse_t adds p_ts to ds_ts, which
  # is the same as lowering delta_t by dlse_t.
  delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
  if cfg.backend != "tpu":
    delta = jnp.transpose(delta, (0, 2, 1))
  delta = delta[..., None] - dlse
  # Fully masked rows have lse = -inf; any finite stand-in gives p = exp(-inf - c) = 0.
  lse = jnp.where(lse == -jnp.inf, 0.0, lse)
  dsinks = None
  if sinks is not None:
    # The sink column has no value, so dp = 0 there and ds_sink = p_sink * (0 - delta), with
    # p_sink = exp(sink - lse); padded rows have delta = 0.
    p_sink_BNT1 = jnp.exp(sinks.astype(jnp.float32)[None, :, None, None] - lse)
    dsinks = -jnp.sum(p_sink_BNT1 * delta, axis=(0, 2, 3)).astype(sinks.dtype)
  if cfg.backend == "tpu":
    from . import flash_tpu

    return (*flash_tpu.backward(cfg, q, k, v, do, lse, delta, klo, khi, qseg, kvseg), dsinks)

  B, Tp, N, H = q.shape
  Sp, K = k.shape[1], k.shape[2]
  G, bq, bk = cfg.groups, cfg.block_q_bwd, cfg.block_k_bwd
  seg_args = [qseg, kvseg] if cfg.has_segments else []

  # dq: one program per (batch, query head, query block), looping over key blocks.
  row_spec = pl.BlockSpec((None, bq, 1), lambda b, n, i: (b, i, 0))
  stat_spec = pl.BlockSpec((None, None, bq, 1), lambda b, n, i: (b, n, i, 0))
  q_spec = pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0))
  kv_spec = pl.BlockSpec((None, Sp, None, H), lambda b, n, i: (b, 0, lax.div(n, G), 0))
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec, row_spec, row_spec]
  if cfg.has_segments:
    in_specs += [row_spec, pl.BlockSpec((None, 1, Sp), lambda b, n, i: (b, 0, 0))]
  dq = pl.pallas_call(
    functools.partial(
      flash_kernels.flash_dq_kernel,
      scale=cfg.scale,
      block_k=bk,
      has_segments=cfg.has_segments,
      soft_cap=cfg.soft_cap,
    ),
    grid=(B, N, Tp // bq),
    in_specs=in_specs,
    out_specs=q_spec,
    out_shape=out_struct(q.shape, q.dtype, q, k, v, do),
    compiler_params=_compiler_params(cfg, H),
    interpret=cfg.interpret,
    name="flash_attention_dq",
  )(q, k, v, do, lse, delta, klo, khi, *seg_args)

  # dk, dv: one program per (batch, kv head, key block), looping over the G query heads of the
  # group and the query blocks that can see this key block.
  qfirst, qlast = _query_block_range(klo, khi, bq, bk, Sp)
  group_spec = pl.BlockSpec((None, Tp, G, H), lambda b, h, j: (b, 0, h, 0))
  kblock_spec = pl.BlockSpec((None, bk, None, H), lambda b, h, j: (b, j, h, 0))
  gstat_spec = pl.BlockSpec((None, G, Tp, 1), lambda b, h, j: (b, h, 0, 0))
  rows_spec = pl.BlockSpec((None, Tp, 1), lambda b, h, j: (b, 0, 0))
  cols_spec = pl.BlockSpec((None, 1, bk), lambda b, h, j: (b, 0, j))
  in_specs = [
    group_spec,
    kblock_spec,
    kblock_spec,
    group_spec,
    gstat_spec,
    gstat_spec,
    rows_spec,
    rows_spec,
    cols_spec,
    cols_spec,
  ]
  if cfg.has_segments:
    in_specs += [rows_spec, cols_spec]
  dk, dv = pl.pallas_call(
    functools.partial(
      flash_kernels.flash_dkdv_kernel,
      scale=cfg.scale,
      block_q=bq,
      groups=G,
      has_segments=cfg.has_segments,
      soft_cap=cfg.soft_cap,
    ),
    grid=(B, K, Sp // bk),
    in_specs=in_specs,
    out_specs=[kblock_spec, kblock_spec],
    out_shape=[
      out_struct(k.shape, k.dtype, q, k, v, do),
      out_struct(v.shape, v.dtype, q, k, v, do),
    ],
    compiler_params=_compiler_params(cfg, H),
    interpret=cfg.interpret,
    name="flash_attention_dkdv",
  )(q, k, v, do, lse, delta, klo, khi, qfirst, qlast, *seg_args)
  return dq, dk, dv, dsinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: _Config, q, k, v, klo, khi, qseg, kvseg, sinks):
  return _forward(cfg, q, k, v, klo, khi, qseg, kvseg, sinks)


def _flash_fwd(cfg: _Config, q, k, v, klo, khi, qseg, kvseg, sinks):
  out, lse = _forward(cfg, q, k, v, klo, khi, qseg, kvseg, sinks)
  # The only activations kept for the backward: the output and one float per query row.
  return (out, lse), (q, k, v, klo, khi, qseg, kvseg, sinks, out, lse)


def _flash_bwd(cfg: _Config, residuals, cotangents):
  q, k, v, klo, khi, qseg, kvseg, sinks, out, lse = residuals
  do, dlse = cotangents
  dq, dk, dv, dsinks = _backward(cfg, q, k, v, klo, khi, qseg, kvseg, sinks, out, lse, do, dlse)
  return dq, dk, dv, None, None, None, None, dsinks


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(
  jax.jit,
  static_argnames=(
    "causal",
    "scale",
    "sliding_window",
    "attention_chunk",
    "soft_cap",
    "return_lse",
    "block_q",
    "block_k",
    "block_q_bwd",
    "block_k_bwd",
    "interpret",
    "backend",
  ),
)
def flash_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  causal: bool = False,
  scale: float | None = None,
  q_segment_ids: Array | None = None,
  kv_segment_ids: Array | None = None,
  sliding_window: int | None = None,
  q_positions: Array | None = None,
  kv_lengths: Array | None = None,
  soft_cap: float | None = None,
  sinks: Array | None = None,
  return_lse: bool = False,
  block_q: int | None = None,
  block_k: int | None = None,
  block_q_bwd: int | None = None,
  block_k_bwd: int | None = None,
  interpret: bool | None = None,
  backend: str | None = None,
  attention_chunk: int | None = None,
) -> Array | tuple[Array, Array]:
  """FlashAttention with grouped K/V heads; same semantics as `attention_reference`.

  Args:
    q: [B, T, N, H] queries (float32, bfloat16 or float16).
    k: [B, S, K, H] keys, N a multiple of K; same dtype as q.
    v: [B, S, K, H] values.
    causal, scale, q_segment_ids, kv_segment_ids, sliding_window, q_positions, kv_lengths: see
      `kernels.reference` (bottom-right aligned causal mask; scale defaults to H ** -0.5).
    soft_cap: c (static), scores capped as c * tanh(s / c) before the softmax; None: not capped.
    sinks: f32[N] a sink logit per query head (`kernels.reference`), differentiable; None: none.
    return_lse: also return the per-row log-sum-exp (differentiable).
    block_q, block_k: forward (and dq) tile sizes along T and S; None picks the backend default.
    block_q_bwd, block_k_bwd: tile sizes of the backward kernels.
    interpret: run the kernels in the Pallas interpreter (default: on CPU).
    backend: "cpu", "gpu" or "tpu" to target (default: jax.default_backend()).
    attention_chunk: C (static), each query sees only its own chunk's keys (`kernels.reference`);
      key tiles before the chunk are skipped as a window's are. None: no chunks.

  Returns:
    out [B, T, N, H] in q.dtype, and with `return_lse` the log-sum-exp f32[B, T, N] (-inf for
    rows that see no key, whose output is zero; with sinks it includes the sink column, so such
    rows get their sink).
  """
  check_attention_inputs(
    q,
    k,
    v,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    q_positions=q_positions,
    kv_lengths=kv_lengths,
    sliding_window=sliding_window,
    soft_cap=soft_cap,
    sinks=sinks,
    attention_chunk=attention_chunk,
  )
  if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
    raise ValueError(
      f"flash_attention: dtype {q.dtype} is not supported (q.shape={tuple(q.shape)}); "
      f"use one of {[d.name for d in SUPPORTED_DTYPES]}"
    )
  backend = _canonical_backend(backend)
  interpret = backend == "cpu" if interpret is None else bool(interpret)
  if backend == "cpu" and not interpret:
    raise ValueError("flash_attention: the CPU backend only runs the kernels with interpret=True")
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  if T == 0 or S == 0:
    raise ValueError(
      f"flash_attention: empty sequence, q.shape={tuple(q.shape)} k.shape={tuple(k.shape)}"
    )
  if backend == "gpu" and H > MAX_GPU_HEAD_DIM:
    raise ValueError(
      f"flash_attention: head dim H={H} (q.shape={tuple(q.shape)}) exceeds the GPU limit "
      f"{MAX_GPU_HEAD_DIM}"
    )
  blocks = dict(block_q=block_q, block_k=block_k, block_q_bwd=block_q_bwd, block_k_bwd=block_k_bwd)
  bq, bk, bq_bwd, bk_bwd = _block_sizes(T, S, backend, blocks)
  Tp = _round_up(T, math.lcm(bq, bq_bwd))
  Sp = _round_up(S, math.lcm(bk, bk_bwd))
  cfg = _Config(
    scale=float(H**-0.5 if scale is None else scale),
    groups=N // K,
    block_q=bq,
    block_k=bk,
    block_q_bwd=bq_bwd,
    block_k_bwd=bk_bwd,
    has_segments=q_segment_ids is not None,
    backend=backend,
    interpret=interpret,
    soft_cap=None if soft_cap is None else float(soft_cap),
  )

  klo, khi = _key_bounds(
    B,
    T,
    S,
    Tp,
    Sp,
    causal=causal,
    sliding_window=sliding_window,
    q_positions=q_positions,
    kv_lengths=kv_lengths,
    attention_chunk=attention_chunk,
  )
  # Zero padding: padded keys are masked by khi <= S, padded query rows see nothing, and zero
  # head-dim columns add nothing to the scores.
  Hp = max(_MIN_GPU_BLOCK, _next_pow2(H)) if backend == "gpu" else H
  q_p = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, Hp - H)))
  k_p = jnp.pad(k, ((0, 0), (0, Sp - S), (0, 0), (0, Hp - H)))
  v_p = jnp.pad(v, ((0, 0), (0, Sp - S), (0, 0), (0, Hp - H)))
  qseg = kvseg = None
  if q_segment_ids is not None:
    qseg = jnp.pad(q_segment_ids.astype(jnp.int32), ((0, 0), (0, Tp - T)))[:, :, None]
    kvseg = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, Sp - S)))[:, None, :]

  if backend == "tpu":
    # Mosaic tiles the last two dims, so TPU kernels take head-major [B, N, T, H] arrays.
    q_p, k_p, v_p = (jnp.transpose(x, (0, 2, 1, 3)) for x in (q_p, k_p, v_p))
  sinks = None if sinks is None else sinks.astype(jnp.float32)
  out_p, lse_p = _flash(cfg, q_p, k_p, v_p, klo, khi, qseg, kvseg, sinks)
  if backend == "tpu":
    out_p = jnp.transpose(out_p, (0, 2, 1, 3))
  out_BTNH = out_p[:, :T, :, :H]
  if not return_lse:
    return out_BTNH
  lse_BTN = jnp.transpose(lse_p[:, :, :T, 0], (0, 2, 1))
  return out_BTNH, lse_BTN
