"""Pure-jnp attention: the reference every attention kernel is tested against.

It materialises the [T, S] score matrix per head, so it is the memory-hungry baseline that
FlashAttention avoids; on every backend it is also the `implementation="xla"` path.

Masking semantics shared by every implementation behind `atlas_jax.kernels.attention`:

* key s of sequence b is visible only if `s < kv_lengths[b]` (all S keys when `kv_lengths` is None);
* query t sits at absolute position `q_positions[b, t]`; by default the queries are the last T
  positions of the valid keys (bottom-right alignment), `kv_len[b] - T + t`, which is what prefill
  (T == S) and decoding against a cache (T < S) both need;
* `causal`: key s is visible to query t only if `s <= q_positions[b, t]`;
* `sliding_window=W`: only if `q_positions[b, t] - s < W` (W keys including the query's own);
* `attention_chunk=C` (Llama 4's chunked local attention): only if `s // C == q_positions[b, t] //
  C`, the keys of the query's own chunk of C positions; with `causal` a query sees the keys from
  its chunk's start `q - q % C` to itself. With a window too, both bounds hold;
* `q_segment_ids` / `kv_segment_ids`: only if the segment ids are equal (packed sequences).

Two changes to the softmax itself, also shared:

* `soft_cap=c` (Gemma 2): the scaled scores pass through c * tanh(s / c) before the softmax, so
  no logit leaves (-c, c);
* `sinks` f32[N] (gpt-oss): query head n's softmax has one more column, of logit `sinks[n]` and
  no value: p_s = exp(s - m) / (sum_s' exp(s' - m) + exp(sinks[n] - m)). The row's weights then
  sum to less than one, and attention may put its mass on "nothing". The log-sum-exp includes
  the sink column.

A query row with no visible key returns zeros (and log-sum-exp -inf, or its sink with `sinks`),
never NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
# The logit of a hidden key, shared by the jnp attention paths: finite, so a row that sees no key
# gives no NaN, and exp(MASKED - row max) underflows to exactly 0 in float32 for any row that does.
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def check_attention_inputs(
  q: Array,
  k: Array,
  v: Array,
  *,
  q_segment_ids: Array | None = None,
  kv_segment_ids: Array | None = None,
  q_positions: Array | None = None,
  kv_lengths: Array | None = None,
  sliding_window: int | None = None,
  soft_cap: float | None = None,
  sinks: Array | None = None,
  attention_chunk: int | None = None,
) -> None:
  """Raises ValueError naming the shapes when the inputs cannot be attended together."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(
        f"attention: {name} must have rank 4 ([B, T, N, H] for q, [B, S, K, H] for k and v), "
        f"got {name}.shape={tuple(x.shape)}"
      )
  B, T, N, H = q.shape
  if k.shape != v.shape:
    raise ValueError(
      f"attention: k and v must have the same shape [B, S, K, H], got k.shape={tuple(k.shape)} "
      f"and v.shape={tuple(v.shape)}"
    )
  Bk, S, K, Hk = k.shape
  if Bk != B:
    raise ValueError(
      f"attention: batch mismatch, q.shape={tuple(q.shape)} k.shape={tuple(k.shape)}"
    )
  if Hk != H:
    raise ValueError(
      f"attention: head dim mismatch, q.shape={tuple(q.shape)} (H={H}) "
      f"k.shape={tuple(k.shape)} (H={Hk})"
    )
  if K == 0 or N % K:
    raise ValueError(
      f"attention: query heads N={N} must be a positive multiple of kv heads K={K} "
      f"(q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)})"
    )
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(
      f"attention: q, k, v must share a dtype, got q={q.dtype} k={k.dtype} v={v.dtype}"
    )
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"attention: inputs must be floating point, got {q.dtype}")
  expected = {
    "q_segment_ids": (q_segment_ids, (B, T)),
    "kv_segment_ids": (kv_segment_ids, (B, S)),
    "q_positions": (q_positions, (B, T)),
    "kv_lengths": (kv_lengths, (B,)),
  }
  for name, (x, shape) in expected.items():
    if x is not None and tuple(x.shape) != shape:
      raise ValueError(f"attention: {name} must have shape {shape}, got {tuple(x.shape)}")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("attention: pass both q_segment_ids and kv_segment_ids, or neither")
  if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
    raise ValueError(
      f"attention: sliding_window must be a positive int or None, got {sliding_window!r}"
    )
  check_attention_chunk("attention", attention_chunk)
  check_soft_cap_and_sinks("attention", soft_cap, sinks, N)


def check_attention_chunk(fn: str, attention_chunk) -> None:
  """Raises ValueError unless attention_chunk is a positive Python int or None."""
  if attention_chunk is not None and (
    isinstance(attention_chunk, bool) or not isinstance(attention_chunk, int) or attention_chunk < 1
  ):
    raise ValueError(
      f"{fn}: attention_chunk must be a positive int or None, got {attention_chunk!r}"
    )


def chunk_start(q_positions: Array, attention_chunk: int) -> Array:
  """The first position of each query's chunk, q - q % C (same shape as q_positions)."""
  q = q_positions.astype(jnp.int32)
  return q - q % jnp.int32(attention_chunk)


def check_soft_cap_and_sinks(fn: str, soft_cap, sinks, n_heads: int) -> None:
  """Raises ValueError unless soft_cap is a float > 0 or None and sinks is float[N] or None."""
  if soft_cap is not None and (
    isinstance(soft_cap, bool) or not isinstance(soft_cap, (int, float)) or not soft_cap > 0
  ):
    raise ValueError(f"{fn}: soft_cap must be a Python float > 0 or None, got {soft_cap!r}")
  if sinks is None:
    return
  shape = getattr(sinks, "shape", None)
  if shape is None or tuple(shape) != (n_heads,):
    raise ValueError(
      f"{fn}: sinks must be one logit per query head, shape ({n_heads},), got "
      f"{None if shape is None else tuple(shape)}"
    )
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise ValueError(f"{fn}: sinks must be floating point, got {sinks.dtype}")


def cap_scores(s: Array, soft_cap: float | None) -> Array:
  """c * tanh(s / c): Gemma 2's logit soft-cap (identity for None)."""
  return s if soft_cap is None else jnp.float32(soft_cap) * jnp.tanh(s / jnp.float32(soft_cap))


def default_q_positions(T: int, S: int, kv_lengths: Array | None, B: int) -> Array:
  """i32[B, T]: the queries are the last T of the valid keys (bottom-right alignment)."""
  kv_len_B = jnp.full((B,), S, jnp.int32) if kv_lengths is None else kv_lengths.astype(jnp.int32)
  return kv_len_B[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None, :]


def attention_mask(
  T: int,
  S: int,
  B: int,
  *,
  causal: bool,
  q_segment_ids: Array | None = None,
  kv_segment_ids: Array | None = None,
  sliding_window: int | None = None,
  q_positions: Array | None = None,
  kv_lengths: Array | None = None,
  attention_chunk: int | None = None,
) -> Array:
  """bool[B, T, S]: True where query t may attend to key s."""
  if q_positions is None:
    q_positions = default_q_positions(T, S, kv_lengths, B)
  qpos_BT1 = q_positions.astype(jnp.int32)[:, :, None]
  kpos_11S = jnp.arange(S, dtype=jnp.int32)[None, None, :]
  mask_BTS = jnp.ones((B, T, S), bool)
  if kv_lengths is not None:
    mask_BTS &= kpos_11S < kv_lengths.astype(jnp.int32)[:, None, None]
  if causal:
    mask_BTS &= kpos_11S <= qpos_BT1
  if sliding_window is not None:
    mask_BTS &= qpos_BT1 - kpos_11S < sliding_window
  if attention_chunk is not None:
    first_BT1 = chunk_start(qpos_BT1, attention_chunk)
    mask_BTS &= (kpos_11S >= first_BT1) & (kpos_11S < first_BT1 + attention_chunk)
  if q_segment_ids is not None:
    mask_BTS &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
  return mask_BTS


def attention_reference(
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
  attention_chunk: int | None = None,
) -> Array | tuple[Array, Array]:
  """Softmax attention with grouped K/V heads, computed in float32.

  Args:
    q: [B, T, N, H] queries.
    k: [B, S, K, H] keys, N a multiple of K (query head n reads kv head n // (N // K)).
    v: [B, S, K, H] values.
    causal, scale, q_segment_ids, kv_segment_ids, sliding_window, q_positions, kv_lengths: see the
      module docstring. `scale` defaults to H ** -0.5.
    soft_cap: c, scores capped as c * tanh(s / c) before the softmax; None: not capped.
    sinks: f32[N] one extra softmax logit per query head, with no value; None: no sink.
    return_lse: also return the per-row log-sum-exp of the scaled scores.
    attention_chunk: C, each query sees only the keys of its own chunk of C positions (see the
      module docstring); None: no chunks.

  Returns:
    out [B, T, N, H] in q.dtype, and with `return_lse` the log-sum-exp f32[B, T, N].
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
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  scale = H**-0.5 if scale is None else scale
  # Group query heads by their kv head instead of repeating K and V G times in memory.
  q_BTKGH = q.reshape(B, T, K, G, H)
  logits_BKGTS = jnp.einsum(
    "BTKGH,BSKH->BKGTS", q_BTKGH, k, preferred_element_type=jnp.float32
  ) * jnp.float32(scale)
  logits_BKGTS = cap_scores(logits_BKGTS, soft_cap)
  mask_BTS = attention_mask(
    T,
    S,
    B,
    causal=causal,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    sliding_window=sliding_window,
    q_positions=q_positions,
    kv_lengths=kv_lengths,
    attention_chunk=attention_chunk,
  )
  # A finite mask value keeps softmax NaN-free; rows with no visible key are zeroed afterwards.
  live_BT = jnp.any(mask_BTS, axis=-1)
  logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, MASKED)
  if sinks is None:
    p_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1) * live_BT[:, None, None, :, None]
    lse_BKGT = jax.nn.logsumexp(logits_BKGTS, axis=-1)
    lse_BKGT = jnp.where(live_BT[:, None, None], lse_BKGT, -jnp.inf)
  else:
    # The sink is one more column of the softmax, dropped before the values: it only adds to
    # the denominator. A row with no visible key puts all its weight there (exp(MASKED - sink)
    # underflows to 0).
    sink_BKGT1 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, G, 1, 1), (B, K, G, T, 1))
    with_sink_BKGTs = jnp.concatenate([logits_BKGTS, sink_BKGT1], axis=-1)
    p_BKGTS = jax.nn.softmax(with_sink_BKGTs, axis=-1)[..., :S]
    lse_BKGT = jax.nn.logsumexp(with_sink_BKGTs, axis=-1)
  out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", p_BKGTS, v.astype(jnp.float32))
  out_BTNH = out_BTKGH.reshape(B, T, N, H).astype(q.dtype)
  if not return_lse:
    return out_BTNH
  lse_BTN = jnp.transpose(lse_BKGT, (0, 3, 1, 2)).reshape(B, T, N)
  return out_BTNH, lse_BTN
