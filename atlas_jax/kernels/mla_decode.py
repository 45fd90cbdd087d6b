"""MLA decode: a few new queries per sequence against the latent cache, up-projections absorbed.

With DeepSeek's Multi-head Latent Attention the cache holds, per token, one latent c [C] and one
RoPE key k_rope [R] shared by all heads. Folding the key up-projection into the query
(q_nope @ W_UK^T, done by the caller) turns every head's score into a dot product with the latent,

    score[n, s] = (q_nope[n] . c[s] + q_rope[n] . k_rope[s]) * scale,

and the output of every head is the attention-weighted latent sum_s p[n, s] c[s] [C], which the
caller maps back with W_UV. So decoding is multi-query attention with one "kv head" of key dim
C + R and value dim C, read straight from the latent cache: N heads share every byte loaded.

Layouts:

* contiguous: cache [B, S, C + R] (one layer of `atlas_jax.cache.latent.LatentCache`);
* paged: cache [P, Z, C + R] (one layer of `atlas_jax.cache.paged.LatentPool`) with
  block_table i32[B, max_blocks]; token p of sequence b lives in page block_table[b, p // Z].

Semantics (shared with `mla_decode_reference`, and with `kernels.paged_attention`):

* `lengths[b]` counts the tokens held for sequence b, including the T new ones, whose latents
  the caller has already written;
* the T queries are the last T positions, `lengths[b] - T + t`, causal among themselves;
* slots at or past `lengths[b]` (and pages past them) are never used, so they may hold anything;
* a query with no visible key (length 0) returns zeros.

Grid: (sequence, KV split, block of query rows), flash decoding (`kernels.flash_decoding`), in
FlashMLA's layout: a program holds `block_q` rows of the (token, head) pairs of one sequence (all
of them when T * N <= block_q, so every head shares one read of the latent) and walks its split
of the sequence's pages, several per iteration, with an online softmax; a second pass merges the
splits by their log-sum-exp. Splitting the length is what fills the GPU: one program per
sequence gave 32 programs for 32 sequences. With more rows than `block_q` (DeepSeek-V3's 128
heads at the default 64), the row blocks of a split are neighbouring programs that read the same
pages, so the second read is meant to come from L2; `block_q=128` makes it one read at the cost
of a [128, C] float32 accumulator per program. The latent and rope parts are loaded as separate
[Z, C] and [Z, R] tiles so that on GPUs every tile is a power of two (C=512, R=64 for
DeepSeek-V3; C + R = 576 is not). The contiguous cache is viewed as pages of one sequence each
(a free reshape), so one kernel serves both layouts.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import flash_decoding as fd

Array = jax.Array
Implementation = Literal["pallas", "xla"]


def _mla_decode_kernel(
  lengths_ref,  # i32[B]
  layer_ref,  # i32[1]: which layer of the stacked pool to read
  table_ref,  # i32[M]: this sequence's row of the block table
  qn_ref,  # [Q, C]: rows (t, n) of this block, latent part of the absorbed query
  qr_ref,  # [Q, R]: rope part
  pool_ref,  # [L, P, Z, C + R]: the whole latent pool (stays in HBM on GPUs; pages are loaded)
  o_ref,  # f32[Q, C]: this split's output, normalised by its own softmax sum
  lse_ref,  # f32[Q, 1]: this split's log-sum-exp, -inf for rows that saw no key
  *,
  scale: float,
  n_heads: int,
  n_queries: int,
  latent_dim: int,
  pages_per_split: int,
  pages_per_step: int,
):
  length = lengths_ref[pl.program_id(0)]
  layer = layer_ref[0]
  C = latent_dim
  Q = qn_ref.shape[0]
  Z = pool_ref.shape[2]
  R = qr_ref.shape[1]
  qn_QC = qn_ref[...]
  qr_QR = qr_ref[...]
  # Rows are (token t, head n) pairs; all heads of a token share its position.
  row_Q1 = pl.program_id(2) * Q + jax.lax.broadcasted_iota(jnp.int32, (Q, 1), 0)
  qpos_Q1 = length - n_queries + row_Q1 // n_heads
  offsets_1Z = jax.lax.broadcasted_iota(jnp.int32, (1, Z), 1)
  offsets_Z1 = jax.lax.broadcasted_iota(jnp.int32, (Z, 1), 0)
  first, n_steps, held = fd.split_steps(
    length,
    pl.program_id(1),
    page_size=Z,
    pages_per_split=pages_per_split,
    pages_per_step=pages_per_step,
  )

  def body(step, state):
    scores, values = [], []
    for j in range(pages_per_step):
      i = first + step * pages_per_step + j
      # Past the pages held (the last iteration of a split): read a held page, mask all of it.
      page = table_ref[jnp.minimum(i, held - 1)]
      c_ZC = pool_ref[layer, page, :, pl.ds(0, C)]
      kr_ZR = pool_ref[layer, page, :, pl.ds(C, R)]
      s_QZ = fd.scores(qn_QC, c_ZC) + fd.scores(qr_QR, kr_ZR)
      s_QZ *= jnp.float32(scale)
      # Causal visibility; qpos < length, so it also hides the page's unused tail.
      scores.append(jnp.where(i * Z + offsets_1Z <= qpos_Q1, s_QZ, -jnp.inf))
      # Stale slots past `length` may hold NaN, and 0 * NaN = NaN: zero those value rows.
      values.append(jnp.where(i * Z + offsets_Z1 < length, c_ZC, jnp.zeros((), c_ZC.dtype)))
    return fd.fold_pages(state, scores, values)

  state = jax.lax.fori_loop(0, n_steps, body, fd.init_state(Q, C))
  o_ref[...], lse_ref[...] = fd.finish(state)


def check_mla_decode_inputs(
  q_nope: Array,
  q_rope: Array,
  cache: Array,
  lengths: Array,
  block_table: Array | None,
  layer: Array | None = None,
) -> None:
  """Raises ValueError naming the shapes when the inputs do not fit together."""
  shapes = (
    f"q_nope.shape={tuple(q_nope.shape)} q_rope.shape={tuple(q_rope.shape)} "
    f"cache.shape={tuple(cache.shape)} lengths.shape={tuple(lengths.shape)} "
    f"block_table.shape={None if block_table is None else tuple(block_table.shape)}"
  )
  if q_nope.ndim not in (3, 4) or q_rope.ndim != q_nope.ndim:
    raise ValueError(
      f"mla_decode: q_nope and q_rope must be [B, N, C] / [B, N, R] or [B, T, N, C] / "
      f"[B, T, N, R]; {shapes}"
    )
  if q_nope.shape[:-1] != q_rope.shape[:-1]:
    raise ValueError(f"mla_decode: q_nope and q_rope disagree on [B, (T,) N]; {shapes}")
  B, C, R = q_nope.shape[0], q_nope.shape[-1], q_rope.shape[-1]
  if cache.ndim != (3 if layer is None else 4) or cache.shape[-1] != C + R:
    raise ValueError(
      f"mla_decode: cache must be [B, S, C + R] (or [P, Z, C + R] with a block table; either "
      f"with a leading [L] axis and a layer index) with C + R = {C} + {R}; {shapes}"
    )
  if layer is not None and jnp.shape(layer) != ():
    raise ValueError(f"mla_decode: layer must be a scalar; {shapes}")
  if layer is not None:
    cache = cache[0]  # the checks below are per layer
  if block_table is None and cache.shape[0] != B:
    raise ValueError(f"mla_decode: contiguous cache batch != q batch B={B}; {shapes}")
  if block_table is not None and (block_table.ndim != 2 or block_table.shape[0] != B):
    raise ValueError(f"mla_decode: block_table must be [B, max_blocks] with B={B}; {shapes}")
  if lengths.shape != (B,):
    raise ValueError(f"mla_decode: lengths must be [B] with B={B}; {shapes}")
  for name, x in (("block_table", block_table), ("lengths", lengths)):
    if x is not None and not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"mla_decode: {name} must be integer, got {x.dtype}; {shapes}")
  if not (q_nope.dtype == q_rope.dtype == cache.dtype) or not jnp.issubdtype(
    q_nope.dtype, jnp.floating
  ):
    raise ValueError(
      f"mla_decode: q_nope, q_rope and cache must share a floating dtype, got {q_nope.dtype}, "
      f"{q_rope.dtype}, {cache.dtype}; {shapes}"
    )


def _pow2_at_least(n: int, minimum: int = 16) -> int:
  # GPU matmul tiles want a power-of-two M of at least 16; padded rows are sliced off.
  return max(minimum, 1 << max(n - 1, 0).bit_length())


def _as_pages(cache_LBSY: Array, block_k: int | None) -> tuple[Array, Array]:
  """A contiguous cache viewed as a paged pool [L, B * S / Z, Z, Y] and its table [B, S / Z].

  The view is a free reshape when S is a multiple of the page size Z; otherwise the cache is
  padded (a copy), so allocate capacities that are multiples of 16 or more.
  """
  L, B, S, Y = cache_LBSY.shape
  if block_k is None:
    block_k = next((z for z in (64, 32, 16, 8) if S % z == 0), 16)
  if S % block_k:
    pad = -S % block_k
    cache_LBSY = jnp.pad(cache_LBSY, ((0, 0), (0, 0), (0, pad), (0, 0)))
    S += pad
  n = S // block_k
  table_BM = jnp.arange(B, dtype=jnp.int32)[:, None] * n + jnp.arange(n, dtype=jnp.int32)[None]
  return cache_LBSY.reshape(L, B * n, block_k, Y), table_BM


@functools.partial(
  jax.jit,
  static_argnames=("scale", "block_q", "block_k", "num_splits", "pages_per_step", "interpret"),
)
def mla_decode_pallas(
  q_nope: Array,
  q_rope: Array,
  cache: Array,
  lengths: Array,
  *,
  block_table: Array | None = None,
  layer: Array | None = None,
  scale: float,
  block_q: int = 64,
  block_k: int | None = None,
  num_splits: int | None = None,
  pages_per_step: int | None = None,
  interpret: bool = False,
) -> Array:
  """The Pallas kernel; see `mla_decode` for arguments."""
  check_mla_decode_inputs(q_nope, q_rope, cache, lengths, block_table, layer)
  fd.check_positive_or_none("mla_decode", "block_q", block_q)
  fd.check_positive_or_none("mla_decode", "block_k", block_k)
  if layer is None:  # one layer: a stack of one (a free reshape)
    cache, layer = cache[None], 0
  decode = q_nope.ndim == 3
  if decode:
    q_nope, q_rope = q_nope[:, None], q_rope[:, None]
  B, T, N, C = q_nope.shape
  R = q_rope.shape[-1]
  if block_table is None:
    pool_LPZY, table_BM = _as_pages(cache, block_k)
  else:
    pool_LPZY, table_BM = cache, block_table.astype(jnp.int32)
  L, P, Z, Y = pool_LPZY.shape
  M = table_BM.shape[1]
  rows = T * N
  Q = min(block_q, _pow2_at_least(rows))
  n_row_blocks = pl.cdiv(rows, Q)
  X, per_split, per_step = fd.plan_splits(
    "mla_decode",
    programs=B * n_row_blocks,
    max_blocks=M,
    page_size=Z,
    num_splits=num_splits,
    pages_per_step=pages_per_step,
  )
  pad = n_row_blocks * Q - rows
  qn_BQC = jnp.pad(q_nope.reshape(B, rows, C), ((0, 0), (0, pad), (0, 0)))
  qr_BQR = jnp.pad(q_rope.reshape(B, rows, R), ((0, 0), (0, pad), (0, 0)))
  kernel = functools.partial(
    _mla_decode_kernel,
    scale=scale,
    n_heads=N,
    n_queries=T,
    latent_dim=C,
    pages_per_split=per_split,
    pages_per_step=per_step,
  )
  # Row blocks are the last grid axis: the programs that read the same pages are neighbours.
  out_BXQC, lse_BXQ1 = pl.pallas_call(
    kernel,
    grid=(B, X, n_row_blocks),
    in_specs=[
      pl.BlockSpec((B,), lambda b, x, r: (0,)),
      pl.BlockSpec((1,), lambda b, x, r: (0,)),
      pl.BlockSpec((None, M), lambda b, x, r: (b, 0)),
      pl.BlockSpec((None, Q, C), lambda b, x, r: (b, r, 0)),
      pl.BlockSpec((None, Q, R), lambda b, x, r: (b, r, 0)),
      pl.BlockSpec((L, P, Z, Y), lambda b, x, r: (0, 0, 0, 0)),
    ],
    out_specs=[
      pl.BlockSpec((None, None, Q, C), lambda b, x, r: (b, x, r, 0)),
      pl.BlockSpec((None, None, Q, 1), lambda b, x, r: (b, x, r, 0)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((B, X, n_row_blocks * Q, C), jnp.float32),
      jax.ShapeDtypeStruct((B, X, n_row_blocks * Q, 1), jnp.float32),
    ],
    # A [Q, C] float32 accumulator (64 x 512 for DeepSeek-V3): eight warps hold it in registers.
    compiler_params=fd.compiler_params(interpret, num_warps=8),
    interpret=interpret,
    name="mla_decode",
  )(
    lengths.astype(jnp.int32),
    jnp.reshape(layer, (1,)).astype(jnp.int32),
    table_BM,
    qn_BQC,
    qr_BQR,
    pool_LPZY,
  )
  out_BQC = fd.combine_splits(out_BXQC, lse_BXQ1, axis=1, dtype=q_nope.dtype)
  out_BTNC = out_BQC[:, :rows].reshape(B, T, N, C)
  return out_BTNC[:, 0] if decode else out_BTNC


@functools.partial(jax.jit, static_argnames=("scale",))
def mla_decode_reference(
  q_nope: Array,
  q_rope: Array,
  cache: Array,
  lengths: Array,
  *,
  block_table: Array | None = None,
  layer: Array | None = None,
  scale: float,
) -> Array:
  """Pure jnp: (gather the pages,) score every slot, mask, softmax, weight the latents."""
  check_mla_decode_inputs(q_nope, q_rope, cache, lengths, block_table, layer)
  decode = q_nope.ndim == 3
  if decode:
    q_nope, q_rope = q_nope[:, None], q_rope[:, None]
  B, T, N, C = q_nope.shape
  if block_table is None:
    cache_BSY = cache if layer is None else cache[layer]
  else:
    Z, Y = cache.shape[-2:]
    pages = cache[block_table] if layer is None else cache[layer, block_table]
    cache_BSY = pages.reshape(B, block_table.shape[1] * Z, Y)
  S = cache_BSY.shape[1]
  c_BSC, kr_BSR = cache_BSY[..., :C], cache_BSY[..., C:]
  s_BTNS = jnp.einsum("BTNC,BSC->BTNS", q_nope, c_BSC, preferred_element_type=jnp.float32)
  s_BTNS += jnp.einsum("BTNR,BSR->BTNS", q_rope, kr_BSR, preferred_element_type=jnp.float32)
  s_BTNS *= jnp.float32(scale)
  qpos_BT = lengths[:, None] - T + jnp.arange(T)[None, :]
  visible_BTS = jnp.arange(S)[None, None, :] <= qpos_BT[:, :, None]
  s_BTNS = jnp.where(visible_BTS[:, :, None, :], s_BTNS, -jnp.inf)
  m_BTN1 = jnp.max(s_BTNS, axis=-1, keepdims=True)
  p_BTNS = jnp.exp(s_BTNS - jnp.where(m_BTN1 == -jnp.inf, 0.0, m_BTN1))
  l_BTN1 = jnp.sum(p_BTNS, axis=-1, keepdims=True)
  # Stale slots may hold NaN; zero them so 0 * NaN does not reach the output.
  valid_BS1 = (jnp.arange(S)[None, :] < lengths[:, None])[..., None]
  c_BSC = jnp.where(valid_BS1, c_BSC, jnp.zeros((), c_BSC.dtype))
  out_BTNC = jnp.einsum(
    "BTNS,BSC->BTNC", p_BTNS.astype(c_BSC.dtype), c_BSC, preferred_element_type=jnp.float32
  )
  out_BTNC = jnp.where(l_BTN1 > 0, out_BTNC / jnp.where(l_BTN1 > 0, l_BTN1, 1.0), 0.0)
  out_BTNC = out_BTNC.astype(q_nope.dtype)
  return out_BTNC[:, 0] if decode else out_BTNC


def mla_decode(
  q_nope: Array,
  q_rope: Array,
  cache: Array,
  lengths: Array,
  *,
  block_table: Array | None = None,
  layer: Array | None = None,
  scale: float,
  implementation: Implementation | None = None,
  interpret: bool | None = None,
  block_q: int = 64,
  block_k: int | None = None,
  num_splits: int | None = None,
  pages_per_step: int | None = None,
) -> Array:
  """Absorbed-weight MLA attention of the newest T tokens over the latent cache.

  Args:
    q_nope: [B, T, N, C] (or [B, N, C] for T = 1) queries already multiplied into the latent
      space (q_nope @ W_UK^T per head).
    q_rope: [B, T, N, R] (or [B, N, R]) RoPE-rotated query parts.
    cache: [B, S, C + R] contiguous latents, or [P, Z, C + R] pages with `block_table`; with
      `layer`, either stacked over layers ([L, ...]) and read at that layer in place.
    lengths: i32[B] tokens held per sequence, the T new ones included.
    block_table: i32[B, max_blocks] page ids per sequence (paged layout), or None.
    layer: i32[] the layer to read from a stacked cache, or None.
    scale: softmax scale (MLA: (Hn + R) ** -0.5, times YaRN's mscale squared).
    implementation: "pallas", "xla" (the reference) or None (Pallas on GPU, else XLA).
    interpret: run the Pallas kernel in interpret mode (default: on CPU).
    block_q: (token, head) rows per program. block_k: page size for the contiguous layout.
    num_splits: KV splits per sequence (flash decoding); None picks them from the grid size and
      the cache's capacity (`kernels.flash_decoding.choose_num_splits`).
    pages_per_step: pages the kernel scores per iteration; None: 64 tokens' worth.

  Returns:
    [B, T, N, C] (or [B, N, C]) attention-weighted latents in q_nope.dtype.
  """
  if implementation not in (None, "pallas", "xla"):
    raise ValueError(
      f"mla_decode: implementation={implementation!r} is not one of ('pallas', 'xla') or None"
    )
  if implementation is None:
    implementation = "pallas" if jax.default_backend() == "gpu" else "xla"
  if implementation == "xla":
    return mla_decode_reference(
      q_nope, q_rope, cache, lengths, block_table=block_table, layer=layer, scale=scale
    )
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  return mla_decode_pallas(
    q_nope,
    q_rope,
    cache,
    lengths,
    block_table=block_table,
    layer=layer,
    scale=scale,
    block_q=block_q,
    block_k=block_k,
    num_splits=num_splits,
    pages_per_step=pages_per_step,
    interpret=interpret,
  )
