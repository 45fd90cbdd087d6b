"""FlashAttention kernel bodies: forward, dq and dk/dv, each a loop over key (or query) blocks.

One program owns one output tile and streams the other sequence through an in-kernel
`fori_loop`, keeping the online-softmax state (running max m, running sum l, accumulator) in
registers. This is the shape the Pallas GPU (Triton) backend needs, since its grid has no
sequential axis to carry state along, and it is what interpret mode runs on CPU.

Masking arrives pre-folded by the wrapper (`kernels.flash_attention`) into two per-query-row
bounds: key s is visible to query row t iff `klo[t] <= s < khi[t]` (and, with packed sequences,
the segment ids match). Causal masks, sliding windows, kv lengths, query positions and the padded
tail all reduce to these bounds, so the kernels stay small, and the per-block min/max of the
bounds gives the range of key blocks worth visiting: a sliding window's rows start late, so the
key blocks wholly before every row's window are never loaded.

A logit soft-cap (`soft_cap`, static) passes each tile's scaled scores through c * tanh(s / c)
before the mask, and the backward multiplies ds by the cap's derivative 1 - tanh^2. Attention
sinks enter the forward as the online softmax's starting state: a row begins having seen the
sink column (m = sink, l = exp(sink - m) = 1, no value), so the sink is counted once and the
log-sum-exp includes it; the backward's p = exp(s - lse) is then right unchanged, and the sinks'
own gradient needs only lse and delta (`kernels.flash_attention`).

Ref shapes in the comments use Q = block_q, Z = block_k, and Tp / Sp for the padded lengths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .reference import cap_scores

_NT = (((1,), (1,)), ((), ()))  # contract the last dims: a @ b.T
_TN = (((0,), (0,)), ((), ()))  # contract the first dims: a.T @ b


def out_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
  """A pallas_call output of `shape` and `dtype`, varying over every manual mesh axis its
  `inputs` vary over: inside a shard_map (a pipeline stage, say) the outputs are per-device
  values like the inputs; elsewhere there are no such axes."""
  varying = frozenset().union(*(jax.typeof(x).mat.varying for x in inputs))
  mat = jax.sharding.ManualAxisType(varying=varying)
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def _dot(a, b, dims=None):
  """Matmul with float32 accumulation; `dims` picks a @ b.T or a.T @ b without a transpose."""
  dims = (((1,), (0,)), ((), ())) if dims is None else dims
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def query_blocks_per_key_block(klo_BT1, khi_BT1, block_q: int, block_k: int, Sp: int):
  """i32[B, J] qfirst, qlast: for each key block, the query blocks [qfirst, qlast) that may see
  any of its keys.

  Each key block gets one contiguous range. Bounds made monotone over query blocks (a running
  max of khi, a reversed running min of klo) only ever widen it, so the range stays exact for
  ordinary positions and a safe superset for arbitrary `q_positions`.
  """
  B, Tp, _ = klo_BT1.shape
  klo_BI = jnp.min(klo_BT1.reshape(B, Tp // block_q, block_q), axis=-1)
  khi_BI = jnp.max(khi_BT1.reshape(B, Tp // block_q, block_q), axis=-1)
  khi_BI = lax.cummax(khi_BI, axis=1)
  klo_BI = lax.cummin(klo_BI, axis=1, reverse=True)
  s0_J = jnp.arange(Sp // block_k, dtype=jnp.int32) * block_k
  qfirst_BJ = jnp.sum(khi_BI[:, None, :] <= s0_J[None, :, None], axis=-1, dtype=jnp.int32)
  qlast_BJ = jnp.sum(klo_BI[:, None, :] < s0_J[None, :, None] + block_k, axis=-1, dtype=jnp.int32)
  return qfirst_BJ, qlast_BJ


def key_blocks_per_query_block(klo_BT1, khi_BT1, block_q: int, block_k: int):
  """i32[B, I] kfirst, klast: for each query block, the key blocks [kfirst, klast) holding a
  key any of its rows sees (empty, kfirst >= klast, for a block whose rows see nothing)."""
  B, Tp, _ = klo_BT1.shape
  kfirst_BI = jnp.min(klo_BT1.reshape(B, Tp // block_q, block_q), axis=-1) // block_k
  klast_BI = -(-jnp.max(khi_BT1.reshape(B, Tp // block_q, block_q), axis=-1) // block_k)
  return kfirst_BI.astype(jnp.int32), klast_BI.astype(jnp.int32)


def _key_block_range(klo_Q1, khi_Q1, block_k):
  """[first, last) key blocks that hold a visible key for any row of this query block."""
  # Empty rows carry klo = Sp, khi = 0 (set by the wrapper), so they never widen the range.
  first = lax.div(jnp.min(klo_Q1), block_k)
  last = pl.cdiv(jnp.max(khi_Q1), block_k)
  return first, last


def online_softmax_step(q_QH, k_ZH, v_ZH, mask_QZ, scale, acc_QH, m_Q1, l_Q1, soft_cap=None):
  """Folds one key block into the running (acc, m, l) of a query block (FlashAttention-2)."""
  s_QZ = jnp.where(mask_QZ, cap_scores(_dot(q_QH, k_ZH, _NT) * scale, soft_cap), -jnp.inf)
  m_new_Q1 = jnp.maximum(m_Q1, jnp.max(s_QZ, axis=1, keepdims=True))
  # A row with nothing visible yet keeps m = -inf; subtracting a finite 0 instead makes
  # exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN.
  m_safe_Q1 = jnp.where(m_new_Q1 == -jnp.inf, 0.0, m_new_Q1)
  p_QZ = jnp.exp(s_QZ - m_safe_Q1)
  alpha_Q1 = jnp.exp(m_Q1 - m_safe_Q1)
  l_Q1 = alpha_Q1 * l_Q1 + jnp.sum(p_QZ, axis=1, keepdims=True)
  # p goes to the matmul in the input dtype (bf16 tensor cores), accumulating in float32.
  acc_QH = alpha_Q1 * acc_QH + _dot(p_QZ.astype(v_ZH.dtype), v_ZH)
  return acc_QH, m_new_Q1, l_Q1


def finalize(acc_QH, m_Q1, l_Q1):
  """(out f32[Q, H], lse f32[Q, 1]); rows that saw no key (l = 0) give zeros and lse -inf."""
  empty_Q1 = l_Q1 == 0.0
  l_safe_Q1 = jnp.where(empty_Q1, 1.0, l_Q1)
  return acc_QH / l_safe_Q1, jnp.where(empty_Q1, -jnp.inf, m_Q1 + jnp.log(l_safe_Q1))


def probs_and_dscores(q_QH, k_ZH, v_ZH, do_QH, lse_Q1, delta_Q1, mask_QZ, scale, soft_cap=None):
  """Recomputes p = softmax(s) of one tile from lse, and ds = dL/ds (without the scale)."""
  s_QZ = cap_scores(_dot(q_QH, k_ZH, _NT) * scale, soft_cap)
  # lse of a fully masked row arrives as a finite stand-in, so masked entries give exp(-inf) = 0.
  p_QZ = jnp.exp(jnp.where(mask_QZ, s_QZ, -jnp.inf) - lse_Q1)
  dp_QZ = _dot(do_QH, v_ZH, _NT)
  ds_QZ = p_QZ * (dp_QZ - delta_Q1)
  if soft_cap is not None:  # d(c * tanh(x / c))/dx = 1 - tanh(x / c)^2
    tanh_QZ = s_QZ / jnp.float32(soft_cap)
    ds_QZ = ds_QZ * (1.0 - tanh_QZ * tanh_QZ)
  return p_QZ, ds_QZ


def initial_state(block_q: int, head_dim: int, sink_Q1=None):
  """(acc, m, l) before any key: nothing seen (m = -inf, l = 0), or the sink column seen."""
  acc_QH = jnp.zeros((block_q, head_dim), jnp.float32)
  if sink_Q1 is None:
    return (
      acc_QH,
      jnp.full((block_q, 1), -jnp.inf, jnp.float32),
      jnp.zeros((block_q, 1), jnp.float32),
    )
  return acc_QH, sink_Q1.astype(jnp.float32), jnp.ones((block_q, 1), jnp.float32)


def key_mask(s0, block_k, klo_Q1, khi_Q1, qseg_Q1=None, kvseg_1Z=None):
  """bool[Q, Z]: which keys s0 .. s0 + Z of a key block each query row may see."""
  kpos_1Z = s0 + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
  mask_QZ = (kpos_1Z >= klo_Q1) & (kpos_1Z < khi_Q1)
  if kvseg_1Z is not None:
    mask_QZ &= qseg_Q1 == kvseg_1Z
  return mask_QZ


def _kv_segments(kvseg_ref, s0, block_k):
  return None if kvseg_ref is None else kvseg_ref[:, pl.ds(s0, block_k)]


def flash_fwd_kernel(
  *refs,
  scale: float,
  block_k: int,
  has_segments: bool,
  soft_cap: float | None = None,
  has_sinks: bool = False,
):
  """One query block of one head against all visible key blocks of its kv head.

  Refs: (sink f32[Q, 1], the head's sink logit on every row;) q [Q, H], k [Sp, H], v [Sp, H],
  klo [Q, 1], khi [Q, 1], (qseg [Q, 1], kvseg [1, Sp]); outputs o [Q, H], lse f32[Q, 1].
  """
  sink_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
  if has_segments:
    q_ref, k_ref, v_ref, klo_ref, khi_ref, qseg_ref, kvseg_ref, o_ref, lse_ref = refs
    qseg_Q1 = qseg_ref[...]
  else:
    q_ref, k_ref, v_ref, klo_ref, khi_ref, o_ref, lse_ref = refs
    qseg_Q1 = kvseg_ref = None
  block_q, head_dim = q_ref.shape
  q_QH = q_ref[...]
  klo_Q1, khi_Q1 = klo_ref[...], khi_ref[...]

  def body(j, carry):
    acc_QH, m_Q1, l_Q1 = carry
    s0 = pl.multiple_of(j * block_k, block_k)
    k_ZH = k_ref[pl.ds(s0, block_k), :]
    v_ZH = v_ref[pl.ds(s0, block_k), :]
    kvseg_1Z = _kv_segments(kvseg_ref, s0, block_k)
    mask_QZ = key_mask(s0, block_k, klo_Q1, khi_Q1, qseg_Q1, kvseg_1Z)
    return online_softmax_step(q_QH, k_ZH, v_ZH, mask_QZ, scale, acc_QH, m_Q1, l_Q1, soft_cap)

  first, last = _key_block_range(klo_Q1, khi_Q1, block_k)
  init = initial_state(block_q, head_dim, None if sink_ref is None else sink_ref[...])
  acc_QH, m_Q1, l_Q1 = lax.fori_loop(first, last, body, init)
  out_QH, lse_Q1 = finalize(acc_QH, m_Q1, l_Q1)
  o_ref[...] = out_QH.astype(o_ref.dtype)
  lse_ref[...] = lse_Q1


def flash_dq_kernel(
  *refs, scale: float, block_k: int, has_segments: bool, soft_cap: float | None = None
):
  """dq for one query block of one head: the forward's loop again, recomputing p from lse.

  Refs: q [Q, H], k [Sp, H], v [Sp, H], do [Q, H], lse f32[Q, 1], delta f32[Q, 1], klo [Q, 1],
  khi [Q, 1], (qseg [Q, 1], kvseg [1, Sp]); output dq [Q, H].
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
    ) = refs
    qseg_Q1 = qseg_ref[...]
  else:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, klo_ref, khi_ref, dq_ref = refs
    qseg_Q1 = kvseg_ref = None
  block_q, head_dim = q_ref.shape
  q_QH, do_QH = q_ref[...], do_ref[...]
  lse_Q1, delta_Q1 = lse_ref[...], delta_ref[...]
  klo_Q1, khi_Q1 = klo_ref[...], khi_ref[...]

  def body(j, dq_QH):
    s0 = pl.multiple_of(j * block_k, block_k)
    k_ZH = k_ref[pl.ds(s0, block_k), :]
    v_ZH = v_ref[pl.ds(s0, block_k), :]
    kvseg_1Z = _kv_segments(kvseg_ref, s0, block_k)
    mask_QZ = key_mask(s0, block_k, klo_Q1, khi_Q1, qseg_Q1, kvseg_1Z)
    _, ds_QZ = probs_and_dscores(
      q_QH, k_ZH, v_ZH, do_QH, lse_Q1, delta_Q1, mask_QZ, scale, soft_cap
    )
    return dq_QH + _dot(ds_QZ.astype(k_ZH.dtype), k_ZH)

  first, last = _key_block_range(klo_Q1, khi_Q1, block_k)
  dq_QH = lax.fori_loop(first, last, body, jnp.zeros((block_q, head_dim), jnp.float32))
  dq_ref[...] = (dq_QH * scale).astype(dq_ref.dtype)


def flash_dkdv_kernel(
  *refs,
  scale: float,
  block_q: int,
  groups: int,
  has_segments: bool,
  soft_cap: float | None = None,
):
  """dk, dv for one key block of one kv head, summed over the `groups` query heads that read it.

  Refs: q [Tp, G, H], k [Z, H], v [Z, H], do [Tp, G, H], lse f32[G, Tp, 1], delta f32[G, Tp, 1],
  klo [Tp, 1], khi [Tp, 1], qfirst i32[1, Z], qlast i32[1, Z], (qseg [Tp, 1], kvseg [1, Z]);
  outputs dk [Z, H], dv [Z, H]. qfirst/qlast hold, for every key of the block, the range of
  query blocks that can see it.
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
      qfirst_ref,
      qlast_ref,
      qseg_ref,
      kvseg_ref,
      dk_ref,
      dv_ref,
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
      qfirst_ref,
      qlast_ref,
      dk_ref,
      dv_ref,
    ) = refs
    qseg_ref = kvseg_ref = None
  block_k, head_dim = k_ref.shape
  k_ZH, v_ZH = k_ref[...], v_ref[...]
  s0 = pl.program_id(2) * block_k
  kvseg_1Z = None if kvseg_ref is None else kvseg_ref[...]
  first = jnp.min(qfirst_ref[...])
  last = jnp.max(qlast_ref[...])

  def q_block(i, g, carry):
    dk_ZH, dv_ZH = carry
    t0 = pl.multiple_of(i * block_q, block_q)
    rows = pl.ds(t0, block_q)
    q_QH = q_ref[rows, g, :]
    do_QH = do_ref[rows, g, :]
    lse_Q1 = lse_ref[g, rows, :]
    delta_Q1 = delta_ref[g, rows, :]
    qseg_Q1 = None if qseg_ref is None else qseg_ref[rows, :]
    mask_QZ = key_mask(s0, block_k, klo_ref[rows, :], khi_ref[rows, :], qseg_Q1, kvseg_1Z)
    p_QZ, ds_QZ = probs_and_dscores(
      q_QH, k_ZH, v_ZH, do_QH, lse_Q1, delta_Q1, mask_QZ, scale, soft_cap
    )
    dv_ZH = dv_ZH + _dot(p_QZ.astype(do_QH.dtype), do_QH, _TN)
    dk_ZH = dk_ZH + _dot(ds_QZ.astype(q_QH.dtype), q_QH, _TN)
    return dk_ZH, dv_ZH

  def head(g, carry):
    return lax.fori_loop(first, last, lambda i, c: q_block(i, g, c), carry)

  zeros_ZH = jnp.zeros((block_k, head_dim), jnp.float32)
  dk_ZH, dv_ZH = lax.fori_loop(0, groups, head, (zeros_ZH, zeros_ZH))
  dk_ref[...] = (dk_ZH * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv_ZH.astype(dv_ref.dtype)
