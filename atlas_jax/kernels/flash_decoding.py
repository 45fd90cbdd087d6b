"""Flash decoding: what the two decode kernels share (`paged_attention`, `mla_decode`).

Decoding reads a whole cache for one or a few query tokens, so it is bound by memory bandwidth,
and a grid of one program per (sequence, kv head) leaves most of a GPU idle when the batch is
small (MLA has one kv head: 32 sequences are 32 programs on a 132-SM card). Flash decoding
(Dao et al. 2023) splits the key/value length across programs as well:

1. each program owns a contiguous range of pages of one sequence (a KV split), walks it several
   pages per iteration with an online softmax, and writes its partial output, normalised by its
   own softmax sum, with the log-sum-exp of its scores (-inf where it saw no key);
2. a second pass combines the X partials of a row: with lse* = max_x lse_x and weights
   w_x = exp(lse_x - lse*), out = sum_x w_x o_x / sum_x w_x. XLA fuses this into one small
   reduction over f32[..., X, Q, H], read once.

The split count comes from `choose_num_splits` (override with `num_splits=`): enough programs to
give every SM one, but no split shorter than `MIN_SPLIT_TOKENS` of the cache's capacity, so the
partials (X * Q * H floats per program) stay small next to the cache bytes read. Splits are laid
out over the capacity (the block table's width), since lengths are data; a split that starts past
a sequence's length does no work and contributes nothing.

Within a split, each iteration loads `pages_per_step` pages (independent loads the compiler can
issue together), scores them, and rescales the running output once per iteration instead of once
per page. Shape letters: Q query rows of a program, X KV splits, Z page size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

# About one program per SM (132 on an H100/H200; the device's own count is used where known);
# more programs only add partials to combine.
TARGET_PROGRAMS = 132
# A split reads at least this many tokens of capacity, so its partial output is small beside them.
MIN_SPLIT_TOKENS = 512
MAX_SPLITS = 64
# Tokens an iteration scores at once: several pages of 16, or one page of 64.
STEP_TOKENS = 64

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


def compiler_params(interpret: bool, *, num_warps: int):
  """Triton lowering, named explicitly: jax's default Pallas GPU backend may be Mosaic GPU,
  which would stage the whole pool block into shared memory."""
  if interpret:
    return None
  from jax.experimental.pallas import triton as pltriton

  return pltriton.CompilerParams(num_warps=num_warps, num_stages=2)


def check_positive_or_none(fn: str, name: str, value) -> None:
  """Static kernel options: a positive int, or None for the heuristic."""
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{fn}: {name} must be a positive int or None, got {value!r}")


def device_programs() -> int:
  """The default device's SM count on a GPU, else TARGET_PROGRAMS."""
  device = jax.devices()[0]
  count = getattr(device, "core_count", None) if device.platform == "gpu" else None
  return int(count) if count else TARGET_PROGRAMS


def choose_num_splits(
  programs: int, capacity_tokens: int, *, target_programs: int = TARGET_PROGRAMS
) -> int:
  """KV splits per sequence for `programs` programs per split and caches of this capacity.

  Args:
    programs: programs the grid has without splitting (sequences x kv heads x row blocks).
    capacity_tokens: the most tokens a sequence can hold (block-table width x page size).
    target_programs: programs that fill the device (its SM count).

  Returns:
    ceil(target_programs / programs), at most capacity / MIN_SPLIT_TOKENS and MAX_SPLITS, at
    least 1. E.g. 32 MLA sequences of 4k: 5 splits; 64 sequences x 8 kv heads: 1 split.
  """
  by_occupancy = -(-target_programs // max(programs, 1))
  by_length = max(1, capacity_tokens // MIN_SPLIT_TOKENS)
  return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def plan_splits(
  fn: str,
  *,
  programs: int,
  max_blocks: int,
  page_size: int,
  num_splits: int | None,
  pages_per_step: int | None,
) -> tuple[int, int, int]:
  """(num_splits, pages_per_split, pages_per_step) for a block table of `max_blocks` pages.

  pages_per_split is a multiple of pages_per_step, so an iteration never crosses into the next
  split (no key is counted twice); iterations past a sequence's pages are masked in the kernel.
  """
  check_positive_or_none(fn, "num_splits", num_splits)
  check_positive_or_none(fn, "pages_per_step", pages_per_step)
  if pages_per_step is None:
    pages_per_step = max(1, min(STEP_TOKENS // page_size, max_blocks))
  if num_splits is None:
    num_splits = choose_num_splits(
      programs, max_blocks * page_size, target_programs=device_programs()
    )
  num_splits = min(num_splits, max_blocks)  # every split holds at least one page
  per_split = -(-max_blocks // num_splits)
  per_split = -(-per_split // pages_per_step) * pages_per_step
  num_splits = -(-max_blocks // per_split)  # rounding up may leave trailing splits empty
  return num_splits, per_split, pages_per_step


def split_steps(length, split, *, page_size: int, pages_per_split: int, pages_per_step: int):
  """(first page, iterations, pages held) of split `split` of a sequence of `length` tokens.

  The last iteration may run past the pages held; the kernels read the last held page instead
  (block-table entries past it may hold anything, even ids outside the pool) and mask it.
  """
  first = split * pages_per_split
  held = (length + page_size - 1) // page_size
  pages = jnp.clip(held - first, 0, pages_per_split)
  return first, (pages + pages_per_step - 1) // pages_per_step, held


def init_state(rows: int, width: int) -> tuple[Array, Array, Array]:
  """(m, l, acc) of an online softmax over nothing: -inf, 0, 0."""
  return (
    jnp.full((rows, 1), -jnp.inf, jnp.float32),
    jnp.zeros((rows, 1), jnp.float32),
    jnp.zeros((rows, width), jnp.float32),
  )


def fold_pages(state, scores, values):
  """Folds several pages' scores f32[Q, Z] and values [Z, W] into (m, l, acc) at once.

  Masked scores are -inf; values may only be nonzero where they can receive weight (a stale NaN
  times a zero weight is NaN), which the callers ensure.
  """
  m_Q1, l_Q1, acc_QW = state
  m_new_Q1 = m_Q1
  for s_QZ in scores:
    m_new_Q1 = jnp.maximum(m_new_Q1, jnp.max(s_QZ, axis=1, keepdims=True))
  # A row with nothing visible yet keeps m = -inf; shifting by 0 there gives exp(-inf) = 0, not NaN.
  shift_Q1 = jnp.where(m_new_Q1 == -jnp.inf, 0.0, m_new_Q1)
  alpha_Q1 = jnp.exp(m_Q1 - shift_Q1)
  l_Q1 = alpha_Q1 * l_Q1
  acc_QW = alpha_Q1 * acc_QW
  for s_QZ, v_ZW in zip(scores, values):
    p_QZ = jnp.exp(s_QZ - shift_Q1)
    l_Q1 += jnp.sum(p_QZ, axis=1, keepdims=True)
    # p goes to the matmul in the cache's dtype (bf16 tensor cores), accumulating in float32.
    acc_QW += lax.dot_general(
      p_QZ.astype(v_ZW.dtype), v_ZW, _NN, preferred_element_type=jnp.float32
    )
  return m_new_Q1, l_Q1, acc_QW


def scores(q_QH: Array, k_ZH: Array) -> Array:
  """f32[Q, Z] = q @ k.T, accumulated in float32."""
  return lax.dot_general(q_QH, k_ZH, _NT, preferred_element_type=jnp.float32)


def finish(state) -> tuple[Array, Array]:
  """(out f32[Q, W], lse f32[Q, 1]) of a split: zeros and -inf for rows that saw no key."""
  m_Q1, l_Q1, acc_QW = state
  empty_Q1 = l_Q1 == 0.0
  l_safe_Q1 = jnp.where(empty_Q1, 1.0, l_Q1)
  return acc_QW / l_safe_Q1, jnp.where(empty_Q1, -jnp.inf, m_Q1 + jnp.log(l_safe_Q1))


def combine_splits(
  out_XQW: Array, lse_XQ1: Array, *, axis: int, dtype, sink_Q1: Array | None = None
) -> Array:
  """The second pass: merges split partials along `axis` by their log-sum-exp weights.

  Args:
    out_XQW: f32[..., X, ..., W] partial outputs, each normalised by its own softmax sum.
    lse_XQ1: f32[..., X, ..., 1] their log-sum-exps, -inf for splits that saw no key.
    axis: the split axis X.
    dtype: the output dtype.
    sink_Q1: f32[..., 1], broadcastable to lse without the split axis: each row's attention
      sink logit (`kernels.reference`), or None. The sink is one more partial, of output zero,
      so it is counted once however many splits there are.

  Returns:
    out with the split axis removed; zeros for rows no split saw a key for.
  """
  lse_max = jnp.max(lse_XQ1, axis=axis, keepdims=True)
  if sink_Q1 is not None:
    sink_Q1 = jnp.broadcast_to(sink_Q1, jnp.squeeze(lse_max, axis).shape)
    lse_max = jnp.maximum(lse_max, jnp.expand_dims(sink_Q1, axis))
  lse_max = jnp.where(lse_max == -jnp.inf, 0.0, lse_max)
  w = jnp.exp(lse_XQ1 - lse_max)  # exp(-inf) = 0 for empty splits
  total = jnp.sum(w, axis=axis)
  if sink_Q1 is not None:
    total = total + jnp.exp(sink_Q1 - jnp.squeeze(lse_max, axis))
  out = jnp.sum(w * out_XQW, axis=axis) / jnp.where(total > 0.0, total, 1.0)
  return out.astype(dtype)


def sink_rows(sinks_N: Array, kv_heads: int, tokens: int, rows: int) -> Array:
  """f32[K, rows, 1]: each kernel row's sink logit, the rows of kv head h being (token t, head
  g of its group) at t * G + g, padded to `rows` (padding rows' outputs are discarded)."""
  G = sinks_N.shape[0] // kv_heads
  sink_KQ = jnp.tile(sinks_N.astype(jnp.float32).reshape(kv_heads, G), (1, tokens))
  return jnp.pad(sink_KQ, ((0, 0), (0, rows - tokens * G)))[..., None]
