"""Paged attention for decoding: a few new queries per sequence against a paged KV pool.

Each sequence's keys and values live in fixed-size blocks of a shared pool [P, Z, K, H]; its row
of the block table lists them in order (see `atlas_jax.cache.paged`). The kernel reads the pages in
place through the block table instead of gathering them into a dense [B, S, K, H] copy.

Semantics (shared with `paged_attention_reference`):

* `lengths[b]` counts the tokens held for sequence b, including the T new ones, whose K/V the
  caller has already written to the pool;
* the T queries are the last T positions, `lengths[b] - T + t` (bottom-right alignment), causal
  among themselves: T = 1 is ordinary decoding, T > 1 verifies speculative draft tokens;
* block table entries at or past `cdiv(lengths[b], Z)` are never read, and pool slots at or past
  `lengths[b]` are masked before they reach the output, so both may hold anything (stale
  tokens, NaN);
* a query with no visible key (length 0, or a position before the start) returns zeros;
* `sliding_window=W` hides keys W or more positions before a query, and pages wholly before
  every query's window are never read; `soft_cap=c` passes the scores through c * tanh(s / c);
  `sinks` f32[N] adds a valueless softmax column per query head (`kernels.reference`);
  `attention_chunk=C` hides keys before the query's chunk start q - q % C, and pages wholly
  before every query's chunk are never read, as for a window.

Grid: (sequence, kv head, KV split), flash decoding (`kernels.flash_decoding`). A program holds
the queries of its kv head's whole group (T * G rows) and walks its split's pages several at a
time with an online softmax, so GQA reads each kv head's pages once, not G times; a second pass
merges the splits' partial outputs by their log-sum-exp. Splits keep the GPU busy when batch x
kv heads is small next to the SM count. The block table is an ordinary input indexed inside
the kernel (no TPU-only scalar prefetch). Pools may be given stacked over layers with a layer
index, which the kernel reads in place. The kernel targets GPUs: a kv head's pool slice stays in
HBM and only the pages walked are loaded. Compiled there (not in interpret mode), Z and H should
be powers of two >= 16 to fit Triton's tiles; the query rows are padded to such a size here.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import flash_decoding as fd
from .quantized_kv import dequantize, is_quantized
from .reference import (
  attention_reference,
  cap_scores,
  check_attention_chunk,
  check_soft_cap_and_sinks,
  chunk_start,
)

Array = jax.Array
Implementation = Literal["pallas", "xla"]


def _paged_attention_kernel(
  lengths_ref,  # i32[B]
  layer_ref,  # i32[1]: which layer of the stacked pool to read
  table_ref,  # i32[M]: this sequence's row of the block table
  q_ref,  # [Q, H]: rows t * G + g of this kv head's group (Q >= T * G, padded)
  k_ref,  # [L, P, Z, H]: this kv head's slice of the key pool, every layer
  v_ref,  # [L, P, Z, H]
  o_ref,  # f32[Q, H]: this split's output, normalised by its own softmax sum
  lse_ref,  # f32[Q, 1]: this split's log-sum-exp, -inf for rows that saw no key
  *,
  scale: float,
  group: int,
  n_queries: int,
  pages_per_split: int,
  pages_per_step: int,
  window: int | None,
  soft_cap: float | None,
  chunk: int | None = None,
):
  length = lengths_ref[pl.program_id(0)]
  layer = layer_ref[0]
  Z = k_ref.shape[2]
  Q = q_ref.shape[0]
  q_QH = q_ref[...]
  # Absolute position of each query row; padding rows (t >= T) are computed and discarded.
  qpos_Q1 = length - n_queries + jax.lax.broadcasted_iota(jnp.int32, (Q, 1), 0) // group
  offsets_1Z = jax.lax.broadcasted_iota(jnp.int32, (1, Z), 1)
  offsets_Z1 = jax.lax.broadcasted_iota(jnp.int32, (Z, 1), 0)
  split = pl.program_id(2)
  held = (length + Z - 1) // Z
  lo = split * pages_per_split
  if window is not None:  # pages before the first query's window hold no visible key
    lo = jnp.maximum(lo, jnp.maximum(length - n_queries - window + 1, 0) // Z)
  if chunk is not None:  # pages before the first query's chunk hold no visible key
    first = jnp.maximum(length - n_queries, 0)
    lo = jnp.maximum(lo, (first - first % chunk) // Z)
  hi = jnp.minimum((split + 1) * pages_per_split, held)
  n_steps = (jnp.maximum(hi - lo, 0) + pages_per_step - 1) // pages_per_step

  def body(step, state):
    scores, values = [], []
    for j in range(pages_per_step):
      i = lo + step * pages_per_step + j
      inside = i < hi
      # Past the split's pages (its last iteration): read a held page, mask all of it.
      page = table_ref[jnp.minimum(i, hi - 1)]
      s_QZ = cap_scores(fd.scores(q_QH, k_ref[layer, page]) * jnp.float32(scale), soft_cap)
      # Causal visibility; qpos < length, so it also hides the page's unused tail.
      kpos_1Z = i * Z + offsets_1Z
      seen_QZ = (kpos_1Z <= qpos_Q1) & inside
      if window is not None:
        seen_QZ &= kpos_1Z > qpos_Q1 - window
      if chunk is not None:
        seen_QZ &= kpos_1Z >= qpos_Q1 - qpos_Q1 % chunk
      scores.append(jnp.where(seen_QZ, s_QZ, -jnp.inf))
      # The tail past `length` may hold NaN, and 0 * NaN = NaN: zero those value rows.
      v_ZH = v_ref[layer, page]
      held_Z1 = (i * Z + offsets_Z1 < length) & inside
      values.append(jnp.where(held_Z1, v_ZH, jnp.zeros((), v_ZH.dtype)))
    return fd.fold_pages(state, scores, values)

  state = jax.lax.fori_loop(0, n_steps, body, fd.init_state(Q, q_QH.shape[1]))
  o_ref[...], lse_ref[...] = fd.finish(state)


def check_paged_attention_inputs(
  q: Array,
  pool_k: Array,
  pool_v: Array,
  block_table: Array,
  lengths: Array,
  layer: Array | None = None,
  k_scale: Array | None = None,
  v_scale: Array | None = None,
) -> None:
  """Raises ValueError naming the shapes when the inputs do not fit together."""
  shapes = (
    f"q.shape={tuple(q.shape)} pool_k.shape={tuple(pool_k.shape)} "
    f"pool_v.shape={tuple(pool_v.shape)} block_table.shape={tuple(block_table.shape)} "
    f"lengths.shape={tuple(lengths.shape)} layer={'None' if layer is None else 'given'}"
  )
  if q.ndim not in (3, 4):
    raise ValueError(f"paged_attention: q must be [B, N, H] or [B, T, N, H]; {shapes}")
  want = "[P, Z, K, H]" if layer is None else "[L, P, Z, K, H] (with a layer index)"
  if pool_k.ndim != (4 if layer is None else 5) or pool_k.shape != pool_v.shape:
    raise ValueError(f"paged_attention: pool_k and pool_v must both be {want}; {shapes}")
  if layer is not None and jnp.shape(layer) != ():
    raise ValueError(f"paged_attention: layer must be a scalar; {shapes}")
  B, N, H = q.shape[0], q.shape[-2], q.shape[-1]
  K, Hk = pool_k.shape[-2:]
  if Hk != H:
    raise ValueError(f"paged_attention: head dim of q ({H}) != pool's ({Hk}); {shapes}")
  if N % K:
    raise ValueError(
      f"paged_attention: query heads N={N} not a multiple of kv heads K={K}; {shapes}"
    )
  if block_table.ndim != 2 or block_table.shape[0] != B or lengths.shape != (B,):
    raise ValueError(
      f"paged_attention: need block_table [B, max_blocks] and lengths [B] with B={B}; {shapes}"
    )
  for name, x in (("block_table", block_table), ("lengths", lengths)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"paged_attention: {name} must be integer, got {x.dtype}; {shapes}")
  if (k_scale is None) != (v_scale is None):
    raise ValueError(f"paged_attention: k_scale and v_scale go together; {shapes}")
  if k_scale is not None:  # 8-bit pages: codes beside a scale per token and kv head
    if k_scale.shape != pool_k.shape[:-1] or v_scale.shape != pool_v.shape[:-1]:
      raise ValueError(
        f"paged_attention: k_scale and v_scale must be the pools' shape without the head dim, "
        f"got {tuple(k_scale.shape)} and {tuple(v_scale.shape)}; {shapes}"
      )
    if not (is_quantized(pool_k.dtype) and pool_k.dtype == pool_v.dtype):
      raise ValueError(
        f"paged_attention: scaled pools must be int8 or float8_e4m3fn, got {pool_k.dtype}; {shapes}"
      )
    if not jnp.issubdtype(q.dtype, jnp.floating):
      raise ValueError(f"paged_attention: q must be floating, got {q.dtype}; {shapes}")
  elif not (q.dtype == pool_k.dtype == pool_v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(
      f"paged_attention: q, pool_k, pool_v must share a floating dtype, got {q.dtype}, "
      f"{pool_k.dtype}, {pool_v.dtype}; {shapes}"
    )


def _query_rows(n: int) -> int:
  # GPU matmul tiles want a power-of-two M of at least 16; the padded rows are sliced off.
  return max(16, 1 << max(n - 1, 0).bit_length())


def _check_options(sliding_window, soft_cap, sinks, n_heads: int, attention_chunk=None) -> None:
  check_attention_chunk("paged_attention", attention_chunk)
  if sliding_window is not None and (
    isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
  ):
    raise ValueError(
      f"paged_attention: sliding_window={sliding_window!r} must be a positive int or None"
    )
  check_soft_cap_and_sinks("paged_attention", soft_cap, sinks, n_heads)


@functools.partial(
  jax.jit,
  static_argnames=(
    "scale",
    "sliding_window",
    "soft_cap",
    "num_splits",
    "pages_per_step",
    "interpret",
    "attention_chunk",
  ),
)
def paged_attention_pallas(
  q: Array,
  pool_k: Array,
  pool_v: Array,
  block_table: Array,
  lengths: Array,
  *,
  layer: Array | None = None,
  scale: float | None = None,
  sliding_window: int | None = None,
  soft_cap: float | None = None,
  sinks: Array | None = None,
  num_splits: int | None = None,
  pages_per_step: int | None = None,
  interpret: bool = False,
  attention_chunk: int | None = None,
) -> Array:
  """The Pallas kernel; see `paged_attention` for arguments."""
  check_paged_attention_inputs(q, pool_k, pool_v, block_table, lengths, layer)
  _check_options(sliding_window, soft_cap, sinks, q.shape[-2], attention_chunk)
  if layer is None:  # one layer: a stack of one (a free reshape)
    pool_k, pool_v, layer = pool_k[None], pool_v[None], 0
  decode = q.ndim == 3
  q_BTNH = q[:, None] if decode else q
  B, T, N, H = q_BTNH.shape
  L, P, Z, K, _ = pool_k.shape
  G = N // K
  M = block_table.shape[1]
  scale = H**-0.5 if scale is None else scale
  X, per_split, per_step = fd.plan_splits(
    "paged_attention",
    programs=B * K,
    max_blocks=M,
    page_size=Z,
    num_splits=num_splits,
    pages_per_step=pages_per_step,
  )
  # One row per (query token, head of the group), so each program does [Q, H] x [H, Z] matmuls.
  q_BKQH = q_BTNH.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H)
  Q = _query_rows(T * G)
  if Q != T * G:
    q_BKQH = jnp.pad(q_BKQH, ((0, 0), (0, 0), (0, Q - T * G), (0, 0)))
  kernel = functools.partial(
    _paged_attention_kernel,
    scale=scale,
    group=G,
    n_queries=T,
    pages_per_split=per_split,
    pages_per_step=per_step,
    window=sliding_window,
    soft_cap=soft_cap,
    chunk=attention_chunk,
  )
  part_spec = pl.BlockSpec((None, None, None, Q, H), lambda b, h, x: (b, h, x, 0, 0))
  lse_spec = pl.BlockSpec((None, None, None, Q, 1), lambda b, h, x: (b, h, x, 0, 0))
  out_BKXQH, lse_BKXQ1 = pl.pallas_call(
    kernel,
    grid=(B, K, X),
    in_specs=[
      pl.BlockSpec((B,), lambda b, h, x: (0,)),
      pl.BlockSpec((1,), lambda b, h, x: (0,)),
      pl.BlockSpec((None, M), lambda b, h, x: (b, 0)),
      pl.BlockSpec((None, None, Q, H), lambda b, h, x: (b, h, 0, 0)),
      pl.BlockSpec((L, P, Z, None, H), lambda b, h, x: (0, 0, 0, h, 0)),
      pl.BlockSpec((L, P, Z, None, H), lambda b, h, x: (0, 0, 0, h, 0)),
    ],
    out_specs=[part_spec, lse_spec],
    out_shape=[
      jax.ShapeDtypeStruct((B, K, X, Q, H), jnp.float32),
      jax.ShapeDtypeStruct((B, K, X, Q, 1), jnp.float32),
    ],
    compiler_params=fd.compiler_params(interpret, num_warps=4),
    interpret=interpret,
    name="paged_attention",
  )(
    lengths.astype(jnp.int32),
    jnp.reshape(layer, (1,)).astype(jnp.int32),
    block_table.astype(jnp.int32),
    q_BKQH,
    pool_k,
    pool_v,
  )
  sink_KQ1 = None if sinks is None else fd.sink_rows(sinks, K, T, Q)
  out_BKQH = fd.combine_splits(out_BKXQH, lse_BKXQ1, axis=2, dtype=q.dtype, sink_Q1=sink_KQ1)
  out_BTNH = (
    out_BKQH[:, :, : T * G].reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4).reshape(B, T, N, H)
  )
  return out_BTNH[:, 0] if decode else out_BTNH


# Keys per iteration of the XLA path for prompt chunks (4x this) and a few queries per row (half
# of it, one page of 16): enough keys that the loop's bookkeeping is small beside the products,
# few enough that a step's gathered pages stay in cache.
XLA_KEYS_PER_STEP = 32


def paged_attention_xla(
  q: Array,
  pool_k: Array,
  pool_v: Array,
  block_table: Array,
  lengths: Array,
  *,
  layer: Array | None = None,
  scale: float | None = None,
  q_positions: Array | None = None,
  keys_per_step: int | None = None,
  sliding_window: int | None = None,
  soft_cap: float | None = None,
  sinks: Array | None = None,
  k_scale: Array | None = None,
  v_scale: Array | None = None,
  attention_chunk: int | None = None,
) -> Array:
  """Paged attention in plain jnp for XLA backends, with `paged_attention_reference`'s semantics.

  A loop over the table, a few pages at a time, for as many steps as the longest sequence
  needs (not the table's width): each step gathers its pages of every sequence, small enough to
  stay in cache, scores them and folds them into an online softmax (the flash-decoding
  recurrence). The work follows the tokens held, where the reference gathers and scores every
  slot of every row's table.

  With a few queries per row (decoding: T * G <= 16) the scores and the weighted values are
  products summed over an axis, read from the gathered pages as they lie ([B, C, K, H]): as
  GEMMs they would be [T * G, H] x [H, C] per (row, kv head), after a transpose of every page to
  put the heads first; on XLA's CPU backend the fused multiply-reduce measured 1.4x faster.
  Prompt chunks, whose queries fill a GEMM, use einsums.

  Beyond the reference: `q_positions` i32[B, T] places the queries explicitly (a right-padded
  prefill chunk; each query sees the keys at or before its position), instead of the last T
  positions. `keys_per_step` defaults to half of `XLA_KEYS_PER_STEP` (one page of 16) for a few
  queries per row and to 4x it for prompt chunks, whose queries amortise a step's bookkeeping.
  `sliding_window` W hides keys W or more positions before a query (the loop starts at the first
  step any query sees); `soft_cap` c passes scores through c * tanh(s / c); `sinks` f32[N] starts
  each row's online softmax at its head's sink (m = sink, l = 1: the valueless column, counted
  once). `k_scale` and
  `v_scale` [(L,) P, Z, K]: the pools hold 8-bit codes (`kernels.quantized_kv`), each step's
  pages dequantized as they are gathered. `attention_chunk` C hides keys before the query's chunk
  start q - q % C (the loop starts at the first step any query's chunk reaches).
  """
  check_paged_attention_inputs(q, pool_k, pool_v, block_table, lengths, layer, k_scale, v_scale)
  _check_options(sliding_window, soft_cap, sinks, q.shape[-2], attention_chunk)
  decode = q.ndim == 3
  q_BTNH = q[:, None] if decode else q
  B, T, N, H = q_BTNH.shape
  Z, K = pool_k.shape[-3], pool_k.shape[-2]
  G = N // K
  scale = H**-0.5 if scale is None else scale
  few = T * G <= 16  # the queries of a kv head, too few rows for a GEMM
  if keys_per_step is None:
    keys_per_step = XLA_KEYS_PER_STEP // 2 if few else XLA_KEYS_PER_STEP * 4
  pages = max(1, keys_per_step // Z)
  C = pages * Z
  M = block_table.shape[1]
  n_max = -(-M // pages)
  if n_max * pages != M:  # whole steps: the added columns are past every length, never seen
    block_table = jnp.pad(block_table, ((0, 0), (0, n_max * pages - M)))
  lengths = lengths.astype(jnp.int32)
  # A kv head's T * G queries (its group's heads at every new position) as Q rows.
  Q = T * G
  q_BKQH = q_BTNH.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, Q, H)
  q_BKQH = q_BKQH.astype(jnp.float32) * jnp.float32(scale)
  if q_positions is None:
    qpos_BT = lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None, :]
  else:
    qpos_BT = jnp.minimum(q_positions.astype(jnp.int32), lengths[:, None] - 1)
  qpos_BQ = jnp.repeat(qpos_BT, G, axis=1)

  # The scores' key axis: second for the products' layout [B, C, K, Q], last for the einsums'
  # [B, K, Q, C]. Either way the running max and sum are [B, K, Q], the output [B, K, Q, H].
  c_axis = 1 if few else -1

  def capped(s):
    return cap_scores(s, soft_cap)

  def scores(k_BCKH, visible_BQC):
    if few:
      s = capped(jnp.sum(k_BCKH[:, :, :, None, :] * q_BKQH[:, None], axis=-1))
      return jnp.where(visible_BQC.transpose(0, 2, 1)[:, :, None, :], s, -jnp.inf)
    s = jnp.einsum("BKQH,BCKH->BKQC", q_BKQH, k_BCKH, preferred_element_type=jnp.float32)
    return jnp.where(visible_BQC[:, None], capped(s), -jnp.inf)

  def weighted(p, v_BCKH):
    if few:
      return jnp.sum(p[..., None] * v_BCKH[:, :, :, None, :], axis=1)
    return jnp.einsum("BKQC,BCKH->BKQH", p, v_BCKH)

  # Pages as rows of a [pages, Z * K * H] view of the pool: one contiguous run each.
  def pages_of(pool, ids_BP, scale=None):
    if layer is not None:
      ids_BP = layer * pool.shape[1] + ids_BP
    rows = pool.reshape(-1, Z * K * H)
    x_BCKH = jnp.take(rows, ids_BP, axis=0, mode="clip").reshape(B, C, K, H)
    if scale is None:
      return x_BCKH
    s_BCK = jnp.take(scale.reshape(-1, Z * K), ids_BP, axis=0, mode="clip").reshape(B, C, K)
    return dequantize(x_BCKH, s_BCK)

  def body(i, carry):
    m_BKQ, l_BKQ, acc_BKQH = carry
    ids_BP = jax.lax.dynamic_slice_in_dim(block_table, i * pages, pages, axis=1)
    kpos_C = i * C + jnp.arange(C, dtype=jnp.int32)
    # Slots past a length may hold anything, NaN included: zero them (0 * NaN = NaN).
    held_BC = kpos_C[None, :] < lengths[:, None]
    v_BCKH = pages_of(pool_v, ids_BP, v_scale)
    v_BCKH = jnp.where(held_BC[:, :, None, None], v_BCKH, 0).astype(jnp.float32)
    visible_BQC = kpos_C[None, None, :] <= qpos_BQ[:, :, None]  # causal; hides the unheld tail
    if sliding_window is not None:
      visible_BQC &= kpos_C[None, None, :] > qpos_BQ[:, :, None] - sliding_window
    if attention_chunk is not None:
      visible_BQC &= kpos_C[None, None, :] >= chunk_start(qpos_BQ, attention_chunk)[:, :, None]
    s = scores(pages_of(pool_k, ids_BP, k_scale), visible_BQC)
    m_new = jnp.maximum(m_BKQ, jnp.max(s, axis=c_axis))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing seen yet stay at 0
    p = jnp.exp(s - jnp.expand_dims(shift, c_axis))
    alpha = jnp.exp(m_BKQ - shift)
    acc_BKQH = acc_BKQH * alpha[..., None] + weighted(p, v_BCKH)
    return m_new, l_BKQ * alpha + jnp.sum(p, axis=c_axis), acc_BKQH

  steps = jnp.clip(-(-jnp.max(lengths) // C), 0, n_max)
  first = 0
  if sliding_window is not None:  # the first step any row's window reaches
    seen_BQ = qpos_BQ >= 0
    lowest = jnp.min(jnp.where(seen_BQ, qpos_BQ - sliding_window + 1, jnp.iinfo(jnp.int32).max))
    first = jnp.clip(lowest // C, 0, steps)
  if attention_chunk is not None:  # the first step any row's chunk reaches
    starts_BQ = jnp.where(
      qpos_BQ >= 0, chunk_start(qpos_BQ, attention_chunk), jnp.iinfo(jnp.int32).max
    )
    first = jnp.maximum(first, jnp.clip(jnp.min(starts_BQ) // C, 0, steps))
  init = (
    jnp.full((B, K, Q), -jnp.inf, jnp.float32),
    jnp.zeros((B, K, Q), jnp.float32),
    jnp.zeros((B, K, Q, H), jnp.float32),
  )
  if sinks is not None:  # the sink column first: m = sink, l = exp(sink - m) = 1, no value
    sink_KQ = jnp.tile(sinks.astype(jnp.float32).reshape(K, G), (1, T))
    init = (jnp.broadcast_to(sink_KQ, (B, K, Q)), jnp.ones((B, K, Q), jnp.float32), init[2])
  _, l_BKQ, acc_BKQH = jax.lax.fori_loop(first, steps, body, init)
  out_BKQH = acc_BKQH / jnp.where(l_BKQ > 0, l_BKQ, 1.0)[..., None]  # no key seen: zeros
  out_BKTGH = out_BKQH.reshape(B, K, T, G, H)
  out_BTNH = out_BKTGH.transpose(0, 2, 1, 3, 4).reshape(B, T, N, H).astype(q.dtype)
  return out_BTNH[:, 0] if decode else out_BTNH


@functools.partial(
  jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "attention_chunk")
)
def paged_attention_reference(
  q: Array,
  pool_k: Array,
  pool_v: Array,
  block_table: Array,
  lengths: Array,
  *,
  layer: Array | None = None,
  scale: float | None = None,
  sliding_window: int | None = None,
  soft_cap: float | None = None,
  sinks: Array | None = None,
  attention_chunk: int | None = None,
) -> Array:
  """Pure jnp: gather each sequence's pages into dense K/V, then causal dense attention."""
  check_paged_attention_inputs(q, pool_k, pool_v, block_table, lengths, layer)
  _check_options(sliding_window, soft_cap, sinks, q.shape[-2], attention_chunk)
  decode = q.ndim == 3
  q_BTNH = q[:, None] if decode else q
  B, max_blocks = block_table.shape
  Z, K, H = pool_k.shape[-3:]
  S = max_blocks * Z
  lengths = lengths.astype(jnp.int32)
  # One gather from the (stacked) pool: a layer is never sliced out as a copy.
  pages = lambda pool: pool[block_table] if layer is None else pool[layer, block_table]
  # Slots past a sequence's length are zeroed: a NaN there would survive its zero weight.
  valid_BS11 = (jnp.arange(S)[None, :] < lengths[:, None])[:, :, None, None]
  zero = jnp.zeros((), pool_k.dtype)
  k_BSKH = jnp.where(valid_BS11, pages(pool_k).reshape(B, S, K, H), zero)
  v_BSKH = jnp.where(valid_BS11, pages(pool_v).reshape(B, S, K, H), zero)
  out_BTNH = attention_reference(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    causal=True,
    scale=scale,
    kv_lengths=lengths,
    sliding_window=sliding_window,
    soft_cap=soft_cap,
    sinks=sinks,
    attention_chunk=attention_chunk,
  )
  return out_BTNH[:, 0] if decode else out_BTNH


def paged_attention(
  q: Array,
  pool_k: Array,
  pool_v: Array,
  block_table: Array,
  lengths: Array,
  *,
  layer: Array | None = None,
  scale: float | None = None,
  sliding_window: int | None = None,
  soft_cap: float | None = None,
  sinks: Array | None = None,
  implementation: Implementation | None = None,
  interpret: bool | None = None,
  num_splits: int | None = None,
  pages_per_step: int | None = None,
  attention_chunk: int | None = None,
) -> Array:
  """Attention of a few new queries per sequence over its pages of a paged KV pool.

  Args:
    q: [B, N, H] (one new token per sequence) or [B, T, N, H] (T new tokens, causal among
      themselves, e.g. speculative verification).
    pool_k: [P, Z, K, H] one layer's key pool; N must be a multiple of K. Or, with `layer`,
      [L, P, Z, K, H] every layer's: the kernel reads layer `layer` in place (a model's layer
      scan carries the whole pool and never copies a layer out).
    pool_v: [P, Z, K, H], or [L, P, Z, K, H].
    block_table: i32[B, max_blocks] block ids of each sequence, in order.
    lengths: i32[B] tokens held per sequence, the T new ones included (<= max_blocks * Z).
    layer: i32[] the layer to read from stacked pools, or None.
    scale: softmax scale, default H ** -0.5.
    sliding_window: W, a query sees the W positions up to its own (pages wholly before every
      query's window are skipped); None: all before it.
    soft_cap: c, scores pass through c * tanh(s / c) before the softmax; None: not capped.
    sinks: f32[N] a sink logit per query head (`kernels.reference`); None: no sink.
    implementation: "pallas" (the kernel), "xla" (`paged_attention_xla`, jnp) or None: the
      kernel on GPU, jnp elsewhere (the kernel keeps a kv head's whole pool slice addressable,
      which suits GPU memory, not TPU VMEM).
    interpret: run the kernel in interpret mode (default: on CPU).
    num_splits: KV splits per sequence (flash decoding); None picks them from the grid size and
      the table's capacity (`kernels.flash_decoding.choose_num_splits`).
    pages_per_step: pages the kernel scores per iteration; None: 64 tokens' worth.
    attention_chunk: C, a query sees only its own chunk's positions, from q - q % C (pages wholly
      before every query's chunk are skipped); None: no chunks.

  Returns:
    [B, N, H] or [B, T, N, H], like q.
  """
  if implementation not in (None, "pallas", "xla"):
    raise ValueError(
      f"paged_attention: implementation={implementation!r} is not one of 'pallas', 'xla', None"
    )
  if implementation is None:
    implementation = "pallas" if jax.default_backend() == "gpu" else "xla"
  options = dict(
    layer=layer, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks
  )
  if attention_chunk is not None:
    options["attention_chunk"] = attention_chunk
  if implementation == "xla":
    return paged_attention_xla(q, pool_k, pool_v, block_table, lengths, **options)
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  return paged_attention_pallas(
    q,
    pool_k,
    pool_v,
    block_table,
    lengths,
    **options,
    num_splits=num_splits,
    pages_per_step=pages_per_step,
    interpret=interpret,
  )
