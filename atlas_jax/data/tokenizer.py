"""Tokenisers that need no network: bytes, or a `tokenizers` BPE trained here or read from disk."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

MIN_BPE_VOCAB = 260


class Tokenizer(Protocol):
  vocab_size: int
  bos_id: int
  eos_id: int
  pad_id: int

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...

  def fingerprint(self) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, then <pad>, <bos>, <eos>. Lossless on any text."""

  vocab_size = 259
  pad_id, bos_id, eos_id = 256, 257, 258

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

  def fingerprint(self) -> str:
    return "byte"


class HFTokenizer:
  """A `tokenizers.Tokenizer` (tokenizer.json) behind the same small interface."""

  def __init__(
    self, tokenizer, *, bos: str | None = None, eos: str | None = None, pad: str | None = None
  ):
    self._tok = tokenizer
    self.vocab_size = tokenizer.get_vocab_size()

    def find(name, *candidates):
      for c in ([name] if name else []) + list(candidates):
        i = tokenizer.token_to_id(c)
        if i is not None:
          return i
      return -1

    self.bos_id = find(bos, "<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>")
    self.eos_id = find(
      eos, "<|end_of_text|>", "<|eot_id|>", "</s>", "<eos>", "<|endoftext|>", "<|im_end|>"
    )
    self.pad_id = find(pad, "<pad>", "<|pad|>")

  @classmethod
  def from_file(cls, path: str | Path) -> HFTokenizer:
    from tokenizers import Tokenizer as _Tokenizer

    return cls(_Tokenizer.from_file(str(path)))

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def save(self, path: str | Path) -> None:
    self._tok.save(str(path))

  def fingerprint(self) -> str:
    """A hash of the whole tokenizer (vocabulary, merges, normalisation): equal means equal ids."""
    return hashlib.sha256(self._tok.to_str().encode()).hexdigest()


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
  """A byte-level BPE trained on `texts` with the `tokenizers` library (seconds on a few MB)."""
  from tokenizers import Tokenizer as _Tokenizer
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = _Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=["<pad>", "<s>", "</s>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(texts, trainer)
  return HFTokenizer(tok, bos="<s>", eos="</s>", pad="<pad>")


def bpe_size(spec: str) -> int | None:
  """N for a "bpe:N" spec (a BPE of N tokens to train on the data), else None."""
  if not spec.startswith("bpe:"):
    return None
  n = spec.removeprefix("bpe:")
  if not n.isdigit() or int(n) < MIN_BPE_VOCAB:
    raise ValueError(
      f"data.tokenizer={spec!r}: expected bpe:N with an integer N >= {MIN_BPE_VOCAB} "
      "(256 bytes, 3 special tokens, at least one merge)"
    )
  return int(n)


def load_tokenizer(spec: str) -> Tokenizer:
  """ "byte", a tokenizer.json file, or a folder holding one ("bpe:N" is trained on the data:
  see `atlas_jax.data.pipeline.tokenizer_for`)."""
  if spec == "byte":
    return ByteTokenizer()
  if bpe_size(spec) is not None:
    raise ValueError(f"data.tokenizer={spec!r} is trained on the data, not loaded from a file")
  path = Path(spec)
  if path.is_dir():
    path = path / "tokenizer.json"
  if not path.is_file():
    raise ValueError(
      f"data.tokenizer={spec!r}: expected 'byte', 'bpe:N' or a path to a tokenizer.json"
    )
  return HFTokenizer.from_file(path)
