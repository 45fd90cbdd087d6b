"""Causal attention in query blocks, for XLA backends: the reference's math with less of it.

`attention_reference` scores every query against every key, then masks half of the [T, S] score
matrix away. Here the queries go in blocks of `block` rows, each scored only against the keys up
to its last row (and, with a sliding window, none before its first row's window), so a causal
call computes about (n + 1) / 2n of the reference's scores for n blocks, and the mask applies to
blocks that cross the diagonal. Each block is one softmax over all its visible keys, so no
online rescaling is needed: its values equal the reference's.

The backward is written by hand (`jax.custom_vjp`), FlashAttention-style: the forward saves only
q, k, v, the output and each row's log-sum-exp, and the backward recomputes each block's
probabilities from the log-sum-exp, then takes dq, dk and dv from them block by block (dk and dv
summed over the blocks that see each key). XLA's autodiff of the forward instead kept every
block's probabilities and softmax intermediates and moved them through many small copies and
transposes.

The layout is chosen for XLA's CPU GEMMs: keys and values go head-major once ([B, K, S, H]), and
each block of queries goes head-major as it is sliced ([B, K, c * G, H]), so each block's scores
are a batched [G * c, H] x [H, e] product with the (batch, kv head) pair leading; each block's
output (and in the backward its dq) goes back to [B, c, N, H] before the blocks are concatenated,
so no whole [B, T, N, H] array is transposed. The backward's products keep the same layout: a
group's G query heads are rows of one product, so dk and dv sum over them inside the GEMM.

Taken by `kernels.attention`'s "xla" path when the call is causal self-attention in its default
alignment (T == S, no `q_positions`, no `kv_lengths`); segment ids and sliding windows are masked
as in the reference. Measured against the reference on 2 CPU cores (BENCHMARKS.md, "Training:
throughput against PyTorch"): forward and backward 2.8x faster at T = 128, 4.5x at T = 1024.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .reference import MASKED

Array = jax.Array


def default_block(T: int) -> int:
  """Query rows per block: a quarter of the sequence, between 16 and 64 rows.

  Measured on CPU: smaller blocks skip more of the masked triangle, larger ones run larger GEMMs;
  T = 128 was fastest at 32 rows, T = 256 and T = 1024 at 64."""
  return min(64, max(16, T // 4))


def blocked_causal_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  scale: float | None = None,
  q_segment_ids: Array | None = None,
  kv_segment_ids: Array | None = None,
  sliding_window: int | None = None,
  block: int | None = None,
) -> Array:
  """Causal self-attention (T == S, query t at position t), computed in float32 per query block.

  Args:
    q: [B, T, N, H] queries.
    k: [B, T, K, H] keys, N a multiple of K.
    v: [B, T, K, H] values.
    scale: softmax scale, default H ** -0.5.
    q_segment_ids, kv_segment_ids: i32[B, T] each, or both None (packed sequences).
    sliding_window: W keys per query, its own included, or None.
    block: query rows per block (default `default_block(T)`); the last block may be shorter.

  Returns:
    [B, T, N, H] in q.dtype, equal to `attention_reference(q, k, v, causal=True, ...)` to float
    rounding; its gradients equal the reference's to float rounding too.
  """
  B, T, N, H = q.shape
  if k.shape[1] != T:
    raise ValueError(
      f"blocked_causal_attention: self-attention only (T == S), got q.shape={tuple(q.shape)} "
      f"k.shape={tuple(k.shape)}"
    )
  c = default_block(T) if block is None else block
  if c < 1:
    raise ValueError(f"blocked_causal_attention: block={block!r} must be a positive int")
  scale = H**-0.5 if scale is None else scale
  k_BKSH = k.transpose(0, 2, 1, 3)
  v_BKSH = v.transpose(0, 2, 1, 3)
  out_BTNH = _blocked(
    q, k_BKSH, v_BKSH, q_segment_ids, kv_segment_ids, float(scale), sliding_window, c
  )
  return out_BTNH.astype(q.dtype)


def _blocks(T: int, c: int, window: int | None):
  """(start, end, first) per query block: its rows [start, end) and its keys [first, end)."""
  for start in range(0, T, c):
    end = min(T, start + c)
    yield start, end, 0 if window is None else max(0, start - window + 1)


def _block_mask(start, end, first, q_seg_BT, kv_seg_BT, window):
  """bool[B or 1, rows, end - first]: the reference's mask for one block (`attention_mask`).

  Without segment ids it is a constant XLA folds, shared by the batch."""
  qpos_c1 = jnp.arange(start, end, dtype=jnp.int32)[:, None]
  kpos_1e = jnp.arange(first, end, dtype=jnp.int32)[None, :]
  mask_ce = kpos_1e <= qpos_c1
  if window is not None:
    mask_ce &= qpos_c1 - kpos_1e < window
  mask_Bce = mask_ce[None]
  if q_seg_BT is not None:
    mask_Bce = mask_Bce & (q_seg_BT[:, start:end, None] == kv_seg_BT[:, None, first:end])
  return mask_Bce


def _head_major(x_BTNH, start, end, K):
  """[B, T, N, X] -> [B, K, rows * G, X]: one block of rows, head-major (one copy per block,
  fused with the slice, instead of a transposed copy of the whole array and then a slice)."""
  B, _, N, H = x_BTNH.shape
  rows, G = end - start, N // K
  x_BcKGH = x_BTNH[:, start:end].reshape(B, rows, K, G, H)
  return x_BcKGH.transpose(0, 2, 1, 3, 4).reshape(B, K, rows * G, H)


def _token_major(x_BKQH, rows):
  """[B, K, rows * G, H] -> [B, rows, K * G, H]: a block back in the caller's layout, so the
  blocks' concatenation along T is the result, with no transpose of the whole array after it."""
  B, K, Q, H = x_BKQH.shape
  G = Q // rows
  return x_BKQH.reshape(B, K, rows, G, H).transpose(0, 2, 1, 3, 4).reshape(B, rows, K * G, H)


def _block_logits(q_BKQH, k_BKSH, mask_Bce, start, end, first, scale):
  """f32[B, K, rows * G, e]: one block's scaled scores, MASKED where the mask hides a key."""
  B, K, Q, H = q_BKQH.shape
  rows, e = end - start, end - first
  G = Q // rows
  logits_BKQe = jnp.einsum(
    "BKQH,BKSH->BKQS", q_BKQH, k_BKSH[:, :, first:end], preferred_element_type=jnp.float32
  ) * jnp.float32(scale)
  logits_BKcGe = logits_BKQe.reshape(B, K, rows, G, e)
  logits_BKcGe = jnp.where(mask_Bce[:, None, :, None, :], logits_BKcGe, MASKED)
  return logits_BKcGe.reshape(B, K, rows * G, e)


def _forward(q_BTNH, k_BKSH, v_BKSH, q_seg_BT, kv_seg_BT, scale, window, c):
  """f32 out [B, T, N, H], and per block the log-sum-exp f32[B, K, rows * G] (+inf on rows that
  see no key, so the backward's exp(logits - lse) is 0 there)."""
  B, T, N, H = q_BTNH.shape
  K = k_BKSH.shape[1]
  G = N // K
  v_BKSH = v_BKSH.astype(jnp.float32)
  outs, lses = [], []
  for start, end, first in _blocks(T, c, window):
    rows = end - start
    mask_Bce = _block_mask(start, end, first, q_seg_BT, kv_seg_BT, window)
    q_BKQH = _head_major(q_BTNH, start, end, K)
    logits_BKQe = _block_logits(q_BKQH, k_BKSH, mask_Bce, start, end, first, scale)
    max_BKQ1 = jnp.max(logits_BKQe, axis=-1, keepdims=True)
    e_BKQe = jnp.exp(logits_BKQe - max_BKQ1)
    sum_BKQ1 = jnp.sum(e_BKQe, axis=-1, keepdims=True)
    lse_BKQ = (max_BKQ1 + jnp.log(sum_BKQ1))[..., 0]
    p_BKQe = e_BKQe / sum_BKQ1
    if q_seg_BT is not None:
      # Only segment ids can hide every key of a row (its own key is in any window).
      live_Bc = jnp.any(mask_Bce, axis=-1)
      live_BKQ = jnp.broadcast_to(live_Bc[:, None, :, None], (B, K, rows, G)).reshape(B, K, -1)
      p_BKQe = p_BKQe * live_BKQ[..., None]
      lse_BKQ = jnp.where(live_BKQ, lse_BKQ, jnp.inf)
    out_BKQH = jnp.einsum("BKQS,BKSH->BKQH", p_BKQe, v_BKSH[:, :, first:end])
    outs.append(_token_major(out_BKQH, rows))
    lses.append(lse_BKQ)
  out_BTNH = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
  return out_BTNH, tuple(lses)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _blocked(q_BTNH, k_BKSH, v_BKSH, q_seg_BT, kv_seg_BT, scale, window, c):
  """f32 out [B, T, N, H] from q and head-major k, v; differentiated by `_blocked_bwd`."""
  return _forward(q_BTNH, k_BKSH, v_BKSH, q_seg_BT, kv_seg_BT, scale, window, c)[0]


def _blocked_fwd(q_BTNH, k_BKSH, v_BKSH, q_seg_BT, kv_seg_BT, scale, window, c):
  """Saves the inputs, the output and the log-sum-exps: O(T) floats, none of the [rows, e]
  probabilities."""
  out_BTNH, lses = _forward(q_BTNH, k_BKSH, v_BKSH, q_seg_BT, kv_seg_BT, scale, window, c)
  return out_BTNH, (q_BTNH, k_BKSH, v_BKSH, q_seg_BT, kv_seg_BT, out_BTNH, lses)


def _blocked_bwd(scale, window, c, res, dout_BTNH):
  """dq, dk, dv from each block's probabilities recomputed as exp(logits - lse).

  With p the probabilities and dO the output's cotangent: dP = dO V^T, dS = P * (dP - delta) with
  delta = rowsum(dO * O) (the softmax's Jacobian), dQ = dS K * scale, dK = dS^T Q * scale and
  dV = P^T dO; dK and dV sum over the blocks, and over a group's G heads inside each product."""
  q_BTNH, k_BKSH, v_BKSH, q_seg_BT, kv_seg_BT, out_BTNH, lses = res
  B, T, N, H = q_BTNH.shape
  K = k_BKSH.shape[1]
  dout_BTNH = dout_BTNH.astype(jnp.float32)
  delta_BTN1 = jnp.sum(dout_BTNH * out_BTNH, axis=-1, keepdims=True)
  kf_BKSH = k_BKSH.astype(jnp.float32)
  vf_BKSH = v_BKSH.astype(jnp.float32)
  dqs, dk_BKSH, dv_BKSH = [], None, None
  for i, (start, end, first) in enumerate(_blocks(T, c, window)):
    rows = end - start
    q_BKQH = _head_major(q_BTNH, start, end, K)
    mask_Bce = _block_mask(start, end, first, q_seg_BT, kv_seg_BT, window)
    logits_BKQe = _block_logits(q_BKQH, k_BKSH, mask_Bce, start, end, first, scale)
    p_BKQe = jnp.exp(logits_BKQe - lses[i][..., None])
    dout_BKQH = _head_major(dout_BTNH, start, end, K)
    delta_BKQ1 = _head_major(delta_BTN1, start, end, K)
    dp_BKQe = jnp.einsum("BKQH,BKSH->BKQS", dout_BKQH, vf_BKSH[:, :, first:end])
    # The scale folded into dS once, for both dQ and dK.
    ds_BKQe = p_BKQe * (dp_BKQe - delta_BKQ1) * jnp.float32(scale)
    dq_BKQH = jnp.einsum("BKQS,BKSH->BKQH", ds_BKQe, kf_BKSH[:, :, first:end])
    dqs.append(_token_major(dq_BKQH, rows))
    dk_BKeH = jnp.einsum("BKQS,BKQH->BKSH", ds_BKQe, q_BKQH.astype(jnp.float32))
    dv_BKeH = jnp.einsum("BKQS,BKQH->BKSH", p_BKQe, dout_BKQH)
    # Block i's keys [first, end) are every key it sees: each key's dK and dV sum over blocks.
    pad = ((0, 0), (0, 0), (first, T - end), (0, 0))
    if dk_BKSH is None:
      dk_BKSH, dv_BKSH = jnp.pad(dk_BKeH, pad), jnp.pad(dv_BKeH, pad)
    else:
      dk_BKSH = dk_BKSH.at[:, :, first:end].add(dk_BKeH)
      dv_BKSH = dv_BKSH.at[:, :, first:end].add(dv_BKeH)
  dq_BTNH = dqs[0] if len(dqs) == 1 else jnp.concatenate(dqs, axis=1)
  return (
    dq_BTNH.astype(q_BTNH.dtype),
    dk_BKSH.astype(k_BKSH.dtype),
    dv_BKSH.astype(v_BKSH.dtype),
    None,
    None,
  )


_blocked.defvjp(_blocked_fwd, _blocked_bwd)
