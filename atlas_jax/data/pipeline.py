"""The training input pipeline: a token file on disk, packed sequences, and a grain dataset.

1. The corpus is tokenised once and stored as `.npy` token files (memory-mapped afterwards), keyed
   by a hash of the source, tokenizer and split.
2. `PackedSequences` cuts the token stream into fixed windows of seq_len + 1 tokens; documents
   inside a window get their own segment ids (attention never crosses documents) and positions
   that restart at each document start.
3. A grain `MapDataset`: shuffled deterministically per epoch, repeated, split across hosts, and
   batched. It is random access, so the batch for step i is `dataset[i]`: the iterator state is
   the step, and a resumed run reads exactly the batches an uninterrupted run would have read.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import grain
import numpy as np

from atlas_jax.config import DataConfig
from atlas_jax.data.dataset import tokenize_corpus
from atlas_jax.data.tokenizer import Tokenizer


def _cache_key(cfg: DataConfig, tokenizer: Tokenizer) -> str:
  spec = {
    "source": str(Path(cfg.source).absolute()) if cfg.source != "stdlib" else "stdlib",
    "tokenizer": cfg.tokenizer,
    "vocab": tokenizer.vocab_size,
    "eval_fraction": cfg.eval_fraction,
    "python": sys.version_info[:2],
  }
  return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def token_files(
  cfg: DataConfig, tokenizer: Tokenizer, cache_dir: str | Path
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """{"train": (tokens, doc_starts), "eval": ...}, memory-mapped, tokenising on first use."""
  folder = Path(cache_dir) / _cache_key(cfg, tokenizer)
  names = [f"{split}_{part}.npy" for split in ("train", "eval") for part in ("tokens", "starts")]
  if not all((folder / n).is_file() for n in names):
    folder.mkdir(parents=True, exist_ok=True)
    train, evals = tokenize_corpus(cfg.source, tokenizer, eval_fraction=cfg.eval_fraction)
    for split, corpus in (("train", train), ("eval", evals)):
      for part, array in (("tokens", corpus.tokens), ("starts", corpus.doc_starts)):
        tmp = folder / f".{split}_{part}.tmp.npy"
        np.save(tmp, array)
        tmp.replace(folder / f"{split}_{part}.npy")  # atomic: a killed run leaves no half file
  return {
    split: (
      np.load(folder / f"{split}_tokens.npy", mmap_mode="r"),
      np.load(folder / f"{split}_starts.npy", mmap_mode="r"),
    )
    for split in ("train", "eval")
  }


class PackedSequences:
  """Random-access windows of seq_len + 1 tokens with segment ids and per-document positions."""

  def __init__(self, tokens: np.ndarray, doc_starts: np.ndarray, seq_len: int):
    if len(tokens) < seq_len + 1:
      raise ValueError(
        f"the corpus has {len(tokens)} tokens, fewer than train.seq_len + 1 = {seq_len + 1}"
      )
    self.tokens, self.doc_starts, self.seq_len = tokens, np.asarray(doc_starts), seq_len

  def __len__(self) -> int:
    return (len(self.tokens) - 1) // self.seq_len

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    T = self.seq_len
    start = int(i) * T
    tokens = np.asarray(self.tokens[start : start + T + 1], np.int32)
    index = np.arange(start, start + T)
    doc = np.searchsorted(self.doc_starts, index, side="right") - 1  # document of each input
    doc_start = np.maximum(self.doc_starts[np.maximum(doc, 0)], start)
    return {
      "tokens": tokens,  # i32[T + 1]
      "segment_ids": (doc - doc[0]).astype(np.int32),  # i32[T]
      "positions": (index - doc_start).astype(np.int32),  # i32[T]
    }


def train_dataset(
  tokens: np.ndarray,
  doc_starts: np.ndarray,
  *,
  seq_len: int,
  batch_size: int,
  seed: int,
  process_index: int = 0,
  process_count: int = 1,
) -> grain.MapDataset:
  """Per-host batches: element i is this host's share of the global batch for step i."""
  if batch_size % process_count:
    raise ValueError(
      f"train.batch_size={batch_size} must be divisible by the number of processes "
      f"({process_count})"
    )
  ds = grain.MapDataset.source(PackedSequences(tokens, doc_starts, seq_len))
  ds = ds.shuffle(seed=seed).repeat()  # shuffled before repeat: a new order every epoch
  ds = ds[process_index::process_count]
  return ds.batch(batch_size // process_count, drop_remainder=True)


def eval_batches(
  tokens: np.ndarray,
  doc_starts: np.ndarray,
  *,
  seq_len: int,
  batch_size: int,
  n_batches: int,
  process_index: int = 0,
  process_count: int = 1,
) -> list[dict[str, np.ndarray]]:
  """A fixed list of eval batches (the first windows of the held-out documents), this host's
  share of each: every process must take part in the sharded eval step."""
  if len(tokens) < seq_len + 1 or n_batches == 0:
    return []
  ds = grain.MapDataset.source(PackedSequences(tokens, doc_starts, seq_len))
  ds = ds.batch(batch_size, drop_remainder=True)
  share = batch_size // process_count
  lo = process_index * share
  return [{k: v[lo : lo + share] for k, v in ds[i].items()} for i in range(min(n_batches, len(ds)))]
