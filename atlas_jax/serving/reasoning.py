"""Reasoning parsers: a thinking model's `<think>...</think>` split from its answer.

By vLLM's `--reasoning-parser` names:
  deepseek_r1  the thinking comes first, its `<think>` optional (the template may have written
               it in the prompt); without `</think>` the whole output is thinking.
  qwen3        the same while thinking is on (`chat_template_kwargs.enable_thinking`, default
               true); a `<tool_call>` also ends the thinking; with thinking off, all is answer.

`split` reads an output (whole, or so far): (reasoning, content), each None when absent. While
streaming (`final=False`) a partial marker at the end is held back, so what `split` returns only
grows as the text does and `ReasoningStream` sends the difference.

`gate` makes a request's guided constraint apply after the thinking, as vLLM's does: the grammar
waits for the `</think>` token (`atlas_jax.decoding.guided.ReasoningGate`). That needs the marker
to be one token of the vocabulary (as in Qwen3's and DeepSeek-R1's); where it is not, the
constraint applies from the first token and the output is all answer.
"""

from __future__ import annotations

from typing import ClassVar

from atlas_jax.decoding.guided import Grammar, ReasoningGate
from atlas_jax.serving.tool_parsers import partial_overlap


class ReasoningParser:
  name: ClassVar[str] = "deepseek_r1"
  start: ClassVar[str] = "<think>"
  end: ClassVar[str] = "</think>"
  also_ends: ClassVar[tuple[str, ...]] = ()  # markers that end the thinking and begin the answer

  def __init__(self, chat_template_kwargs: dict | None = None):
    self.thinking = True

  def split(self, text: str, final: bool = True) -> tuple[str | None, str | None]:
    if not self.thinking:
      return None, text or None
    at = 0
    stripped = text.lstrip()
    if stripped.startswith(self.start):
      at = len(text) - len(stripped) + len(self.start)
    elif not final and self.start.startswith(stripped):
      return None, None  # perhaps the start marker, arriving
    rest = text[at:]
    ends = [(rest.find(m), len(m)) for m in (self.end, *self.also_ends) if m in rest]
    if ends:
      cut, n = min(ends)
      content_at = cut + (n if rest.startswith(self.end, cut) else 0)
      return rest[:cut], rest[content_at:] or None
    if not final:
      hold = max(partial_overlap(rest, m) for m in (self.end, *self.also_ends))
      rest = rest[: len(rest) - hold]
    return rest, None


class Qwen3ReasoningParser(ReasoningParser):
  name = "qwen3"
  also_ends = ("<tool_call>",)

  def __init__(self, chat_template_kwargs: dict | None = None):
    self.thinking = bool((chat_template_kwargs or {}).get("enable_thinking", True))


PARSERS: dict[str, type[ReasoningParser]] = {
  p.name: p for p in (ReasoningParser, Qwen3ReasoningParser)
}


def get_parser(name: str, chat_template_kwargs: dict | None = None) -> ReasoningParser:
  """The parser of vLLM's `--reasoning-parser` name; ValueError naming the choices."""
  if name not in PARSERS:
    raise ValueError(f"--reasoning-parser={name!r} is not allowed: one of {sorted(PARSERS)}")
  return PARSERS[name](chat_template_kwargs)


def marker_id(tokenizer, marker: str) -> int | None:
  """The id of `marker` where the tokenizer spells it as one token, else None."""
  ids = tokenizer.encode(marker, add_special_tokens=False)
  return ids[0] if len(ids) == 1 else None


def gate(grammar: Grammar, parser: ReasoningParser, tokenizer) -> ReasoningGate | None:
  """`grammar` applied after the thinking, or None where it cannot be (thinking off, or a
  `</think>` that is not one token)."""
  end_id = marker_id(tokenizer, parser.end)
  if not parser.thinking or end_id is None:
    return None
  return ReasoningGate(grammar, end_id=end_id, start_id=marker_id(tokenizer, parser.start))


class ReasoningStream:
  """One streamed choice: feed the whole text so far, get (new reasoning, the content so far)."""

  def __init__(self, parser: ReasoningParser):
    self.parser = parser
    self.reasoning_sent = 0

  def feed(self, text: str, final: bool = False) -> tuple[str, str]:
    reasoning, content = self.parser.split(text, final)
    reasoning = reasoning or ""
    new = reasoning[self.reasoning_sent :]
    self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
    return new, content or ""


__all__ = [
  "PARSERS",
  "Qwen3ReasoningParser",
  "ReasoningParser",
  "ReasoningStream",
  "gate",
  "get_parser",
  "marker_id",
]
