"""Causal attention in query blocks, for XLA backends: the reference's math with less of it.

`attention_reference` scores every query against every key, then masks half of the [T, S] score
matrix away. Here the queries go in blocks of `block` rows, each scored only against the keys up
to its last row (and, with a sliding window, none before its first row's window), so a causal
call computes about (n + 1) / 2n of the reference's scores for n blocks, and the mask applies to
blocks that cross the diagonal. Each block is one softmax over all its visible keys, so no
online rescaling is needed: its values equal the reference's. The backward is written out
(`_attend_bwd`): it keeps what autodiff would (q, k, v and each block's probabilities) and
computes autodiff's products, but assembles dq by concatenation and adds dk, dv into their key
ranges, where autodiff padded every block's slice gradient to full size and summed the pads.

The layout is chosen for XLA's CPU GEMMs: queries and keys go head-major once ([B, K, T, G, H]
and [B, K, S, H]), so each block's scores are a batched [G * c, H] x [H, e] product with the
(batch, kv head) pair leading, and no block transposes anything.

Taken by `kernels.attention`'s "xla" path when the call is causal self-attention in its default
alignment (T == S, no `q_positions`, no `kv_lengths`); segment ids and sliding windows are masked
as in the reference, and a logit soft-cap and attention sinks change each block's softmax as they
change the reference's (the sink is one more column of it, with no value). Against the
reference it skips the blocks above the diagonal (about half the score FLOPs at long T) and never
holds the [T, S] score matrix, only a block's [G * c, e].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .reference import MASKED, attention_mask, cap_scores

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
  soft_cap: float | None = None,
  sinks: Array | None = None,
  block: int | None = None,
  attention_chunk: int | None = None,
) -> Array:
  """Causal self-attention (T == S, query t at position t), computed in float32 per query block.

  Args:
    q: [B, T, N, H] queries.
    k: [B, T, K, H] keys, N a multiple of K.
    v: [B, T, K, H] values.
    scale: softmax scale, default H ** -0.5.
    q_segment_ids, kv_segment_ids: i32[B, T] each, or both None (packed sequences).
    sliding_window: W keys per query, its own included, or None.
    soft_cap: c, scores capped as c * tanh(s / c) before the softmax, or None.
    sinks: f32[N] a sink logit per query head (`kernels.reference`), or None.
    block: query rows per block (default `default_block(T)`); the last block may be shorter.
    attention_chunk: C, each query sees only its own chunk of C positions, or None.

  Returns:
    [B, T, N, H] in q.dtype, equal to `attention_reference(q, k, v, causal=True, ...)` to float
    rounding.
  """
  B, T, N, H = q.shape
  K = k.shape[2]
  G = N // K
  if k.shape[1] != T:
    raise ValueError(
      f"blocked_causal_attention: self-attention only (T == S), got q.shape={tuple(q.shape)} "
      f"k.shape={tuple(k.shape)}"
    )
  c = default_block(T) if block is None else block
  if c < 1:
    raise ValueError(f"blocked_causal_attention: block={block!r} must be a positive int")
  scale = H**-0.5 if scale is None else scale
  mask_BTS = attention_mask(
    T,
    T,
    B,
    causal=True,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    sliding_window=sliding_window,
    attention_chunk=attention_chunk,
  )
  q_BKTGH = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4)
  k_BKSH = k.transpose(0, 2, 1, 3)
  v_BKSH = v.transpose(0, 2, 1, 3).astype(jnp.float32)
  spans = tuple(
    _span(start, min(T, start + c), sliding_window, attention_chunk) for start in range(0, T, c)
  )
  sink_KG = None if sinks is None else sinks.astype(jnp.float32).reshape(K, G)
  cap = None if soft_cap is None else float(soft_cap)
  out_BKTGH = _attend(q_BKTGH, k_BKSH, v_BKSH, mask_BTS, sink_KG, float(scale), spans, cap)
  return out_BKTGH.transpose(0, 2, 1, 3, 4).reshape(B, T, N, H).astype(q.dtype)


def _span(
  start: int, end: int, sliding_window: int | None, attention_chunk: int | None
) -> tuple[int, int, int]:
  """(first query row, end, first key) of one block: the keys up to its last row, none before
  its first row's window or chunk."""
  first = 0 if sliding_window is None else max(0, start - sliding_window + 1)
  return (
    start,
    end,
    first if attention_chunk is None else max(first, start - start % attention_chunk),
  )


def _block_scores(q_BKTGH, k_BKSH, scale, span, soft_cap):
  """f32[B, K, c * G, e]: one block's scaled (and capped) scores against the e keys it may see."""
  B, K, _, G, H = q_BKTGH.shape
  start, end, first = span
  q_BKQH = q_BKTGH[:, :, start:end].reshape(B, K, (end - start) * G, H)
  logits_BKQS = jnp.einsum(
    "BKQH,BKSH->BKQS", q_BKQH, k_BKSH[:, :, first:end], preferred_element_type=jnp.float32
  ) * jnp.float32(scale)
  return cap_scores(logits_BKQS, soft_cap)


def _block_probabilities(q_BKTGH, k_BKSH, mask_BTS, sink_KG, scale, span, soft_cap):
  """(f32[B, K, c * G, e] one block's softmax over the e keys it may see, zeros for rows that
  see no key; f32[B, K, c * G] the sink column's weight, or None without sinks)."""
  B, K, _, G, H = q_BKTGH.shape
  start, end, first = span
  rows = end - start
  logits_BKQS = _block_scores(q_BKTGH, k_BKSH, scale, span, soft_cap)
  logits_BKcGS = logits_BKQS.reshape(B, K, rows, G, end - first)
  mask_BcS = mask_BTS[:, start:end, first:end]
  live_Bc = jnp.any(mask_BcS, axis=-1)
  logits_BKcGS = jnp.where(mask_BcS[:, None, :, None, :], logits_BKcGS, MASKED)
  if sink_KG is None:
    p_BKcGS = jax.nn.softmax(logits_BKcGS, axis=-1) * live_Bc[:, None, :, None, None]
    return p_BKcGS.reshape(B, K, rows * G, end - first), None
  # The sink joins the softmax as a last column; a row that sees no key gives it all the weight
  # (exp(MASKED - sink) underflows to 0).
  sink_BKcG1 = jnp.broadcast_to(sink_KG[None, :, None, :, None], (B, K, rows, G, 1))
  p_BKcGs = jax.nn.softmax(jnp.concatenate([logits_BKcGS, sink_BKcG1], axis=-1), axis=-1)
  p_BKQS = p_BKcGs[..., :-1].reshape(B, K, rows * G, end - first)
  return p_BKQS, p_BKcGs[..., -1].reshape(B, K, rows * G)


def _forward(q_BKTGH, k_BKSH, v_BKSH, mask_BTS, sink_KG, scale, spans, soft_cap):
  """(f32[B, K, T, G, H] the output, each block's (probabilities, sink weights))."""
  B, K, _, G, H = q_BKTGH.shape
  outs, probabilities = [], []
  for span in spans:
    start, end, first = span
    p_BKQS, sink_BKQ = _block_probabilities(
      q_BKTGH, k_BKSH, mask_BTS, sink_KG, scale, span, soft_cap
    )
    out_BKQH = jnp.einsum("BKQS,BKSH->BKQH", p_BKQS, v_BKSH[:, :, first:end])
    outs.append(out_BKQH.reshape(B, K, end - start, G, H))
    probabilities.append((p_BKQS, sink_BKQ))
  return (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)), probabilities


# A hand-written backward with autodiff's residuals (q, k, v and the probabilities): autodiff of
# the blocks slices q per block and k, v per key range, and each slice transposes to a pad of the
# whole array, summed; on XLA's CPU backend those full-size pads and their sum cost more than the
# block's products. Here dq is the blocks' pieces concatenated and dk, dv are added into their key
# ranges in place. The products are autodiff's (the softmax's gradient p * (dp - sum(p * dp))).
# The sink column has no value (dp = 0 there), so its logit's gradient is -p_sink * sum(p * dp);
# a soft-cap multiplies ds by the cap's derivative 1 - tanh^2, from scores recomputed here.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attend(q_BKTGH, k_BKSH, v_BKSH, mask_BTS, sink_KG, scale, spans, soft_cap):
  return _forward(q_BKTGH, k_BKSH, v_BKSH, mask_BTS, sink_KG, scale, spans, soft_cap)[0]


def _attend_fwd(q_BKTGH, k_BKSH, v_BKSH, mask_BTS, sink_KG, scale, spans, soft_cap):
  out_BKTGH, probabilities = _forward(
    q_BKTGH, k_BKSH, v_BKSH, mask_BTS, sink_KG, scale, spans, soft_cap
  )
  return out_BKTGH, (q_BKTGH, k_BKSH, v_BKSH, sink_KG, probabilities)


def _attend_bwd(scale, spans, soft_cap, residuals, dout_BKTGH):
  q_BKTGH, k_BKSH, v_BKSH, sink_KG, probabilities = residuals
  B, K, T, G, H = q_BKTGH.shape
  dk_BKSH = jnp.zeros(k_BKSH.shape, jnp.float32)
  dv_BKSH = jnp.zeros(v_BKSH.shape, jnp.float32)
  dsink_KG = None if sink_KG is None else jnp.zeros(sink_KG.shape, jnp.float32)
  dqs = []
  for span, (p_BKQS, sink_BKQ) in zip(spans, probabilities):
    start, end, first = span
    rows = end - start
    q_BKQH = q_BKTGH[:, :, start:end].reshape(B, K, rows * G, H)
    dout_BKQH = dout_BKTGH[:, :, start:end].reshape(B, K, rows * G, H)
    k_BKsH, v_BKsH = k_BKSH[:, :, first:end], v_BKSH[:, :, first:end]
    dp_BKQS = jnp.einsum("BKQH,BKSH->BKQS", dout_BKQH, v_BKsH)
    delta_BKQ1 = jnp.sum(p_BKQS * dp_BKQS, axis=-1, keepdims=True)
    ds_BKQS = p_BKQS * (dp_BKQS - delta_BKQ1)
    if sink_BKQ is not None:
      dsink_BKcG = (-sink_BKQ * delta_BKQ1[..., 0]).reshape(B, K, rows, G)
      dsink_KG = dsink_KG + jnp.sum(dsink_BKcG, axis=(0, 2))
    if soft_cap is not None:
      tanh_BKQS = _block_scores(q_BKTGH, k_BKSH, scale, span, soft_cap) / jnp.float32(soft_cap)
      ds_BKQS = ds_BKQS * (1.0 - tanh_BKQS * tanh_BKQS)
    ds_BKQS = ds_BKQS * jnp.float32(scale)
    dqs.append(jnp.einsum("BKQS,BKSH->BKQH", ds_BKQS, k_BKsH).reshape(B, K, rows, G, H))
    # dk = ds^T q and dv = p^T dout contract the query axis, which is not ds's and p's minor
    # one. XLA folds a plain transpose back into the dot's dimension numbers, and its CPU backend
    # then runs that dot with its own naive loops, not the GEMM library's blocked kernel. The
    # barrier keeps the transposes as copies, so both dots contract a minor axis.
    dsT_BKSQ, pT_BKSQ = jax.lax.optimization_barrier(
      (jnp.swapaxes(ds_BKQS, -1, -2), jnp.swapaxes(p_BKQS, -1, -2))
    )
    dk_BKsH = jnp.einsum("BKSQ,BKQH->BKSH", dsT_BKSQ, q_BKQH)
    dv_BKsH = jnp.einsum("BKSQ,BKQH->BKSH", pT_BKSQ, dout_BKQH)
    dk_BKSH = dk_BKSH.at[:, :, first:end].add(dk_BKsH)
    dv_BKSH = dv_BKSH.at[:, :, first:end].add(dv_BKsH)
  dq_BKTGH = dqs[0] if len(dqs) == 1 else jnp.concatenate(dqs, axis=2)
  dtypes = (q_BKTGH.dtype, k_BKSH.dtype, v_BKSH.dtype)
  grads = (dq_BKTGH, dk_BKSH, dv_BKSH)
  return (*(g.astype(d) for g, d in zip(grads, dtypes)), None, dsink_KG)


_attend.defvjp(_attend_fwd, _attend_bwd)
