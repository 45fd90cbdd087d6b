"""FlashAttention kernel bodies and launches for TPU (Mosaic).

Same math as `kernels.flash_kernels` (the online-softmax step and the backward tile are shared),
different shape: Mosaic pipelines HBM -> VMEM copies along the grid, so the streamed sequence is a
grid axis marked "arbitrary" (sequential on one core) and the softmax state lives in VMEM scratch
across grid steps, instead of an in-kernel loop over a whole-sequence ref that would have to fit
in VMEM. Tiles must be (8, 128)-aligned in their last two dims, so the arrays are head-major:
q [B, N, Tp, H], k and v [B, K, Sp, H]; per-query-row vectors are [B, Tp, 1] and per-key vectors
[B, 1, Sp]. Blocks no query row can see are skipped twice over: their compute with `pl.when`, and
their copies by the index maps, which read each query block's range of visible key blocks (and,
for dk/dv, each key block's range of query blocks) from scalar-prefetched tables and clamp the
streamed index into it. A step outside the range names the block its neighbour holds, and the
pipeline issues no copy for a block index that did not change, so a causal diagonal or a sliding
window costs neither the FLOPs nor the HBM reads of the tiles it hides.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .flash_kernels import (
  _TN,
  _dot,
  finalize,
  initial_state,
  key_blocks_per_query_block,
  key_mask,
  online_softmax_step,
  out_struct,
  probs_and_dscores,
  query_blocks_per_key_block,
)


def _block_visible(s0, block_k, klo_Q1, khi_Q1):
  """Whether any row of this query block sees any key of the key block starting at s0."""
  return (s0 < jnp.max(khi_Q1)) & (s0 + block_k > jnp.min(klo_Q1))


def _fwd_kernel(
  kfirst_ref, klast_ref, *refs, scale: float, has_segments: bool, soft_cap, has_sinks: bool
):
  """Grid (B, N, Tp/Q, Sp/Z), the last axis sequential.

  Refs: scalar-prefetched kfirst, klast i32[B * Tp/Q] (read by the index maps); (sink
  f32[Q, 1];) q [Q, H], k [Z, H], v [Z, H], klo [Q, 1], khi [Q, 1], (qseg [Q, 1], kvseg [1, Z]);
  outputs o [Q, H], lse f32[Q, 1]; scratch acc f32[Q, H], m f32[Q, 1], l f32[Q, 1].
  """
  del kfirst_ref, klast_ref
  sink_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
  if has_segments:
    (
      q_ref,
      k_ref,
      v_ref,
      klo_ref,
      khi_ref,
      qseg_ref,
      kvseg_ref,
      o_ref,
      lse_ref,
      acc_ref,
      m_ref,
      l_ref,
    ) = refs
  else:
    q_ref, k_ref, v_ref, klo_ref, khi_ref, o_ref, lse_ref, acc_ref, m_ref, l_ref = refs
    qseg_ref = kvseg_ref = None
  j = pl.program_id(3)
  block_k = k_ref.shape[0]
  s0 = j * block_k
  klo_Q1, khi_Q1 = klo_ref[...], khi_ref[...]

  @pl.when(j == 0)
  def _init():
    sink_Q1 = None if sink_ref is None else sink_ref[...]
    acc_ref[...], m_ref[...], l_ref[...] = initial_state(*acc_ref.shape, sink_Q1)

  @pl.when(_block_visible(s0, block_k, klo_Q1, khi_Q1))
  def _step():
    qseg_Q1 = None if qseg_ref is None else qseg_ref[...]
    kvseg_1Z = None if kvseg_ref is None else kvseg_ref[...]
    mask_QZ = key_mask(s0, block_k, klo_Q1, khi_Q1, qseg_Q1, kvseg_1Z)
    acc_QH, m_Q1, l_Q1 = online_softmax_step(
      q_ref[...],
      k_ref[...],
      v_ref[...],
      mask_QZ,
      scale,
      acc_ref[...],
      m_ref[...],
      l_ref[...],
      soft_cap,
    )
    acc_ref[...], m_ref[...], l_ref[...] = acc_QH, m_Q1, l_Q1

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    out_QH, lse_Q1 = finalize(acc_ref[...], m_ref[...], l_ref[...])
    o_ref[...] = out_QH.astype(o_ref.dtype)
    lse_ref[...] = lse_Q1


def _dq_kernel(kfirst_ref, klast_ref, *refs, scale: float, has_segments: bool, soft_cap):
  """Grid (B, N, Tp/Q, Sp/Z), the last axis sequential.

  Refs: scalar-prefetched kfirst, klast i32[B * Tp/Q] (read by the index maps); q [Q, H],
  k [Z, H], v [Z, H], do [Q, H], lse f32[Q, 1], delta f32[Q, 1], klo [Q, 1], khi [Q, 1],
  (qseg [Q, 1], kvseg [1, Z]); output dq [Q, H]; scratch dq f32[Q, H].
  """
  if has_segments:
    (
      q_ref,
      k_ref,
      v_ref,
      do_ref,
      lse_ref,
      delta_ref,
      klo_ref,
      khi_ref,
      qseg_ref,
      kvseg_ref,
      dq_ref,
      acc_ref,
    ) = refs
  else:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, klo_ref, khi_ref, dq_ref, acc_ref) = refs
    qseg_ref = kvseg_ref = None
  del kfirst_ref, klast_ref
  j = pl.program_id(3)
  block_k = k_ref.shape[0]
  s0 = j * block_k
  klo_Q1, khi_Q1 = klo_ref[...], khi_ref[...]

  @pl.when(j == 0)
  def _init():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(_block_visible(s0, block_k, klo_Q1, khi_Q1))
  def _step():
    qseg_Q1 = None if qseg_ref is None else qseg_ref[...]
    kvseg_1Z = None if kvseg_ref is None else kvseg_ref[...]
    mask_QZ = key_mask(s0, block_k, klo_Q1, khi_Q1, qseg_Q1, kvseg_1Z)
    k_ZH = k_ref[...]
    _, ds_QZ = probs_and_dscores(
      q_ref[...],
      k_ZH,
      v_ref[...],
      do_ref[...],
      lse_ref[...],
      delta_ref[...],
      mask_QZ,
      scale,
      soft_cap,
    )
    acc_ref[...] += _dot(ds_QZ.astype(k_ZH.dtype), k_ZH)

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = (acc_ref[...] * scale).astype(dq_ref.dtype)


def _dkdv_kernel(qfirst_ref, qlast_ref, *refs, scale: float, has_segments: bool, soft_cap):
  """Grid (B, K, Sp/Z, G, Tp/Q), the last two axes sequential (the G heads of a group, then
  query blocks), so dk/dv of a key block sum over every query head that reads it.

  Refs: scalar-prefetched qfirst, qlast i32[B * Sp/Z], each key block's range of query blocks
  (outside it the query-side blocks are a neighbour's, so the guard checks the range too);
  q [Q, H], k [Z, H], v [Z, H], do [Q, H], lse f32[Q, 1], delta f32[Q, 1], klo [Q, 1],
  khi [Q, 1], (qseg [Q, 1], kvseg [1, Z]); outputs dk [Z, H], dv [Z, H]; scratch f32[Z, H] x2.
  """
  if has_segments:
    (
      q_ref,
      k_ref,
      v_ref,
      do_ref,
      lse_ref,
      delta_ref,
      klo_ref,
      khi_ref,
      qseg_ref,
      kvseg_ref,
      dk_ref,
      dv_ref,
      dk_acc_ref,
      dv_acc_ref,
    ) = refs
  else:
    (
      q_ref,
      k_ref,
      v_ref,
      do_ref,
      lse_ref,
      delta_ref,
      klo_ref,
      khi_ref,
      dk_ref,
      dv_ref,
      dk_acc_ref,
      dv_acc_ref,
    ) = refs
    qseg_ref = kvseg_ref = None
  g, i = pl.program_id(3), pl.program_id(4)
  block_k = k_ref.shape[0]
  s0 = pl.program_id(2) * block_k
  key_block = pl.program_id(0) * pl.num_programs(2) + pl.program_id(2)
  in_range = (i >= qfirst_ref[key_block]) & (i < qlast_ref[key_block])
  klo_Q1, khi_Q1 = klo_ref[...], khi_ref[...]
  first_step = (g == 0) & (i == 0)
  last_step = (g == pl.num_programs(3) - 1) & (i == pl.num_programs(4) - 1)

  @pl.when(first_step)
  def _init():
    dk_acc_ref[...] = jnp.zeros_like(dk_acc_ref)
    dv_acc_ref[...] = jnp.zeros_like(dv_acc_ref)

  @pl.when(in_range & _block_visible(s0, block_k, klo_Q1, khi_Q1))
  def _step():
    qseg_Q1 = None if qseg_ref is None else qseg_ref[...]
    kvseg_1Z = None if kvseg_ref is None else kvseg_ref[...]
    mask_QZ = key_mask(s0, block_k, klo_Q1, khi_Q1, qseg_Q1, kvseg_1Z)
    q_QH, do_QH = q_ref[...], do_ref[...]
    p_QZ, ds_QZ = probs_and_dscores(
      q_QH, k_ref[...], v_ref[...], do_QH, lse_ref[...], delta_ref[...], mask_QZ, scale, soft_cap
    )
    dv_acc_ref[...] += _dot(p_QZ.astype(do_QH.dtype), do_QH, _TN)
    dk_acc_ref[...] += _dot(ds_QZ.astype(q_QH.dtype), q_QH, _TN)

  @pl.when(last_step)
  def _finish():
    dk_ref[...] = (dk_acc_ref[...] * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)


def _params(interpret: bool, semantics: tuple[str, ...]):
  return None if interpret else pltpu.CompilerParams(dimension_semantics=semantics)


def _clamped(index, first, last, n_blocks: int):
  """A streamed block index clamped into [first, last) (the visible blocks), so a step outside
  them names a block already held and no copy is issued; within [0, n_blocks) when the range is
  empty."""
  return jnp.minimum(jnp.clip(index, first, jnp.maximum(last - 1, first)), n_blocks - 1)


def forward(cfg, q, k, v, klo, khi, qseg, kvseg, sink_NQ1=None):
  """out [B, N, Tp, H], lse f32[B, N, Tp, 1] from head-major padded inputs; sink_NQ1 f32[N, Q, 1]
  each head's sink logit on every row of a query block, or None."""
  B, N, Tp, H = q.shape
  Sp = k.shape[2]
  G, bq, bk = cfg.groups, cfg.block_q, cfg.block_k
  nI, nJ = Tp // bq, Sp // bk
  kfirst_BI, klast_BI = key_blocks_per_query_block(klo, khi, bq, bk)

  def key_block(b, i, j, kfirst, klast):
    return _clamped(j, kfirst[b * nI + i], klast[b * nI + i], nJ)

  q_spec = pl.BlockSpec((None, None, bq, H), lambda b, n, i, j, *_: (b, n, i, 0))
  kv_spec = pl.BlockSpec(
    (None, None, bk, H), lambda b, n, i, j, *t: (b, lax.div(n, G), key_block(b, i, j, *t), 0)
  )
  row_spec = pl.BlockSpec((None, bq, 1), lambda b, n, i, j, *_: (b, i, 0))
  in_specs = [q_spec, kv_spec, kv_spec, row_spec, row_spec]
  args = [q, k, v, klo, khi]
  if sink_NQ1 is not None:
    in_specs = [pl.BlockSpec((None, bq, 1), lambda b, n, i, j, *_: (n, 0, 0)), *in_specs]
    args = [sink_NQ1, *args]
  if cfg.has_segments:
    kvseg_spec = pl.BlockSpec((None, 1, bk), lambda b, n, i, j, *t: (b, 0, key_block(b, i, j, *t)))
    in_specs += [row_spec, kvseg_spec]
    args += [qseg, kvseg]
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,
    grid=(B, N, nI, nJ),
    in_specs=in_specs,
    out_specs=[q_spec, pl.BlockSpec((None, None, bq, 1), lambda b, n, i, j, *_: (b, n, i, 0))],
    scratch_shapes=[
      pltpu.VMEM((bq, H), jnp.float32),
      pltpu.VMEM((bq, 1), jnp.float32),
      pltpu.VMEM((bq, 1), jnp.float32),
    ],
  )
  return pl.pallas_call(
    functools.partial(
      _fwd_kernel,
      scale=cfg.scale,
      has_segments=cfg.has_segments,
      soft_cap=cfg.soft_cap,
      has_sinks=sink_NQ1 is not None,
    ),
    grid_spec=grid_spec,
    out_shape=[
      out_struct(q.shape, q.dtype, q, k, v),
      out_struct((B, N, Tp, 1), jnp.float32, q, k, v),
    ],
    compiler_params=_params(cfg.interpret, ("parallel", "parallel", "parallel", "arbitrary")),
    interpret=cfg.interpret,
    name="flash_attention_fwd_tpu",
  )(kfirst_BI.reshape(-1), klast_BI.reshape(-1), *args)


def backward(cfg, q, k, v, do, lse, delta, klo, khi, qseg, kvseg):
  """dq, dk, dv (head-major) given lse with finite stand-ins and delta, both f32[B, N, Tp, 1]."""
  B, N, Tp, H = q.shape
  K, Sp = k.shape[1], k.shape[2]
  G, bq, bk = cfg.groups, cfg.block_q_bwd, cfg.block_k_bwd
  nI, nJ = Tp // bq, Sp // bk
  seg_args = [qseg, kvseg] if cfg.has_segments else []
  kfirst_BI, klast_BI = key_blocks_per_query_block(klo, khi, bq, bk)

  def key_block(b, i, j, kfirst, klast):
    return _clamped(j, kfirst[b * nI + i], klast[b * nI + i], nJ)

  q_spec = pl.BlockSpec((None, None, bq, H), lambda b, n, i, j, *_: (b, n, i, 0))
  kv_spec = pl.BlockSpec(
    (None, None, bk, H), lambda b, n, i, j, *t: (b, lax.div(n, G), key_block(b, i, j, *t), 0)
  )
  stat_spec = pl.BlockSpec((None, None, bq, 1), lambda b, n, i, j, *_: (b, n, i, 0))
  row_spec = pl.BlockSpec((None, bq, 1), lambda b, n, i, j, *_: (b, i, 0))
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec, row_spec, row_spec]
  if cfg.has_segments:
    kvseg_spec = pl.BlockSpec((None, 1, bk), lambda b, n, i, j, *t: (b, 0, key_block(b, i, j, *t)))
    in_specs += [row_spec, kvseg_spec]
  dq = pl.pallas_call(
    functools.partial(
      _dq_kernel, scale=cfg.scale, has_segments=cfg.has_segments, soft_cap=cfg.soft_cap
    ),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(B, N, nI, nJ),
      in_specs=in_specs,
      out_specs=q_spec,
      scratch_shapes=[pltpu.VMEM((bq, H), jnp.float32)],
    ),
    out_shape=out_struct(q.shape, q.dtype, q, k, v, do),
    compiler_params=_params(cfg.interpret, ("parallel", "parallel", "parallel", "arbitrary")),
    interpret=cfg.interpret,
    name="flash_attention_dq_tpu",
  )(kfirst_BI.reshape(-1), klast_BI.reshape(-1), q, k, v, do, lse, delta, klo, khi, *seg_args)

  # Query head h * G + g reads kv head h; the query-side blocks follow the clamped query block.
  qfirst_BJ, qlast_BJ = query_blocks_per_key_block(klo, khi, bq, bk, Sp)

  def query_block(b, j, i, qfirst, qlast):
    return _clamped(i, qfirst[b * nJ + j], qlast[b * nJ + j], nI)

  q_spec = pl.BlockSpec(
    (None, None, bq, H), lambda b, h, j, g, i, *t: (b, h * G + g, query_block(b, j, i, *t), 0)
  )
  kv_spec = pl.BlockSpec((None, None, bk, H), lambda b, h, j, g, i, *_: (b, h, j, 0))
  stat_spec = pl.BlockSpec(
    (None, None, bq, 1), lambda b, h, j, g, i, *t: (b, h * G + g, query_block(b, j, i, *t), 0)
  )
  row_spec = pl.BlockSpec((None, bq, 1), lambda b, h, j, g, i, *t: (b, query_block(b, j, i, *t), 0))
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec, row_spec, row_spec]
  if cfg.has_segments:
    in_specs += [row_spec, pl.BlockSpec((None, 1, bk), lambda b, h, j, g, i, *_: (b, 0, j))]
  dk, dv = pl.pallas_call(
    functools.partial(
      _dkdv_kernel, scale=cfg.scale, has_segments=cfg.has_segments, soft_cap=cfg.soft_cap
    ),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(B, K, nJ, G, nI),
      in_specs=in_specs,
      out_specs=[kv_spec, kv_spec],
      scratch_shapes=[pltpu.VMEM((bk, H), jnp.float32), pltpu.VMEM((bk, H), jnp.float32)],
    ),
    out_shape=[
      out_struct(k.shape, k.dtype, q, k, v, do),
      out_struct(v.shape, v.dtype, q, k, v, do),
    ],
    compiler_params=_params(
      cfg.interpret, ("parallel", "parallel", "parallel", "arbitrary", "arbitrary")
    ),
    interpret=cfg.interpret,
    name="flash_attention_dkdv_tpu",
  )(qfirst_BJ.reshape(-1), qlast_BJ.reshape(-1), q, k, v, do, lse, delta, klo, khi, *seg_args)
  return dq, dk, dv
