"""FlashAttention kernel bodies and launches for TPU (Mosaic).

Same math as `kernels.flash_kernels` (the online-softmax step and the backward tile are shared),
different shape: Mosaic pipelines HBM -> VMEM copies along the grid, so the streamed sequence is a
grid axis marked "arbitrary" (sequential on one core) and the softmax state lives in VMEM scratch
across grid steps, instead of an in-kernel loop over a whole-sequence ref that would have to fit
in VMEM. Tiles must be (8, 128)-aligned in their last two dims, so the arrays are head-major:
q [B, N, Tp, H], k and v [B, K, Sp, H]; per-query-row vectors are [B, Tp, 1] and per-key vectors
[B, 1, Sp]. Blocks no query row can see are skipped with `pl.when` (their copies still run).
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
  key_mask,
  online_softmax_step,
  out_struct,
  probs_and_dscores,
)


def _block_visible(s0, block_k, klo_Q1, khi_Q1):
  """Whether any row of this query block sees any key of the key block starting at s0."""
  return (s0 < jnp.max(khi_Q1)) & (s0 + block_k > jnp.min(klo_Q1))


def _fwd_kernel(*refs, scale: float, has_segments: bool, soft_cap, has_sinks: bool):
  """Grid (B, N, Tp/Q, Sp/Z), the last axis sequential.

  Refs: (sink f32[Q, 1];) q [Q, H], k [Z, H], v [Z, H], klo [Q, 1], khi [Q, 1], (qseg [Q, 1],
  kvseg [1, Z]); outputs o [Q, H], lse f32[Q, 1]; scratch acc f32[Q, H], m f32[Q, 1], l f32[Q, 1].
  """
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


def _dq_kernel(*refs, scale: float, has_segments: bool, soft_cap):
  """Grid (B, N, Tp/Q, Sp/Z), the last axis sequential.

  Refs: q [Q, H], k [Z, H], v [Z, H], do [Q, H], lse f32[Q, 1], delta f32[Q, 1], klo [Q, 1],
  khi [Q, 1], (qseg [Q, 1], kvseg [1, Z]); output dq [Q, H]; scratch dq f32[Q, H].
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


def _dkdv_kernel(*refs, scale: float, has_segments: bool, soft_cap):
  """Grid (B, K, Sp/Z, G, Tp/Q), the last two axes sequential (the G heads of a group, then
  query blocks), so dk/dv of a key block sum over every query head that reads it.

  Refs: q [Q, H], k [Z, H], v [Z, H], do [Q, H], lse f32[Q, 1], delta f32[Q, 1], klo [Q, 1],
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
  klo_Q1, khi_Q1 = klo_ref[...], khi_ref[...]
  first_step = (g == 0) & (i == 0)
  last_step = (g == pl.num_programs(3) - 1) & (i == pl.num_programs(4) - 1)

  @pl.when(first_step)
  def _init():
    dk_acc_ref[...] = jnp.zeros_like(dk_acc_ref)
    dv_acc_ref[...] = jnp.zeros_like(dv_acc_ref)

  @pl.when(_block_visible(s0, block_k, klo_Q1, khi_Q1))
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


def forward(cfg, q, k, v, klo, khi, qseg, kvseg, sink_NQ1=None):
  """out [B, N, Tp, H], lse f32[B, N, Tp, 1] from head-major padded inputs; sink_NQ1 f32[N, Q, 1]
  each head's sink logit on every row of a query block, or None."""
  B, N, Tp, H = q.shape
  Sp = k.shape[2]
  G, bq, bk = cfg.groups, cfg.block_q, cfg.block_k
  q_spec = pl.BlockSpec((None, None, bq, H), lambda b, n, i, j: (b, n, i, 0))
  kv_spec = pl.BlockSpec((None, None, bk, H), lambda b, n, i, j: (b, lax.div(n, G), j, 0))
  row_spec = pl.BlockSpec((None, bq, 1), lambda b, n, i, j: (b, i, 0))
  in_specs = [q_spec, kv_spec, kv_spec, row_spec, row_spec]
  args = [q, k, v, klo, khi]
  if sink_NQ1 is not None:
    in_specs = [pl.BlockSpec((None, bq, 1), lambda b, n, i, j: (n, 0, 0)), *in_specs]
    args = [sink_NQ1, *args]
  if cfg.has_segments:
    in_specs += [row_spec, pl.BlockSpec((None, 1, bk), lambda b, n, i, j: (b, 0, j))]
    args += [qseg, kvseg]
  return pl.pallas_call(
    functools.partial(
      _fwd_kernel,
      scale=cfg.scale,
      has_segments=cfg.has_segments,
      soft_cap=cfg.soft_cap,
      has_sinks=sink_NQ1 is not None,
    ),
    grid=(B, N, Tp // bq, Sp // bk),
    in_specs=in_specs,
    out_specs=[q_spec, pl.BlockSpec((None, None, bq, 1), lambda b, n, i, j: (b, n, i, 0))],
    out_shape=[
      out_struct(q.shape, q.dtype, q, k, v),
      out_struct((B, N, Tp, 1), jnp.float32, q, k, v),
    ],
    scratch_shapes=[
      pltpu.VMEM((bq, H), jnp.float32),
      pltpu.VMEM((bq, 1), jnp.float32),
      pltpu.VMEM((bq, 1), jnp.float32),
    ],
    compiler_params=_params(cfg.interpret, ("parallel", "parallel", "parallel", "arbitrary")),
    interpret=cfg.interpret,
    name="flash_attention_fwd_tpu",
  )(*args)


def backward(cfg, q, k, v, do, lse, delta, klo, khi, qseg, kvseg):
  """dq, dk, dv (head-major) given lse with finite stand-ins and delta, both f32[B, N, Tp, 1]."""
  B, N, Tp, H = q.shape
  K, Sp = k.shape[1], k.shape[2]
  G, bq, bk = cfg.groups, cfg.block_q_bwd, cfg.block_k_bwd
  seg_args = [qseg, kvseg] if cfg.has_segments else []

  q_spec = pl.BlockSpec((None, None, bq, H), lambda b, n, i, j: (b, n, i, 0))
  kv_spec = pl.BlockSpec((None, None, bk, H), lambda b, n, i, j: (b, lax.div(n, G), j, 0))
  stat_spec = pl.BlockSpec((None, None, bq, 1), lambda b, n, i, j: (b, n, i, 0))
  row_spec = pl.BlockSpec((None, bq, 1), lambda b, n, i, j: (b, i, 0))
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec, row_spec, row_spec]
  if cfg.has_segments:
    in_specs += [row_spec, pl.BlockSpec((None, 1, bk), lambda b, n, i, j: (b, 0, j))]
  dq = pl.pallas_call(
    functools.partial(
      _dq_kernel, scale=cfg.scale, has_segments=cfg.has_segments, soft_cap=cfg.soft_cap
    ),
    grid=(B, N, Tp // bq, Sp // bk),
    in_specs=in_specs,
    out_specs=q_spec,
    out_shape=out_struct(q.shape, q.dtype, q, k, v, do),
    scratch_shapes=[pltpu.VMEM((bq, H), jnp.float32)],
    compiler_params=_params(cfg.interpret, ("parallel", "parallel", "parallel", "arbitrary")),
    interpret=cfg.interpret,
    name="flash_attention_dq_tpu",
  )(q, k, v, do, lse, delta, klo, khi, *seg_args)

  # Query head h * G + g reads kv head h.
  q_spec = pl.BlockSpec((None, None, bq, H), lambda b, h, j, g, i: (b, h * G + g, i, 0))
  kv_spec = pl.BlockSpec((None, None, bk, H), lambda b, h, j, g, i: (b, h, j, 0))
  stat_spec = pl.BlockSpec((None, None, bq, 1), lambda b, h, j, g, i: (b, h * G + g, i, 0))
  row_spec = pl.BlockSpec((None, bq, 1), lambda b, h, j, g, i: (b, i, 0))
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec, row_spec, row_spec]
  if cfg.has_segments:
    in_specs += [row_spec, pl.BlockSpec((None, 1, bk), lambda b, h, j, g, i: (b, 0, j))]
  dk, dv = pl.pallas_call(
    functools.partial(
      _dkdv_kernel, scale=cfg.scale, has_segments=cfg.has_segments, soft_cap=cfg.soft_cap
    ),
    grid=(B, K, Sp // bk, G, Tp // bq),
    in_specs=in_specs,
    out_specs=[kv_spec, kv_spec],
    out_shape=[
      out_struct(k.shape, k.dtype, q, k, v, do),
      out_struct(v.shape, v.dtype, q, k, v, do),
    ],
    scratch_shapes=[pltpu.VMEM((bk, H), jnp.float32), pltpu.VMEM((bk, H), jnp.float32)],
    compiler_params=_params(
      cfg.interpret, ("parallel", "parallel", "parallel", "arbitrary", "arbitrary")
    ),
    interpret=cfg.interpret,
    name="flash_attention_dkdv_tpu",
  )(q, k, v, do, lse, delta, klo, khi, *seg_args)
  return dq, dk, dv
