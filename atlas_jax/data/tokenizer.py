"""Tokenisers that need no network: bytes, or a `tokenizers` BPE trained here or read from disk."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
  vocab_size: int
  bos_id: int
  eos_id: int
  pad_id: int

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, then <pad>, <bos>, <eos>. Lossless on any text."""

  vocab_size = 259
  pad_id, bos_id, eos_id = 256, 257, 258

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


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


def bpe_vocab_size(spec: str) -> int | None:
  """N for a "bpe:N" spec (a BPE of N tokens trained on the run's corpus), else None."""
  if not spec.startswith("bpe:"):
    return None
  size = spec[4:]
  if not size.isdigit() or int(size) < 259:
    raise ValueError(
      f"data.tokenizer={spec!r}: 'bpe:N' needs an integer N >= 259 (256 bytes + 3 specials)"
    )
  return int(size)


def corpus_bpe(source: str, vocab_size: int, cache_dir: str | Path, *, eval_fraction: float):
  """A byte-level BPE of `vocab_size` tokens trained on the training documents of `source`
  (held-out documents are left out), cached in `cache_dir` and reused after the first run."""
  import hashlib
  import json
  import sys

  from atlas_jax.data.corpus import iter_documents
  from atlas_jax.data.dataset import held_out

  key = json.dumps([source, vocab_size, eval_fraction, sys.version_info[:2]])
  folder = Path(cache_dir) / f"bpe-{vocab_size}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
  path = folder / "tokenizer.json"
  if not path.is_file():
    texts = (t for name, t in iter_documents(source) if not held_out(name, eval_fraction))
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / ".tokenizer.tmp.json"
    train_bpe(texts, vocab_size).save(tmp)
    tmp.replace(path)  # atomic: a killed run leaves no half file
  return path


def load_tokenizer(
  spec: str,
  *,
  source: str = "stdlib",
  eval_fraction: float = 0.0,
  cache_dir: str | Path | None = None,
) -> Tokenizer:
  """ "byte", a tokenizer.json file, a folder holding one, or "bpe:N": a BPE of N tokens trained
  on the training documents of `source` (`corpus_bpe`, cached in `cache_dir`)."""
  if spec == "byte":
    return ByteTokenizer()
  n = bpe_vocab_size(spec)
  if n is not None:
    if cache_dir is None:
      raise ValueError(f"data.tokenizer={spec!r}: a trained BPE needs a cache folder")
    return HFTokenizer.from_file(corpus_bpe(source, n, cache_dir, eval_fraction=eval_fraction))
  path = Path(spec)
  if path.is_dir():
    path = path / "tokenizer.json"
  if not path.is_file():
    raise ValueError(
      f"data.tokenizer={spec!r}: expected 'byte', 'bpe:N' or a path to a tokenizer.json"
    )
  return HFTokenizer.from_file(path)
