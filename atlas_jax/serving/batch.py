"""What the scheduler hands the model runner each step, as host arrays: plain Python and NumPy,
no jax, so the scheduler can build and read it without importing the runner.

* `Row`: one request's part in a step (the tokens it computes, where they start, its blocks).
* `StepRecord`: a step's rows laid out for one model call, tpu-inference's `AttentionMetadata`
  and vLLM v1's input batch in one: the new tokens on R rows of T, and per sequence where its
  run starts, how long it is and what the pool holds for it. Two layouts share it:

  - ragged (the accelerator runner): one row per data-parallel replica, every new token of the
    replica's sequences (prompt chunks and decode tokens alike) on it in order, padding after;
    B = R x b sequences, replica r's in [r b, (r + 1) b);
  - rows (bursts and speculative rounds, and the CPU runner's calls): one row per sequence,
    R = B, its tokens first in its row.

  `steps` registers it as a pytree, so one jitted program takes every field at once; a padding
  sequence has `query_len` 0 and `lengths` -1, and writes and reads nothing.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
  from atlas_jax.serving.requests import Request


@dataclasses.dataclass(frozen=True, eq=False)
class Row:
  """One request's part in a step."""

  req: Request
  n: int  # tokens computed for it (a prompt chunk; 1: the pending token of a decode step)
  start: int  # its tokens in the pool before the step (the first new token's position)
  step: int  # the index of the first token the step draws for it
  blocks: tuple[int, ...]  # its blocks' global ids, reserved ones included
  # its blocks in the windowed layers' pool (global ids), for a model mixing windowed and
  # full-attention layers (`atlas_jax.cache.allocator.HybridAllocator`); else empty
  window_blocks: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """One model call's inputs: R rows of T new tokens, B sequences (see the module docstring)."""

  tokens_RT: Any  # i32[R, T] the new tokens; a burst or round: the pending token, T = 1
  positions_RT: Any  # i32[R, T] their positions; -1: padding
  query_start_B: Any  # i32[B] where each sequence's run starts in its row
  query_len_B: Any  # i32[B] its new tokens; 0: a padding sequence
  lengths_B: Any  # i32[B] its tokens in the pool before the call; -1: a padding sequence
  last_B: Any  # i32[B] the index in its row of its last new token (whose draw is its)
  block_table_BM: Any  # i32[B, M] its blocks (global ids), reserved ones included
  seed_B: Any  # i32[B]
  step_B: Any  # i32[B] the index of the first token this call draws for it
  sampling: Any  # SamplingArrays [B]: per-sequence sampling controls (guided masks, logit bias)
  counts_BV: Any = None  # i32[B, V] output token counts (penalties), else None
  prompt_mask_BV: Any = None  # bool[B, V] the prompt's tokens (penalties), else None
  # i32[R, T] each new token's LoRA adapter slot (0: the base) when the server holds adapters
  # (`atlas_jax.serving.lora`), else None
  adapter_RT: Any = None
  # i32[B, M] its blocks in the windowed layers' pool (`Row.window_blocks`) for a model mixing
  # windowed and full-attention layers, else None
  window_table_BM: Any = None

  @property
  def rows_form(self) -> bool:
    """Whether each row holds one sequence (R = B)."""
    return self.tokens_RT.shape[0] == self.lengths_B.shape[0]


def pow2(n: int, minimum: int = 1) -> int:
  """n rounded up to a power of two, at least `minimum`."""
  return max(minimum, 1 << max(n - 1, 0).bit_length())


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each row of a step goes: sequence slot `slot[i]` of B, its tokens from `offset[i]`
  of row `row[i]` of R."""

  R: int
  T: int
  B: int
  row: np.ndarray  # i32[rows]
  offset: np.ndarray  # i32[rows]
  slot: np.ndarray  # i32[rows]


def ragged_layout(rows, replica_of, n_replicas: int, b: int, T: int) -> Layout:
  """Each replica's rows on its own row of T tokens, in order, and in its own slice of b
  sequence slots."""
  count = [0] * n_replicas
  used = [0] * n_replicas
  row, offset, slot = [], [], []
  for r in rows:
    rep = replica_of(r)
    row.append(rep)
    offset.append(used[rep])
    slot.append(rep * b + count[rep])
    used[rep] += r.n
    count[rep] += 1
  if max(used) > T or max(count) > b:
    raise ValueError(f"ragged_layout: {max(used)} tokens / {max(count)} rows exceed T={T}, b={b}")
  as_i32 = lambda x: np.asarray(x, np.int32)
  return Layout(n_replicas, T, n_replicas * b, as_i32(row), as_i32(offset), as_i32(slot))


def rows_layout(rows, replica_of, n_replicas: int, b: int, T: int) -> Layout:
  """One row per sequence slot: replica r's rows in slots [r b, (r + 1) b), each from 0."""
  count = [0] * n_replicas
  slot = []
  for r in rows:
    rep = replica_of(r)
    slot.append(rep * b + count[rep])
    count[rep] += 1
  B = n_replicas * b
  s = np.asarray(slot, np.int32)
  return Layout(B, T, B, s, np.zeros(len(slot), np.int32), s)


def fill_tokens(rows, layout: Layout) -> dict[str, np.ndarray]:
  """The token fields of a record for `rows` placed by `layout` (everything but sampling).

  A row's tokens not yet known on the host (a chained burst's pending token) stay 0: the
  program takes them from the device."""
  R, T, B = layout.R, layout.T, layout.B
  tokens = np.zeros((R, T), np.int32)
  positions = np.full((R, T), -1, np.int32)
  start = np.zeros((B,), np.int32)
  length = np.zeros((B,), np.int32)
  lengths = np.full((B,), -1, np.int32)
  last = np.zeros((B,), np.int32)
  for row, r, o, b in zip(rows, layout.row, layout.offset, layout.slot):
    req, n = row.req, row.n
    known = req.tokens[row.start : row.start + n]
    tokens[r, o : o + len(known)] = known
    positions[r, o : o + n] = np.arange(row.start, row.start + n)
    start[b], length[b], lengths[b], last[b] = o, n, row.start, o + n - 1
  return dict(
    tokens_RT=tokens,
    positions_RT=positions,
    query_start_B=start,
    query_len_B=length,
    lengths_B=lengths,
    last_B=last,
  )


def adapter_slots(rows, layout: Layout) -> np.ndarray:
  """i32[R, T]: each new token's adapter slot (its request's), 0 on padding."""
  slots = np.zeros((layout.R, layout.T), np.int32)
  for row, r, o in zip(rows, layout.row, layout.offset):
    slots[r, o : o + row.n] = row.req.adapter
  return slots


def block_table(rows, slots, B: int, M: int, *, window: bool = False) -> np.ndarray:
  """i32[B, M]: each row's blocks in its slot, the first M of them (`window`: its blocks in the
  windowed layers' pool)."""
  table = np.zeros((B, M), np.int32)
  for row, b in zip(rows, slots):
    blocks = row.window_blocks if window else row.blocks
    table[b, : len(blocks)] = blocks[:M]
  return table


__all__ = ["Layout", "Row", "StepRecord", "adapter_slots", "block_table", "fill_tokens", "pow2"]
