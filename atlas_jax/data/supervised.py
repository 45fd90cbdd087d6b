"""Supervised examples (data.format chat / completion): tokens, a loss mask, and packed rows.

* completion: `{"prompt": str, "completion": str}`. The prompt is encoded as serve.py encodes a
  completion request's prompt (with the tokenizer's default special tokens: a Llama's BOS), the
  completion without special tokens, then the eos token; the completion and the eos count.
* chat: `{"messages": [{"role": ..., "content": ...}, ...]}` (OpenAI's shape; content a string or
  a list of text parts), rendered with the model's chat template as serve.py renders a chat
  request. The conversation is rendered once; each assistant message's span in that text lies
  between the render of the messages before it with the generation prompt (what serve.py would
  send the model) and the render up to and including it, so the span holds the message and the
  template's end of turn. The text is encoded piece by piece at those boundaries: the first
  piece exactly as serve.py encodes a chat's prompt, so a conversation's first request has the
  same tokens in training and in serving, and each assistant piece as the model generates it,
  from a fresh token. The assistant pieces count. The plain transcript (a model without a
  template) has no end of turn, so an eos follows a final assistant message and counts.

Examples are packed whole into rows of seq_len + 1 tokens, in order, a new row when the next one
does not fit; each keeps its own segment id (attention never crosses examples) and positions
from 0, the rest of a row is padding whose loss does not count. An example longer than a row is
cut to it (`Packing.cut` counts them). A position's loss counts when the token it predicts is
an answer token of its own example.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from atlas_jax.data.corpus import iter_json_objects, string_field
from atlas_jax.data.dataset import held_out
from atlas_jax.data.tokenizer import Tokenizer, encode_prompt

FORMATS = ("chat", "completion")


@dataclasses.dataclass
class Examples:
  """Tokenised examples, concatenated."""

  tokens: np.ndarray  # i32[n]
  mask: np.ndarray  # u8[n] 1 where predicting this token counts (an answer token)
  starts: np.ndarray  # i64[e] where each example begins in `tokens`

  def __len__(self) -> int:
    return len(self.starts)

  def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, mask) of example i."""
    end = self.starts[i + 1] if i + 1 < len(self.starts) else len(self.tokens)
    return self.tokens[self.starts[i] : end], self.mask[self.starts[i] : end]

  @classmethod
  def join(cls, examples: Sequence[tuple[list[int], list[int]]]) -> Examples:
    lengths = np.asarray([len(t) for t, _ in examples], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    if not examples:
      return cls(np.zeros((0,), np.int32), np.zeros((0,), np.uint8), np.zeros((0,), np.int64))
    tokens = np.concatenate([np.asarray(t, np.int32) for t, _ in examples])
    mask = np.concatenate([np.asarray(m, np.uint8) for _, m in examples])
    return cls(tokens, mask, starts)


def _messages(record: dict, where: str) -> list[dict[str, Any]]:
  """The example's messages, each checked: a role and text content; one assistant message at
  least (else nothing would count)."""
  if "messages" not in record:
    raise ValueError(f"{where}: the object has no 'messages' field (fields: {sorted(record)})")
  messages = record["messages"]
  if not isinstance(messages, list) or not messages:
    raise ValueError(f"{where}: field 'messages' must be a non-empty list of message objects")
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise ValueError(f"{where}: field 'messages.{i}' must be an object, got {type(m).__name__}")
    if not isinstance(m.get("role"), str):
      raise ValueError(
        f"{where}: field 'messages.{i}.role' must be a string, got {m.get('role')!r}"
      )
    content = m.get("content")
    if not (isinstance(content, str) or isinstance(content, list)):
      raise ValueError(
        f"{where}: field 'messages.{i}.content' must be a string or a list of text parts, got "
        f"{type(content).__name__}"
      )
  if not any(m["role"] == "assistant" for m in messages):
    raise ValueError(
      f"{where}: field 'messages' has no message with role 'assistant' (roles: "
      f"{[m['role'] for m in messages]}): nothing to learn"
    )
  return messages


def encode_completion(tokenizer: Tokenizer, prompt: str, completion: str):
  """(ids, mask): the prompt as serve.py encodes one, then the completion and eos, counted."""
  prompt_ids = encode_prompt(tokenizer, prompt)
  answer = tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_id]
  return prompt_ids + answer, [0] * len(prompt_ids) + [1] * len(answer)


def encode_chat(tokenizer: Tokenizer, template, messages: list[dict[str, Any]], where: str):
  """(ids, mask) of a conversation rendered with `template` (a `ChatTemplate`); see the module
  docstring. Raises ValueError naming `where` when the template cannot render it, or renders
  a conversation's beginning other than its whole (no span can be told)."""

  def render(msgs, prompt: bool) -> str:
    try:
      return template.render(msgs, add_generation_prompt=prompt) if msgs else ""
    except ValueError as e:  # ChatTemplateError: bad content, or the template raised
      raise ValueError(f"{where}: field {getattr(e, 'field', 'messages')!r}: {e}") from None

  full = render(messages, False)
  cuts, spans = [0], []
  for i, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    prompt, end = render(messages[:i], True), render(messages[: i + 1], False)
    start = len(prompt)
    if not (full.startswith(prompt) and full.startswith(end) and start <= len(end)):
      raise ValueError(
        f"{where}: field 'messages.{i}': the chat template renders the conversation up to this "
        "message otherwise than the conversation's own beginning (it rewrites earlier turns?), "
        "so the message's tokens cannot be told apart"
      )
    cuts += [start, len(end)]
    spans.append((start, len(end)))
  cuts.append(len(full))
  ids, mask = [], []
  answer = {s for s, _ in spans}
  for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
    if a == b:
      continue
    add = template.adds_special_tokens(full, tokenizer) if k == 0 else False
    piece = tokenizer.encode(full[a:b], add_special_tokens=add)
    ids += piece
    mask += [int(a in answer)] * len(piece)
  if template.plain and messages[-1]["role"] == "assistant" and tokenizer.eos_id >= 0:
    ids.append(tokenizer.eos_id)
    mask.append(1)
  return ids, mask


def read_examples(source: str | Path, fmt: str, tokenizer: Tokenizer, template=None):
  """(name "file:line", ids, mask) per example of a JSONL file.

  Raises:
    ValueError naming the file, the line and the field for a bad line.
  """
  if fmt not in FORMATS:
    raise ValueError(f"data.format={fmt!r} is not one of {FORMATS}")
  if fmt == "completion" and tokenizer.eos_id < 0:
    raise ValueError(
      "data.format='completion' ends each completion with eos; the tokenizer has none"
    )
  path = Path(source)
  for line, record in iter_json_objects(path):
    where = f"{path}:{line}"
    if fmt == "completion":
      prompt, completion = (
        string_field(record, "prompt", where),
        string_field(record, "completion", where),
      )
      ids, mask = encode_completion(tokenizer, prompt, completion)
    else:
      ids, mask = encode_chat(tokenizer, template, _messages(record, where), where)
    yield f"{path.name}:{line}", ids, mask


def tokenize_examples(
  source: str | Path, fmt: str, tokenizer: Tokenizer, template, *, eval_fraction: float
) -> tuple[Examples, Examples]:
  """(train, eval) examples, split by a hash of each line's name as text documents are."""
  parts: dict[bool, list] = {False: [], True: []}
  for name, ids, mask in read_examples(source, fmt, tokenizer, template):
    parts[held_out(name, eval_fraction)].append((ids, mask))
  return Examples.join(parts[False]), Examples.join(parts[True])


@dataclasses.dataclass(frozen=True)
class Packing:
  """What packing did to a split."""

  examples: int
  rows: int
  cut: int  # examples longer than a row, cut to it
  cut_empty: int  # of those, ones left with no answer token
  padding: float  # share of the rows' tokens that are padding

  def describe(self, seq_len: int) -> str:
    out = (
      f"{self.examples:,} examples packed into {self.rows:,} rows of {seq_len + 1} tokens "
      f"({self.padding:.0%} padding)"
    )
    if self.cut:
      out += f"; {self.cut:,} longer than train.seq_len + 1 = {seq_len + 1} were cut" + (
        f" ({self.cut_empty:,} of them before any answer token: they teach nothing)"
      ) * bool(self.cut_empty)
    return out


class PackedExamples:
  """Random-access rows of whole examples: tokens, segment ids, positions and loss mask."""

  def __init__(self, examples: Examples, seq_len: int, pad_id: int):
    n = seq_len + 1
    rows, row, used, cut, cut_empty = [], [], 0, 0, 0
    for i in range(len(examples)):
      length = len(examples.example(i)[0])
      if length > n:
        cut += 1
        cut_empty += int(examples.example(i)[1][:n].sum() == 0)
        length = n
      if used + length > n:
        rows.append(row)
        row, used = [], 0
      row.append((i, length))
      used += length
    if row:
      rows.append(row)
    self.examples, self.rows, self.seq_len, self.pad_id = examples, rows, seq_len, max(pad_id, 0)
    tokens = sum(length for r in rows for _, length in r)
    self.packing = Packing(
      len(examples), len(rows), cut, cut_empty, 1 - tokens / max(len(rows) * n, 1)
    )

  def __len__(self) -> int:
    return len(self.rows)

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    n = self.seq_len + 1
    tokens = np.full((n,), self.pad_id, np.int32)
    answer = np.zeros((n,), np.float32)
    segment = np.zeros((n,), np.int32)
    positions = np.zeros((n,), np.int32)
    at = 0
    row = self.rows[int(i)]
    for s, (e, length) in enumerate(row):
      ids, mask = self.examples.example(e)
      tokens[at : at + length] = ids[:length]
      answer[at : at + length] = mask[:length]
      segment[at : at + length] = s
      positions[at : at + length] = np.arange(length)
      at += length
    segment[at:] = len(row)  # padding: a segment of its own
    # Position t predicts token t + 1: it counts if that is an answer token of t's own example.
    loss_mask = answer[1:] * (segment[1:] == segment[:-1])
    return {
      "tokens": tokens,  # i32[T + 1]
      "segment_ids": segment[:-1],  # i32[T]
      "positions": positions[:-1],  # i32[T]
      "loss_mask": loss_mask.astype(np.float32),  # f32[T]
    }


def held_out_examples(examples: Examples, n: int) -> Iterator[tuple[list[int], list[int]]]:
  """(prompt ids, answer ids) of the first `n` examples: each example's tokens before its first
  answer token, and its first run of answer tokens (what a greedy completion should produce)."""
  for i in range(min(n, len(examples))):
    ids, mask = examples.example(i)
    first = int(np.argmax(mask > 0))
    end = first + int(np.argmin(mask[first:] > 0)) if (mask[first:] == 0).any() else len(ids)
    yield ids[:first].tolist(), ids[first:end].tolist()
