"""Ragged paged attention: every query of a serving step, on one token axis, over a paged pool.

A serving step computes prompt chunks and decode tokens of many sequences at once. Laid out as
vLLM v1 and tpu-inference lay them, every new token sits on one flat axis T, each sequence's run
contiguous, and per sequence b three numbers say where its queries are and what they see:

* `query_start[b]`: the index on T of its first new token;
* `query_len[b]`: how many new tokens it has (a prompt chunk, one decode token, a speculative
  round's k + 1; 0: a padding sequence);
* `kv_len[b]`: the tokens its pages hold, the new ones included (their K/V are written before
  attention), so its queries sit at positions kv_len - query_len .. kv_len - 1 (bottom-right
  alignment) and each is causal over everything before it.

The keys and values of sequence b live in the pages `block_tables[b]` names, read in place. Tokens
of T owned by no sequence are padding and get zeros. Sequences must occupy disjoint runs of T in
increasing order. Options: `sliding_window=W` (a query sees the W positions up to its own) and
`soft_cap=c` (scores pass through c * tanh(s / c) before the softmax, Gemma 2's logit capping)
and `sinks` f32[N] (a valueless softmax column per query head, gpt-oss's attention sinks; see
`kernels.reference`) and `attention_chunk=C` (Llama 4's chunked layers: a query sees only its
own chunk's positions, from q - q % C). Query blocks skip the pages wholly before their first
query's window or chunk.
8-bit pools (`kernels.quantized_kv`) come with `k_scale` and `v_scale`, a float32 scale per token
and kv head ([L, P, Z, K]; a latent pool's [L, P, Z, 1]): every path dequantizes a page as it
reads it, so only the 8-bit codes cross memory.

Pools: KV [L, P, Z, K, H] (or [P, Z, K, H] without a layer index), or MLA's latent pool
[L, P, Z, C + R] with `value_dim=C`: absorbed MLA is multi-query attention whose one kv head is
the latent, scored over all C + R dims and summed over its first C.

How the kernels walk it: the tokens of each sequence are cut into query blocks of `block_q`
tokens (`plan_blocks`), J blocks in all; a block holds the queries of one sequence, so it reads
one page list. Its queries (block_q tokens x the G heads of a kv head) are gathered from T before
the kernel and its output scattered back after it: copies the size of q, never of a page. Letters
here: J query blocks, X KV splits, Q query rows of a block (block_q x G, padded).

* "pallas" on a GPU (Triton): grid (J, K, X), flash decoding (`kernels.flash_decoding`): each
  program walks its split of the block's pages several at a time with an online softmax, loading
  only those pages from the pool in HBM; a second pass merges the splits by their log-sum-exp.
  Decode blocks (one token) fill the GPU through splits, prompt blocks through their number.
* "pallas" on a TPU (Mosaic): grid (J, page steps); the block table and the block plan are
  scalar-prefetched, and each step's pages are BlockSpecs whose index maps read the page ids, so
  Pallas's pipeline fetches the next pages while the current ones are scored. Steps outside a
  block's pages repeat the last page index (no new copy) and skip the compute.
* "xla": the same blocks as rows of `kernels.paged_attention.paged_attention_xla`, a loop over
  page steps in plain jnp: the default on CPU, and anywhere a compiled Pallas kernel is missing.

`ragged_paged_attention` dispatches: with `implementation=None`, Triton on CUDA, Mosaic on TPU,
"xla" elsewhere, chosen per lowering platform (`jax.lax.platform_dependent`), so a step lowered
for `tpu` or `cuda` on a CPU host holds the kernel it would run there.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import flash_decoding as fd
from .paged_attention import paged_attention_xla
from .quantized_kv import dequantize, is_quantized
from .reference import (
  attention_reference,
  cap_scores,
  check_attention_chunk,
  check_soft_cap_and_sinks,
)

Array = jax.Array
Implementation = Literal["pallas", "xla"]
Backend = Literal["triton", "mosaic"]

# Query rows a GPU program holds (block_q x G): enough to feed its matmuls, few enough that a
# decode block (one real token) wastes little of a memory-bound step.
GPU_BLOCK_ROWS = 64
# Pages a TPU grid step fetches and scores at once: 128 keys of 16-token pages, one full row of
# the vector unit's lanes for the scores.
TPU_PAGES_PER_STEP = 8


# -- the block plan -------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockPlan:
  """Each query block's sequence and place: J blocks, the trailing ones empty."""

  seq_J: Array  # i32[J] the sequence a block's queries belong to
  q0_J: Array  # i32[J] the index on T of its first query
  n_J: Array  # i32[J] its real queries (0: an empty block)
  pos0_J: Array  # i32[J] the position of its first query
  kv_len_J: Array  # i32[J] its sequence's tokens held


def _fit(block_q: int, max_query_len: int | None) -> int:
  """No block longer than the longest sequence's queries (a decode step's blocks hold one)."""
  return block_q if max_query_len is None else max(1, min(block_q, max_query_len))


def n_blocks(n_tokens: int, n_seqs: int, block_q: int, max_query_len: int | None) -> int:
  """J: the most query blocks T tokens of B sequences cut into (one per sequence when no
  sequence has more than `block_q` queries)."""
  if max_query_len is not None and max_query_len <= block_q:
    return n_seqs
  return -(-n_tokens // block_q) + n_seqs


def plan_blocks(
  query_start_B: Array, query_len_B: Array, kv_len_B: Array, *, block_q: int, n_blocks: int
) -> BlockPlan:
  """Cuts each sequence's queries into blocks of `block_q`, in order; blocks past the last
  sequence's are empty."""
  query_len_B = query_len_B.astype(jnp.int32)
  per_seq_B = -(-query_len_B // block_q)
  ends_B = jnp.cumsum(per_seq_B)
  j_J = jnp.arange(n_blocks, dtype=jnp.int32)
  seq_J = jnp.minimum(jnp.searchsorted(ends_B, j_J, side="right"), query_len_B.shape[0] - 1)
  seq_J = seq_J.astype(jnp.int32)
  first_J = (j_J - (ends_B - per_seq_B)[seq_J]) * block_q  # the block's offset in its sequence
  n_J = jnp.where(j_J < ends_B[-1], jnp.clip(query_len_B[seq_J] - first_J, 0, block_q), 0)
  kv_len_J = kv_len_B.astype(jnp.int32)[seq_J]
  return BlockPlan(
    seq_J=seq_J,
    q0_J=query_start_B.astype(jnp.int32)[seq_J] + first_J,
    n_J=n_J.astype(jnp.int32),
    pos0_J=kv_len_J - query_len_B[seq_J] + first_J,
    kv_len_J=kv_len_J,
  )


def _gather_queries(x_T_, plan: BlockPlan, block_q: int) -> Array:
  """[J, block_q, ...] each block's rows of x (past a block's queries: any row, discarded)."""
  index_JQ = plan.q0_J[:, None] + jnp.arange(block_q, dtype=jnp.int32)[None, :]
  return jnp.take(x_T_, jnp.clip(index_JQ, 0, x_T_.shape[0] - 1), axis=0)


def _scatter_outputs(out_JQ_: Array, plan: BlockPlan, n_tokens: int) -> Array:
  """[T, ...] each block's real rows at their tokens; zeros for padding tokens."""
  J, Qb = out_JQ_.shape[:2]
  row_JQ = jnp.arange(Qb, dtype=jnp.int32)[None, :]
  index_JQ = jnp.where(row_JQ < plan.n_J[:, None], plan.q0_J[:, None] + row_JQ, n_tokens)
  out = jnp.zeros((n_tokens, *out_JQ_.shape[2:]), out_JQ_.dtype)
  return out.at[index_JQ.reshape(-1)].set(out_JQ_.reshape(J * Qb, *out_JQ_.shape[2:]), mode="drop")


def _rows_of_blocks(q_TNH: Array, plan: BlockPlan, block_q: int, K: int, rows: int) -> Array:
  """[J, K, rows, H]: each block's queries as rows (token, head of the group) per kv head,
  padded to `rows`."""
  J, (N, H) = plan.n_J.shape[0], q_TNH.shape[1:]
  q_JQNH = _gather_queries(q_TNH, plan, block_q)
  q_JKQH = q_JQNH.reshape(J, block_q, K, N // K, H).transpose(0, 2, 1, 3, 4).reshape(J, K, -1, H)
  return jnp.pad(q_JKQH, ((0, 0), (0, 0), (0, rows - block_q * (N // K)), (0, 0)))


def _tokens_of_rows(out_JKQW: Array, plan: BlockPlan, block_q: int, N: int, T: int) -> Array:
  """[T, N, W]: `_rows_of_blocks`' inverse on the kernel's output, scattered to the tokens."""
  J, K, _, W = out_JKQW.shape
  G = N // K
  out_JKQW = out_JKQW[:, :, : block_q * G]
  out_JQNW = (
    out_JKQW.reshape(J, K, block_q, G, W).transpose(0, 2, 1, 3, 4).reshape(J, block_q, N, W)
  )
  return _scatter_outputs(out_JQNW, plan, T)


def _page_range(
  plan: BlockPlan, page_size: int, window: int | None, chunk: int | None = None
) -> tuple[Array, Array]:
  """(first, end) i32[J]: the pages a block's queries can see, [first, end)."""
  last_J = plan.pos0_J + plan.n_J - 1
  end_J = jnp.where(plan.n_J > 0, last_J // page_size + 1, 0)
  first_J = jnp.broadcast_to(_first_key(plan.pos0_J, window, chunk) // page_size, end_J.shape)
  return first_J.astype(end_J.dtype), end_J


def _first_key(pos0, window: int | None, chunk: int | None):
  """The first key position a block whose first query sits at `pos0` (>= 0) can see: the later
  of its window's start and its chunk's (0 without either)."""
  first = 0 if window is None else jnp.maximum(pos0 - window + 1, 0)
  if chunk is not None:
    first = jnp.maximum(first, jax.lax.div(pos0, jnp.int32(chunk)) * chunk)
  return first


def _chunk_seen(kpos, qpos, chunk: int):
  """Whether key position `kpos` lies in the chunk of query position `qpos` (both >= 0, and
  kpos <= qpos already required): div, not the remainder, which Mosaic lowers for vectors."""
  return kpos >= jax.lax.div(qpos, jnp.int32(chunk)) * chunk


# -- checks ---------------------------------------------------------------------------------------


def check_inputs(
  q,
  k_pages,
  v_pages,
  block_tables,
  query_start,
  query_len,
  kv_len,
  *,
  layer,
  value_dim,
  k_scale=None,
  v_scale=None,
):
  """Raises ValueError naming the shapes when the inputs do not fit together."""
  shapes = (
    f"q.shape={tuple(q.shape)} k_pages.shape={tuple(k_pages.shape)} "
    f"v_pages.shape={None if v_pages is None else tuple(v_pages.shape)} "
    f"block_tables.shape={tuple(block_tables.shape)} query_start.shape="
    f"{tuple(query_start.shape)} query_len.shape={tuple(query_len.shape)} "
    f"kv_len.shape={tuple(kv_len.shape)} layer={'None' if layer is None else 'given'}"
  )
  fail = lambda why: ValueError(f"ragged_paged_attention: {why}; {shapes}")
  if q.ndim != 3:
    raise fail("q must be [T, N, H]")
  lead = 0 if layer is None else 1
  if layer is not None and jnp.shape(layer) != ():
    raise fail("layer must be a scalar")
  if v_pages is None:  # latent pages
    if value_dim is None or k_pages.ndim != 3 + lead:
      raise fail("latent pages need k_pages [(L,) P, Z, C + R], v_pages=None and value_dim=C")
    if not 0 < value_dim <= k_pages.shape[-1]:
      raise fail(f"value_dim={value_dim} must be in [1, {k_pages.shape[-1]}]")
  else:
    if value_dim is not None:
      raise fail("value_dim is for latent pages (v_pages=None)")
    if k_pages.ndim != 4 + lead or k_pages.shape != v_pages.shape:
      want = "[P, Z, K, H]" if layer is None else "[L, P, Z, K, H] (with a layer index)"
      raise fail(f"k_pages and v_pages must both be {want}")
    if q.shape[1] % k_pages.shape[-2]:
      raise fail(f"query heads N={q.shape[1]} must be a multiple of kv heads K={k_pages.shape[-2]}")
  if q.shape[-1] != k_pages.shape[-1]:
    raise fail(f"the query's head dim {q.shape[-1]} != the pages' {k_pages.shape[-1]}")
  B = block_tables.shape[0]
  if block_tables.ndim != 2 or any(x.shape != (B,) for x in (query_start, query_len, kv_len)):
    raise fail(f"need block_tables [B, M] and query_start, query_len, kv_len [B] with B={B}")
  for name, x in (
    ("block_tables", block_tables),
    ("query_start", query_start),
    ("query_len", query_len),
    ("kv_len", kv_len),
  ):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise fail(f"{name} must be integer, got {x.dtype}")
  if k_scale is None:
    if v_scale is not None:
      raise fail("v_scale needs k_scale")
    if q.dtype != k_pages.dtype or (v_pages is not None and v_pages.dtype != q.dtype):
      raise fail(f"q and the pages must share a dtype, got {q.dtype} and {k_pages.dtype}")
    return
  want = k_pages.shape[:-1] + ((1,) if v_pages is None else ())
  if k_scale.shape != want or (v_pages is not None and getattr(v_scale, "shape", None) != want):
    raise fail(
      f"k_scale{'' if v_pages is None else ' and v_scale'} must be {want} (a scale per token "
      f"and kv head), got {tuple(k_scale.shape)}"
      + ("" if v_pages is None else f" and {None if v_scale is None else tuple(v_scale.shape)}")
    )
  if v_pages is None and v_scale is not None:
    raise fail("latent pages take k_scale only")
  if not is_quantized(k_pages.dtype) or (v_pages is not None and v_pages.dtype != k_pages.dtype):
    raise fail(f"scaled pages must be int8 or float8_e4m3fn, got {k_pages.dtype}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise fail(f"q must be floating, got {q.dtype}")


def _check_options(sliding_window, soft_cap, sinks=None, n_heads=None, attention_chunk=None):
  check_attention_chunk("ragged_paged_attention", attention_chunk)
  if sliding_window is not None and (
    isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
  ):
    raise ValueError(
      f"ragged_paged_attention: sliding_window={sliding_window!r} must be a positive int or None"
    )
  if soft_cap is not None and not (
    isinstance(soft_cap, (int, float)) and not isinstance(soft_cap, bool) and soft_cap > 0
  ):
    raise ValueError(f"ragged_paged_attention: soft_cap={soft_cap!r} must be > 0 or None")
  check_soft_cap_and_sinks("ragged_paged_attention", soft_cap, sinks, n_heads)


def _stacked(k_pages, v_pages, layer):
  """The pools with a layer axis, and the layer index (a free reshape for one layer)."""
  if layer is None:
    return k_pages[None], None if v_pages is None else v_pages[None], jnp.int32(0)
  return k_pages, v_pages, jnp.asarray(layer, jnp.int32)


# -- the reference --------------------------------------------------------------------------------


@functools.partial(
  jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "value_dim", "attention_chunk")
)
def ragged_paged_attention_reference(
  q: Array,
  k_pages: Array,
  v_pages: Array | None,
  block_tables: Array,
  query_start: Array,
  query_len: Array,
  kv_len: Array,
  *,
  layer: Array | None = None,
  scale: float | None = None,
  sliding_window: int | None = None,
  soft_cap: float | None = None,
  value_dim: int | None = None,
  k_scale: Array | None = None,
  v_scale: Array | None = None,
  sinks: Array | None = None,
  attention_chunk: int | None = None,
) -> Array:
  """Pure jnp: every sequence's pages gathered into dense K/V, each token attending to its own
  sequence's as `attention_reference` does (8-bit pools dequantized whole first). Memory grows
  with T x the table's capacity: for tests."""
  check_inputs(
    q,
    k_pages,
    v_pages,
    block_tables,
    query_start,
    query_len,
    kv_len,
    layer=layer,
    value_dim=value_dim,
    k_scale=k_scale,
    v_scale=v_scale,
  )
  _check_options(sliding_window, soft_cap, sinks, q.shape[1], attention_chunk)
  if k_scale is not None:
    if v_pages is None:
      k_pages = dequantize(k_pages, k_scale[..., 0], q.dtype)
    else:
      k_pages, v_pages = (
        dequantize(k_pages, k_scale, q.dtype),
        dequantize(v_pages, v_scale, q.dtype),
      )
  k_pages, v_pages, layer = _stacked(k_pages, v_pages, layer)
  latent = v_pages is None
  if latent:  # one kv head: the latent is both key and value
    k_pages = v_pages = k_pages[..., None, :]
  T, N, H = q.shape
  B, M = block_tables.shape
  Z, K = k_pages.shape[2], k_pages.shape[3]
  t_T = jnp.arange(T, dtype=jnp.int32)
  start_B, qlen_B, kvlen_B = (x.astype(jnp.int32) for x in (query_start, query_len, kv_len))
  owns_TB = (t_T[:, None] >= start_B[None]) & (t_T[:, None] < (start_B + qlen_B)[None])
  owned_T = owns_TB.any(axis=1)
  seq_T = jnp.argmax(owns_TB, axis=1)
  pos_T = jnp.where(owned_T, (kvlen_B - qlen_B - start_B)[seq_T] + t_T, 0)
  dense = lambda pool: pool[layer, block_tables].reshape(B, M * Z, K, -1)  # [B, S, K, H]
  valid_BS11 = (jnp.arange(M * Z)[None] < kvlen_B[:, None])[:, :, None, None]
  k_BSKH = jnp.where(valid_BS11, dense(k_pages), 0)[seq_T]  # [T, S, K, H]
  v_BSKH = jnp.where(valid_BS11, dense(v_pages), 0)[seq_T]
  out = attention_reference(
    q[:, None],
    k_BSKH,
    v_BSKH,
    causal=True,
    scale=H**-0.5 if scale is None else scale,
    sliding_window=sliding_window,
    q_positions=pos_T[:, None],
    kv_lengths=kvlen_B[seq_T],
    soft_cap=None if soft_cap is None else float(soft_cap),
    sinks=sinks,
    attention_chunk=attention_chunk,
  )[:, 0]
  out = jnp.where(owned_T[:, None, None], out, 0)
  return out[..., :value_dim] if latent else out


# -- XLA: the blocks as rows of the paged loop ----------------------------------------------------


def ragged_paged_attention_xla(
  q: Array,
  k_pages: Array,
  v_pages: Array | None,
  block_tables: Array,
  query_start: Array,
  query_len: Array,
  kv_len: Array,
  *,
  layer: Array | None = None,
  scale: float | None = None,
  sliding_window: int | None = None,
  soft_cap: float | None = None,
  value_dim: int | None = None,
  block_q: int | None = None,
  max_query_len: int | None = None,
  keys_per_step: int | None = None,
  k_scale: Array | None = None,
  v_scale: Array | None = None,
  sinks: Array | None = None,
  attention_chunk: int | None = None,
) -> Array:
  """Each query block a row of `paged_attention_xla` (a loop over page steps, as many as the
  longest block needs), its queries at their positions. `block_q` defaults to 16 tokens;
  `keys_per_step` is the loop's (its default when None)."""
  check_inputs(
    q,
    k_pages,
    v_pages,
    block_tables,
    query_start,
    query_len,
    kv_len,
    layer=layer,
    value_dim=value_dim,
    k_scale=k_scale,
    v_scale=v_scale,
  )
  _check_options(sliding_window, soft_cap, sinks, q.shape[1], attention_chunk)
  latent = v_pages is None
  if latent:  # a free reshape: one kv head, the latent as key and value
    k_pages = v_pages = k_pages[..., None, :]
    v_scale = k_scale
  T = q.shape[0]
  block_q = _fit(16 if block_q is None else block_q, max_query_len)
  J = n_blocks(T, block_tables.shape[0], block_q, max_query_len)
  plan = plan_blocks(query_start, query_len, kv_len, block_q=block_q, n_blocks=J)
  q_JQNH = _gather_queries(q, plan, block_q)
  row_Q = jnp.arange(block_q, dtype=jnp.int32)
  positions_JQ = jnp.where(row_Q[None] < plan.n_J[:, None], plan.pos0_J[:, None] + row_Q, -1)
  out_JQNH = paged_attention_xla(
    q_JQNH,
    k_pages,
    v_pages,
    block_tables[plan.seq_J],
    plan.kv_len_J,
    layer=layer,
    scale=scale,
    q_positions=positions_JQ,
    keys_per_step=keys_per_step,
    sliding_window=sliding_window,
    soft_cap=soft_cap,
    sinks=sinks,
    k_scale=k_scale,
    v_scale=v_scale,
    **({} if attention_chunk is None else {"attention_chunk": attention_chunk}),
  )
  out_TNH = _scatter_outputs(out_JQNH, plan, T)
  return out_TNH[..., :value_dim] if latent else out_TNH


# -- Pallas on a GPU (Triton) ---------------------------------------------------------------------


def _scores(q_parts, k_parts, *, scale, soft_cap):
  """f32[Q, Z] of the query parts against the key parts (one pair, or the latent's two)."""
  s_QZ = sum(fd.scores(q, k) for q, k in zip(q_parts, k_parts)) * jnp.float32(scale)
  return cap_scores(s_QZ, soft_cap)


def _ragged_gpu_kernel(
  pos0_ref,  # i32[J] the position of each block's first query
  n_ref,  # i32[J] its real queries
  kv_len_ref,  # i32[J] its sequence's tokens held
  layer_ref,  # i32[1]
  table_ref,  # i32[M]: this block's sequence's pages
  *refs,
  scale: float,
  group: int,
  window: int | None,
  soft_cap: float | None,
  latent_dim: int | None,
  pages_per_split: int,
  pages_per_step: int,
  scaled: bool,
  chunk: int | None = None,
):
  # GQA: q [Q, H], k and v [L, P, Z, H] (this kv head's slice of the pools); latent: q's two
  # parts [Q, C] and [Q, R], the pool [L, P, Z, C + R]. 8-bit pools: then their scales
  # f32[L, P, Z] (k's, and v's for GQA). Then o f32[Q, Hv], lse f32[Q, 1].
  n_q = 1 if latent_dim is None else 2
  n_pools = 1 if latent_dim is not None else 2
  q_refs, pool_refs = refs[:n_q], refs[n_q : n_q + n_pools]
  scale_refs = refs[n_q + n_pools : n_q + 2 * n_pools] if scaled else (None,) * n_pools
  o_ref, lse_ref = refs[-2:]
  q_parts = tuple(r[...] for r in q_refs)
  k_ref, ks_ref = pool_refs[0], scale_refs[0]

  def read(pool_ref, scale_ref, layer, page):
    x_ZH = pool_ref[layer, page]
    if scale_ref is None:
      return x_ZH
    return (x_ZH.astype(jnp.float32) * scale_ref[layer, page][:, None]).astype(q_parts[0].dtype)

  j = pl.program_id(0)
  pos0, n, kv_len, layer = pos0_ref[j], n_ref[j], kv_len_ref[j], layer_ref[0]
  Z = k_ref.shape[2]
  Q = q_parts[0].shape[0]
  qpos_Q1 = pos0 + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (Q, 1), 0), group)
  offsets_1Z = jax.lax.broadcasted_iota(jnp.int32, (1, Z), 1)
  offsets_Z1 = jax.lax.broadcasted_iota(jnp.int32, (Z, 1), 0)
  end = jnp.where(n > 0, (pos0 + n - 1) // Z + 1, 0)
  first = _first_key(pos0, window, chunk) // Z
  lo = jnp.maximum(pl.program_id(2) * pages_per_split, first)
  hi = jnp.minimum((pl.program_id(2) + 1) * pages_per_split, end)
  n_steps = (jnp.maximum(hi - lo, 0) + pages_per_step - 1) // pages_per_step

  def body(step, state):
    scores, values = [], []
    for jj in range(pages_per_step):
      i = lo + step * pages_per_step + jj
      inside = i < hi
      page = table_ref[jnp.minimum(i, hi - 1)]  # past the split: a held page, masked whole
      if latent_dim is None:
        k_parts = (read(k_ref, ks_ref, layer, page),)
        v_ZH = read(pool_refs[1], scale_refs[1], layer, page)
      else:
        C, R = latent_dim, q_parts[1].shape[1]
        k_parts = (k_ref[layer, page, :, pl.ds(0, C)], k_ref[layer, page, :, pl.ds(C, R)])
        if ks_ref is not None:
          s_Z1 = ks_ref[layer, page][:, None]
          k_parts = tuple((x.astype(jnp.float32) * s_Z1).astype(q_parts[0].dtype) for x in k_parts)
        v_ZH = k_parts[0]
      kpos_1Z = i * Z + offsets_1Z
      seen_QZ = (kpos_1Z <= qpos_Q1) & inside
      if window is not None:
        seen_QZ &= kpos_1Z > qpos_Q1 - window
      if chunk is not None:
        seen_QZ &= _chunk_seen(kpos_1Z, qpos_Q1, chunk)
      s_QZ = _scores(q_parts, k_parts, scale=scale, soft_cap=soft_cap)
      scores.append(jnp.where(seen_QZ, s_QZ, -jnp.inf))
      # Slots past the tokens held may hold NaN, and 0 * NaN = NaN: zero those value rows.
      held_Z1 = (i * Z + offsets_Z1 < kv_len) & inside
      values.append(jnp.where(held_Z1, v_ZH, jnp.zeros((), v_ZH.dtype)))
    return fd.fold_pages(state, scores, values)

  width = o_ref.shape[-1]
  state = jax.lax.fori_loop(0, n_steps, body, fd.init_state(Q, width))
  o_ref[...], lse_ref[...] = fd.finish(state)


def _pow2_rows(n: int) -> int:
  # Triton's matmul tiles want a power-of-two M of at least 16; padded rows are discarded.
  return max(16, 1 << max(n - 1, 0).bit_length())


def _gpu_block_q(group: int) -> int:
  return max(1, GPU_BLOCK_ROWS // group)


def _ragged_triton(
  q,
  k_pages,
  v_pages,
  block_tables,
  plan,
  T,
  *,
  k_scale,
  v_scale,
  layer,
  scale,
  window,
  soft_cap,
  value_dim,
  block_q,
  num_splits,
  pages_per_step,
  interpret,
  sinks,
  chunk,
):
  latent = v_pages is None
  L, P, Z = k_pages.shape[:3]
  N, H = q.shape[1:]
  K = 1 if latent else k_pages.shape[3]
  G = N // K
  M = block_tables.shape[1]
  J = plan.n_J.shape[0]
  X, per_split, per_step = fd.plan_splits(
    "ragged_paged_attention",
    programs=J * K,
    max_blocks=M,
    page_size=Z,
    num_splits=num_splits,
    pages_per_step=pages_per_step,
  )
  # Rows (token, head of the group): [J, K, block_q * G, H], padded to a tile.
  Q = _pow2_rows(block_q * G)
  q_JKQH = _rows_of_blocks(q, plan, block_q, K, Q)
  Hv = value_dim if latent else H
  kernel = functools.partial(
    _ragged_gpu_kernel,
    scale=scale,
    group=G,
    window=window,
    soft_cap=soft_cap,
    latent_dim=value_dim,
    pages_per_split=per_split,
    pages_per_step=per_step,
    scaled=k_scale is not None,
    chunk=chunk,
  )
  whole = lambda n: pl.BlockSpec((n,), lambda j, h, x: (0,))
  rows = lambda w: pl.BlockSpec((None, None, Q, w), lambda j, h, x: (j, h, 0, 0))
  if latent:
    C = value_dim
    q_specs = [rows(C), rows(H - C)]
    q_args = [q_JKQH[..., :C], q_JKQH[..., C:]]
    pool_specs = [pl.BlockSpec((L, P, Z, H), lambda j, h, x: (0, 0, 0, 0))]
    pool_args = [k_pages]
    scale_args = [k_scale]
  else:
    q_specs, q_args = [rows(H)], [q_JKQH]
    head = pl.BlockSpec((L, P, Z, None, H), lambda j, h, x: (0, 0, 0, h, 0))
    pool_specs, pool_args = [head, head], [k_pages, v_pages]
    scale_args = [k_scale, v_scale]
  if k_scale is not None:  # [L, P, Z, K]: this kv head's (a latent pool's one) column
    head_scale = pl.BlockSpec((L, P, Z, None), lambda j, h, x: (0, 0, 0, h))
    pool_specs += [head_scale] * len(scale_args)
    pool_args += scale_args
  part = lambda w: pl.BlockSpec((None, None, None, Q, w), lambda j, h, x: (j, h, x, 0, 0))
  out_JKXQH, lse_JKXQ1 = pl.pallas_call(
    kernel,
    grid=(J, K, X),
    in_specs=[
      whole(J),
      whole(J),
      whole(J),
      whole(1),
      pl.BlockSpec((None, M), lambda j, h, x: (j, 0)),
      *q_specs,
      *pool_specs,
    ],
    out_specs=[part(Hv), part(1)],
    out_shape=[
      jax.ShapeDtypeStruct((J, K, X, Q, Hv), jnp.float32),
      jax.ShapeDtypeStruct((J, K, X, Q, 1), jnp.float32),
    ],
    compiler_params=fd.compiler_params(interpret, num_warps=4),
    interpret=interpret,
    name="ragged_paged_attention",
  )(
    plan.pos0_J,
    plan.n_J,
    plan.kv_len_J,
    jnp.reshape(layer, (1,)),
    block_tables.astype(jnp.int32)[plan.seq_J],
    *q_args,
    *pool_args,
  )
  # The sinks join in the merge of the splits, counted once per row (`fd.combine_splits`).
  sink_KQ1 = None if sinks is None else fd.sink_rows(sinks, K, block_q, Q)
  out_JKQH = fd.combine_splits(out_JKXQH, lse_JKXQ1, axis=2, dtype=q.dtype, sink_Q1=sink_KQ1)
  return _tokens_of_rows(out_JKQH, plan, block_q, N, T)


# -- Pallas on a TPU (Mosaic) ---------------------------------------------------------------------


def _ragged_tpu_kernel(
  # scalar prefetch (SMEM)
  pos0_ref,  # i32[J]
  n_ref,  # i32[J]
  kv_len_ref,  # i32[J]
  first_ref,  # i32[J] the first page a block's queries see
  end_ref,  # i32[J] one past the last
  table_ref,  # i32[J * M] each block's sequence's pages (read by the index maps)
  layer_ref,  # i32[1] (read by the index maps)
  # blocks (VMEM)
  *refs,
  scale: float,
  group: int,
  window: int | None,
  soft_cap: float | None,
  latent_dim: int | None,
  pages_per_step: int,
  kv_heads: int,
  scaled: bool,
  has_sinks: bool,
  chunk: int | None = None,
):
  # q [K, Q, H]; with sinks, f32[K, Q, 1] each row's sink logit; pages_per_step key pages
  # [Z, K, H] (latent: [Z, C + R]) and as many value pages (GQA only); 8-bit pools: then as many
  # key (and value) scale pages f32[Z, K] (latent: [Z, 1]); o [K, Q, Hv]; scratch m, l
  # f32[K, Q, 1], acc f32[K, Q, Hv].
  del table_ref, layer_ref
  n_pools = 1 if latent_dim is not None else 2
  n_pages = n_pools * pages_per_step * (2 if scaled else 1)
  q_ref, refs = refs[0], refs[1:]
  sink_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
  pages, (o_ref, m_ref, l_ref, acc_ref) = refs[:n_pages], refs[n_pages:]
  runs = [
    pages[i * pages_per_step : (i + 1) * pages_per_step]
    for i in range(len(pages) // pages_per_step)
  ]
  k_refs, v_refs = runs[0], (None if latent_dim is not None else runs[1])
  ks_refs, vs_refs = (runs[n_pools], runs[-1]) if scaled else (None, None)

  def dequant(x_CH, scale_refs, h):
    if scale_refs is None:
      return x_CH
    s_C1 = jnp.concatenate([r[:, h : h + 1] for r in scale_refs], axis=0)
    return (x_CH.astype(jnp.float32) * s_C1).astype(q_ref.dtype)

  del n_ref  # a block's rows past its queries are computed and discarded
  j, step = pl.program_id(0), pl.program_id(1)
  pos0, kv_len = pos0_ref[j], kv_len_ref[j]
  lo, hi = first_ref[j], end_ref[j]
  Z = k_refs[0].shape[0]
  Q = q_ref.shape[1]
  C = pages_per_step * Z

  @pl.when(step == 0)
  def _():
    if sink_ref is None:
      m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
      l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    else:  # the sink column first: m = sink, l = exp(sink - m) = 1, and no value
      m_ref[...] = sink_ref[...]
      l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  first_page = step * pages_per_step

  @pl.when((first_page < hi) & (first_page + pages_per_step > lo))
  def _():
    qpos_Q1 = pos0 + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (Q, 1), 0), group)
    page_1C = first_page + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (1, C), 1), Z)
    kpos_1C = first_page * Z + jax.lax.broadcasted_iota(jnp.int32, (1, C), 1)
    seen_QC = (kpos_1C <= qpos_Q1) & (page_1C >= lo) & (page_1C < hi)
    if window is not None:
      seen_QC &= kpos_1C > qpos_Q1 - window
    if chunk is not None:
      seen_QC &= _chunk_seen(kpos_1C, qpos_Q1, chunk)
    kpos_C1 = first_page * Z + jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    held_C1 = kpos_C1 < kv_len
    for h in range(kv_heads):
      if latent_dim is None:
        k_CH = dequant(jnp.concatenate([r[:, h, :] for r in k_refs], axis=0), ks_refs, h)
        v_CH = dequant(jnp.concatenate([r[:, h, :] for r in v_refs], axis=0), vs_refs, h)
      else:
        k_CH = dequant(jnp.concatenate([r[...] for r in k_refs], axis=0), ks_refs, 0)
        v_CH = k_CH[:, :latent_dim]
      s_QC = _scores((q_ref[h],), (k_CH,), scale=scale, soft_cap=soft_cap)
      s_QC = jnp.where(seen_QC, s_QC, -jnp.inf)
      # Slots past the tokens held may hold NaN, and 0 * NaN = NaN: zero those value rows.
      v_CH = jnp.where(held_C1, v_CH, jnp.zeros((), v_CH.dtype))
      m_Q1, l_Q1, acc_QW = fd.fold_pages((m_ref[h], l_ref[h], acc_ref[h]), [s_QC], [v_CH])
      m_ref[h], l_ref[h], acc_ref[h] = m_Q1, l_Q1, acc_QW

  @pl.when(step == pl.num_programs(1) - 1)
  def _():
    l_KQ1 = l_ref[...]
    out_KQW = jnp.where(l_KQ1 > 0, acc_ref[...] / jnp.where(l_KQ1 > 0, l_KQ1, 1.0), 0.0)
    o_ref[...] = out_KQW.astype(o_ref.dtype)


def _ragged_mosaic(
  q,
  k_pages,
  v_pages,
  block_tables,
  plan,
  T,
  *,
  k_scale,
  v_scale,
  layer,
  scale,
  window,
  soft_cap,
  value_dim,
  block_q,
  pages_per_step,
  interpret,
  sinks,
  chunk,
):
  from jax.experimental.pallas import tpu as pltpu

  latent = v_pages is None
  L, P, Z = k_pages.shape[:3]
  N, H = q.shape[1:]
  K = 1 if latent else k_pages.shape[3]
  G = N // K
  M = block_tables.shape[1]
  J = plan.n_J.shape[0]
  per_step = min(pages_per_step or TPU_PAGES_PER_STEP, M)
  n_steps = -(-M // per_step)
  Q = -(-block_q * G // 8) * 8  # rows fill whole sublanes
  q_JKQH = _rows_of_blocks(q, plan, block_q, K, Q)
  first_J, end_J = _page_range(plan, Z, window, chunk)
  Hv = value_dim if latent else H

  def page_map(jj, rank):
    def index(j, step, pos0, n, kv_len, first, end, table, layer):
      # Steps outside the block's pages repeat a page it reads: no new copy is issued.
      i = jnp.clip(step * per_step + jj, first[j], jnp.maximum(end[j] - 1, first[j]))
      page = table[j * M + jnp.minimum(i, M - 1)]
      return (layer[0], page) + (0,) * (rank - 2)

    return index

  def run(pool):  # per_step page specs of one pool array, and the array per spec
    block = (None, None, *pool.shape[2:])
    return [pl.BlockSpec(block, page_map(jj, pool.ndim)) for jj in range(per_step)], [
      pool
    ] * per_step

  pools = [k_pages] if latent else [k_pages, v_pages]
  if k_scale is not None:  # the scales [L, P, Z, K] (latent: [L, P, Z, 1]) page by page
    pools += [k_scale] if latent else [k_scale, v_scale]
  page_specs, pool_args = [], []
  for pool in pools:
    specs, args = run(pool)
    page_specs += specs
    pool_args += args
  rows = pl.BlockSpec((None, K, Q, H), lambda j, step, *_: (j, 0, 0, 0))
  out_rows = pl.BlockSpec((None, K, Q, Hv), lambda j, step, *_: (j, 0, 0, 0))
  kernel = functools.partial(
    _ragged_tpu_kernel,
    scale=scale,
    group=G,
    window=window,
    soft_cap=soft_cap,
    latent_dim=value_dim,
    pages_per_step=per_step,
    kv_heads=K,
    scaled=k_scale is not None,
    has_sinks=sinks is not None,
    chunk=chunk,
  )
  sink_specs, sink_args = [], []
  if sinks is not None:
    sink_specs = [pl.BlockSpec((K, Q, 1), lambda j, step, *_: (0, 0, 0))]
    sink_args = [fd.sink_rows(sinks, K, block_q, Q)]
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=7,
    grid=(J, n_steps),
    in_specs=[rows, *sink_specs, *page_specs],
    out_specs=out_rows,
    scratch_shapes=[
      pltpu.VMEM((K, Q, 1), jnp.float32),
      pltpu.VMEM((K, Q, 1), jnp.float32),
      pltpu.VMEM((K, Q, Hv), jnp.float32),
    ],
  )
  out_JKQH = pl.pallas_call(
    kernel,
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct((J, K, Q, Hv), q.dtype),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    interpret=interpret,
    name="ragged_paged_attention",
  )(
    plan.pos0_J,
    plan.n_J,
    plan.kv_len_J,
    first_J,
    end_J,
    block_tables.astype(jnp.int32)[plan.seq_J].reshape(-1),
    jnp.reshape(layer, (1,)),
    q_JKQH,
    *sink_args,
    *pool_args,
  )
  return _tokens_of_rows(out_JKQH, plan, block_q, N, T)


@functools.partial(
  jax.jit,
  static_argnames=(
    "scale",
    "sliding_window",
    "soft_cap",
    "value_dim",
    "backend",
    "block_q",
    "max_query_len",
    "num_splits",
    "pages_per_step",
    "interpret",
    "attention_chunk",
  ),
)
def ragged_paged_attention_pallas(
  q: Array,
  k_pages: Array,
  v_pages: Array | None,
  block_tables: Array,
  query_start: Array,
  query_len: Array,
  kv_len: Array,
  *,
  layer: Array | None = None,
  scale: float | None = None,
  sliding_window: int | None = None,
  soft_cap: float | None = None,
  value_dim: int | None = None,
  backend: Backend = "triton",
  block_q: int | None = None,
  max_query_len: int | None = None,
  num_splits: int | None = None,
  pages_per_step: int | None = None,
  interpret: bool = False,
  k_scale: Array | None = None,
  v_scale: Array | None = None,
  sinks: Array | None = None,
  attention_chunk: int | None = None,
) -> Array:
  """The Pallas kernels; see `ragged_paged_attention`. `backend` "triton" (GPU) or "mosaic"
  (TPU); `interpret` runs either on any backend."""
  check_inputs(
    q,
    k_pages,
    v_pages,
    block_tables,
    query_start,
    query_len,
    kv_len,
    layer=layer,
    value_dim=value_dim,
    k_scale=k_scale,
    v_scale=v_scale,
  )
  _check_options(sliding_window, soft_cap, sinks, q.shape[1], attention_chunk)
  if backend not in ("triton", "mosaic"):
    raise ValueError(f"ragged_paged_attention: backend={backend!r} is not 'triton' or 'mosaic'")
  fd.check_positive_or_none("ragged_paged_attention", "block_q", block_q)
  if k_scale is not None and layer is None:
    k_scale, v_scale = k_scale[None], None if v_scale is None else v_scale[None]
  k_pages, v_pages, layer = _stacked(k_pages, v_pages, layer)
  T, N, H = q.shape
  group = N if v_pages is None else N // k_pages.shape[3]
  block_q = _fit(_gpu_block_q(group) if block_q is None else block_q, max_query_len)
  J = n_blocks(T, block_tables.shape[0], block_q, max_query_len)
  plan = plan_blocks(query_start, query_len, kv_len, block_q=block_q, n_blocks=J)
  scale = H**-0.5 if scale is None else scale
  common = dict(
    layer=layer,
    scale=scale,
    window=sliding_window,
    soft_cap=soft_cap,
    value_dim=value_dim,
    block_q=block_q,
    pages_per_step=pages_per_step,
    interpret=interpret,
    k_scale=k_scale,
    v_scale=v_scale,
    sinks=sinks,
    chunk=attention_chunk,
  )
  if backend == "mosaic":
    return _ragged_mosaic(q, k_pages, v_pages, block_tables, plan, T, **common)
  return _ragged_triton(q, k_pages, v_pages, block_tables, plan, T, num_splits=num_splits, **common)


# -- the dispatcher -------------------------------------------------------------------------------


def ragged_paged_attention(
  q: Array,
  k_pages: Array,
  v_pages: Array | None,
  block_tables: Array,
  query_start: Array,
  query_len: Array,
  kv_len: Array,
  *,
  layer: Array | None = None,
  scale: float | None = None,
  sliding_window: int | None = None,
  soft_cap: float | None = None,
  value_dim: int | None = None,
  implementation: Implementation | None = None,
  interpret: bool | None = None,
  max_query_len: int | None = None,
  keys_per_step: int | None = None,
  block_q: int | None = None,
  k_scale: Array | None = None,
  v_scale: Array | None = None,
  sinks: Array | None = None,
  attention_chunk: int | None = None,
) -> Array:
  """Attention of a step's ragged queries over their sequences' pages.

  Args:
    q: [T, N, H] every new token's query heads, each sequence's run contiguous (latent pages:
      [T, N, C + R], the absorbed query).
    k_pages: [L, P, Z, K, H] the key pool with `layer`, or [P, Z, K, H]; latent pages:
      [(L,) P, Z, C + R].
    v_pages: the value pool, shaped as `k_pages`; None for latent pages.
    block_tables: i32[B, M] each sequence's pages, in order.
    query_start, query_len, kv_len: i32[B] where each sequence's new tokens start on T, how many
      there are (0: a padding sequence), and the tokens its pages hold with them.
    layer: i32[] the layer of stacked pools, or None.
    scale: the softmax scale, default H ** -0.5.
    sliding_window: W, a query sees positions (pos - W, pos]; None: all before it.
    soft_cap: scores capped as c * tanh(s / c); None: not capped.
    sinks: f32[N] one sink logit per query head, a softmax column with no value
      (`kernels.reference`); None: no sink.
    value_dim: C, for latent pages: the output sums the first C dims of the latent.
    implementation: "pallas" (Triton on a GPU, Mosaic on a TPU; interpret mode on a CPU),
      "xla" (`ragged_paged_attention_xla`), or None: per lowering platform, the Pallas kernel on
      CUDA and TPU, "xla" elsewhere.
    interpret: with "pallas", run in interpret mode (default: on a CPU).
    max_query_len: the most queries any sequence has, when the caller knows (static): one query
      block per sequence when it fits one.
    keys_per_step: the "xla" loop's keys per iteration (None: its default).
    block_q: tokens per query block (None: per implementation).
    k_scale, v_scale: f32[(L,) P, Z, K] for 8-bit pools (`kernels.quantized_kv`): a scale per
      token and kv head; a latent pool's k_scale is [(L,) P, Z, 1] and v_scale None.
    attention_chunk: C, a query sees only its own chunk's positions, from q - q % C (pages
      wholly before a block's first query's chunk are never read); None: no chunks.

  Returns:
    [T, N, H], or [T, N, C] for latent pages; zeros for padding tokens.
  """
  if implementation not in (None, "pallas", "xla"):
    raise ValueError(
      f"ragged_paged_attention: implementation={implementation!r} is not one of 'pallas', "
      "'xla', None"
    )
  args = (q, k_pages, v_pages, block_tables, query_start, query_len, kv_len)
  options = dict(
    layer=layer,
    scale=scale,
    sliding_window=sliding_window,
    soft_cap=soft_cap,
    value_dim=value_dim,
    max_query_len=max_query_len,
    k_scale=k_scale,
    v_scale=v_scale,
    sinks=sinks,
  )
  if attention_chunk is not None:
    options["attention_chunk"] = attention_chunk
  xla = functools.partial(
    ragged_paged_attention_xla, keys_per_step=keys_per_step, block_q=block_q, **options
  )
  pallas = lambda backend, interpret: functools.partial(
    ragged_paged_attention_pallas, backend=backend, block_q=block_q, interpret=interpret, **options
  )
  if implementation == "xla":
    return xla(*args)
  if implementation == "pallas":
    on_cpu = jax.default_backend() == "cpu"
    interpret = on_cpu if interpret is None else interpret
    backend = "mosaic" if jax.default_backend() == "tpu" else "triton"
    return pallas(backend, interpret)(*args)
  return jax.lax.platform_dependent(
    *args, cuda=pallas("triton", False), tpu=pallas("mosaic", False), default=xla
  )
