"""Incremental detokenisation: text for a growing token list at O(1) amortised cost per token.

Decoding a request's whole output after every token costs O(n) per token, O(n^2) per request.
Instead each stream decodes a short window of its latest tokens twice: from `prefix_offset` to
`read_offset` (text already emitted) and from `prefix_offset` to the end, and emits the
difference. Starting the window a token early gives tokenizers whose output depends on the
preceding token (a leading space, say) the context they need. A window whose text ends in U+FFFD
is half a UTF-8 character: nothing is emitted until the bytes that complete it arrive, so a
character is never split across two pieces of text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
  """The text of one output stream, one token at a time.

  Args:
    decode: token ids -> text (the tokenizer's full decode).
  """

  def __init__(self, decode: Callable[[Sequence[int]], str]):
    self.decode = decode
    self.tokens: list[int] = []
    self.text = ""  # everything emitted so far
    self.prefix_offset = 0  # window start: tokens before it are settled
    self.read_offset = 0  # tokens before it are already in `text`

  def push(self, token: int) -> str:
    """Adds a token; returns the text it completes (empty while a character is unfinished)."""
    self.tokens.append(int(token))
    prefix = self.decode(self.tokens[self.prefix_offset : self.read_offset])
    full = self.decode(self.tokens[self.prefix_offset :])
    if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
      return ""
    new = full[len(prefix) :]
    self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
    self.text += new
    return new

  def flush(self) -> str:
    """The text of tokens still held back (an unfinished character at the end of the stream)."""
    prefix = self.decode(self.tokens[self.prefix_offset : self.read_offset])
    full = self.decode(self.tokens[self.prefix_offset :])
    new = full[len(prefix) :]
    self.prefix_offset = self.read_offset = len(self.tokens)
    self.text += new
    return new
