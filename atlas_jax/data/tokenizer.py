"""Tokenisers that need no network: bytes, or a `tokenizers` BPE trained here or read from disk."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

MIN_BPE_VOCAB = 260


class Tokenizer(Protocol):
  vocab_size: int
  bos_id: int  # -1: none
  eos_id: int  # the first of eos_ids (training appends it to each document); -1: none
  eos_ids: tuple[int, ...]  # every id that ends a generation
  pad_id: int
  bos_token: str | None  # the BOS token's text (a chat template's `bos_token`)

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

  def fingerprint(self) -> str: ...


def encode_prompt(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
  """A prompt's ids as serve.py encodes one: with the special tokens the tokenizer adds by
  default (a Llama's BOS); an empty text is the BOS alone, where the tokenizer has one."""
  ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
  return ids or ([tokenizer.bos_id] if tokenizer.bos_id >= 0 else [])


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, then <pad>, <bos>, <eos>. Lossless on any text. Runs trained
  on bytes never saw a BOS, so none is added; the special ids have no text."""

  vocab_size = 259
  pad_id, bos_id, eos_id = 256, 257, 258
  eos_ids = (258,)
  bos_token = eos_token = None

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

  def fingerprint(self) -> str:
    return "byte"

  def token_bytes(self) -> list[bytes | None]:
    """Per id, the bytes it stands for in decoded text; None for the special tokens."""
    return [bytes([i]) for i in range(256)] + [None, None, None]


# Names tried, in order, for a special token nothing declares (a bare tokenizer.json, such as a
# train.py run's BPE with <s> and </s>); a model folder's own files say which they are instead
# (`atlas_jax.serving.model_files`).
_GUESSES = {
  "bos": ("<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>"),
  "eos": ("<|end_of_text|>", "<|eot_id|>", "</s>", "<eos>", "<|endoftext|>", "<|im_end|>"),
  "pad": ("<pad>", "<|pad|>"),
}


class HFTokenizer:
  """A `tokenizers.Tokenizer` (tokenizer.json) behind the same small interface.

  Args:
    bos, eos, pad: the special tokens' text; "" for none. Not given (None): the first of the
      usual names the vocabulary holds.
    eos_ids: every id that ends a generation (default: the eos token's).

  `encode(text, add_special_tokens=True)` adds what the tokenizer's post-processor adds (a
  Llama tokenizer's BOS), as transformers' default encoding does; training encodes without.
  """

  def __init__(
    self,
    tokenizer,
    *,
    bos: str | None = None,
    eos: str | None = None,
    pad: str | None = None,
    eos_ids: Sequence[int] | None = None,
  ):
    self._tok = tokenizer
    self.vocab_size = tokenizer.get_vocab_size()

    def find(kind, name):
      for c in _GUESSES[kind] if name is None else (name,):
        i = tokenizer.token_to_id(c) if c else None
        if i is not None:
          return i
      return -1

    self.bos_id, eos_id, self.pad_id = find("bos", bos), find("eos", eos), find("pad", pad)
    self.eos_ids = tuple(eos_ids) if eos_ids else ((eos_id,) if eos_id >= 0 else ())
    self.eos_id = self.eos_ids[0] if self.eos_ids else -1
    token = lambda i: tokenizer.id_to_token(i) if i >= 0 else None
    self.bos_token, self.eos_token = (
      token(self.bos_id),
      token(eos_id if eos_id >= 0 else self.eos_id),
    )

  @classmethod
  def from_file(cls, path: str | Path) -> HFTokenizer:
    from tokenizers import Tokenizer as _Tokenizer

    return cls(_Tokenizer.from_file(str(path)))

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def save(self, path: str | Path) -> None:
    self._tok.save(str(path))

  def fingerprint(self) -> str:
    """A hash of the whole tokenizer (vocabulary, merges, normalisation): equal means equal ids."""
    return hashlib.sha256(self._tok.to_str().encode()).hexdigest()

  def token_bytes(self) -> list[bytes | None]:
    """Per id, the bytes it stands for in decoded text; None for special tokens and for tokens
    whose bytes cannot be told apart from their neighbours' (see below).

    Byte-level BPE (GPT-2, Llama 3, `train_bpe`) spells each byte as one printable character;
    SentencePiece-style vocabularies write spaces as U+2581 and raw bytes as `<0xAB>`. Anything
    else is decoded one token at a time, and tokens that decode to a partial character are left
    out (None).
    """
    decoder = json.loads(self._tok.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
    byte_of = {c: b for b, c in _byte_level_alphabet().items()}
    out: list[bytes | None] = []
    for i in range(self.vocab_size):
      piece = self._tok.id_to_token(i)
      if piece is None or i in special:
        out.append(None)
      elif "ByteLevel" in kinds:
        out.append(bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else None)
      elif "ByteFallback" in kinds or "Metaspace" in kinds:
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        out.append(bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode())
      else:
        text = self._tok.decode([i], skip_special_tokens=False)
        out.append(None if "\ufffd" in text else text.encode())
    return out


@functools.cache
def _byte_level_alphabet() -> dict[int, str]:
  """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
  printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
  table, extra = {}, 0
  for b in range(256):
    if b in printable:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


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
