"""Tokenised corpora as flat token arrays, with a deterministic train/eval split by document."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from atlas_jax.data.corpus import iter_documents
from atlas_jax.data.tokenizer import Tokenizer


@dataclasses.dataclass
class TokenCorpus:
  tokens: np.ndarray  # i32[n] documents concatenated, each followed by eos
  doc_starts: np.ndarray  # i64[d] offset of each document in `tokens`

  def __len__(self) -> int:
    return int(self.tokens.shape[0])


def held_out(name: str, fraction: float) -> bool:
  # A hash of the document's name, not its position, so adding files does not reshuffle the split.
  h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
  return h / 2**64 < fraction


def tokenize_corpus(
  source: str, tokenizer: Tokenizer, *, eval_fraction: float
) -> tuple[TokenCorpus, TokenCorpus]:
  """(train, eval) corpora; each document is followed by the tokenizer's eos id."""
  parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
  for name, text in iter_documents(source):
    ids = np.asarray(tokenizer.encode(text) + [tokenizer.eos_id], np.int32)
    parts[held_out(name, eval_fraction)].append(ids)

  def join(docs: list[np.ndarray]) -> TokenCorpus:
    if not docs:
      return TokenCorpus(np.zeros((0,), np.int32), np.zeros((0,), np.int64))
    lengths = np.asarray([len(d) for d in docs], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return TokenCorpus(np.concatenate(docs), starts)

  return join(parts[False]), join(parts[True])
