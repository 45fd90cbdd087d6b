"""The training input pipeline: a token file on disk, packed sequences, and a grain dataset.

1. The corpus is tokenised once and stored as `.npy` token files (memory-mapped afterwards), keyed
   by the source, tokenizer and split, and checked against the source files' content.
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
import os
import sys
from pathlib import Path

import grain
import numpy as np

from atlas_jax.config import DataConfig
from atlas_jax.data import supervised
from atlas_jax.data.corpus import iter_documents, source_files
from atlas_jax.data.dataset import held_out, tokenize_corpus
from atlas_jax.data.tokenizer import HFTokenizer, Tokenizer, bpe_size, load_tokenizer, train_bpe


def tokenizer_for(cfg: DataConfig, cache_dir: str | Path) -> Tokenizer:
  """The tokenizer `cfg.tokenizer` names: "byte", a tokenizer.json, or "bpe:N", a byte-level
  BPE of N tokens trained on the train split of `cfg.source` (seconds; kept in `cache_dir`,
  keyed by the source's content, so later runs load it)."""
  n = bpe_size(cfg.tokenizer)
  if n is None:
    return load_tokenizer(cfg.tokenizer)
  files = source_files(cfg.source)
  key = hashlib.sha256(f"{_sha256(files)} {n} {cfg.eval_fraction}".encode()).hexdigest()[:16]
  path = Path(cache_dir) / f"bpe-{n}-{key}.json"
  if path.is_file():
    return HFTokenizer.from_file(path)
  texts = (t for name, t in iter_documents(cfg.source) if not held_out(name, cfg.eval_fraction))
  tokenizer = train_bpe(texts, vocab_size=n)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes of one run may share the cache
  tokenizer.save(tmp)
  tmp.replace(path)
  return tokenizer


def _cache_key(cfg: DataConfig, tokenizer: Tokenizer, template=None) -> str:
  """Which corpus, tokenised how: the folder of its token files. What the files hold right now
  is checked against the folder's manifest (see `token_files`)."""
  spec: dict = {
    "source": str(Path(cfg.source).absolute()) if cfg.source != "stdlib" else "stdlib",
    "tokenizer": cfg.tokenizer,
    # The tokenizer's own content: a retrained tokenizer.json at the same path tokenises anew.
    "tokenizer_sha256": tokenizer.fingerprint(),
    "vocab": tokenizer.vocab_size,
    "eval_fraction": cfg.eval_fraction,
    "python": sys.version_info[:2],
  }
  if cfg.format != "text":  # examples: how they are rendered too
    spec.update(format=cfg.format, template=None if template is None else template.fingerprint())
  return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _sha256(files: list[Path]) -> str:
  h = hashlib.sha256()
  for f in files:
    h.update(f"{f}\0{f.stat().st_size}\0".encode())
    with f.open("rb") as data:
      while block := data.read(1 << 20):
        h.update(block)
  return h.hexdigest()


def _file_stats(files: list[Path]) -> list[list]:
  stats = [f.stat() for f in files]
  return [[str(f), s.st_size, s.st_mtime_ns] for f, s in zip(files, stats)]


def token_files(
  cfg: DataConfig, tokenizer: Tokenizer, cache_dir: str | Path, *, log=None, template=None
) -> dict[str, tuple[np.ndarray, ...]]:
  """{"train": (tokens, doc_starts), "eval": ...}, memory-mapped, tokenising on first use;
  supervised examples (data.format chat / completion, chats rendered with `template`) add a
  third array, the loss mask per token (`atlas_jax.data.supervised`).

  The token files are keyed by the source's content: a manifest records each source file's
  size and modification time and a hash of all of them. Unchanged sizes and times reuse the
  tokens without reading the source; otherwise the hash decides, so a changed file is
  tokenised again and a merely touched one is not. `log` (a print-like function) hears why.
  """
  folder = Path(cache_dir) / _cache_key(cfg, tokenizer, template)
  parts = ("tokens", "starts") if cfg.format == "text" else ("tokens", "starts", "mask")
  names = [f"{split}_{part}.npy" for split in ("train", "eval") for part in parts]
  files = source_files(cfg.source)
  stats = _file_stats(files)
  manifest_path = folder / "source.json"
  manifest = None
  if manifest_path.is_file() and all((folder / n).is_file() for n in names):
    try:
      manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
      manifest = None  # a damaged manifest: tokenise again
    if not isinstance(manifest, dict):
      manifest = None
  fresh = manifest is not None and manifest.get("files") == stats
  digest = None
  if not fresh:
    digest = _sha256(files)
    fresh = manifest is not None and manifest.get("sha256") == digest
    if manifest is not None and not fresh and log is not None:
      log(f"data: {cfg.source} changed since it was tokenised; tokenising it again")
  if not fresh:
    folder.mkdir(parents=True, exist_ok=True)
    manifest_path.unlink(missing_ok=True)  # until the new token files are all in place
    if cfg.format == "text":
      train, evals = tokenize_corpus(cfg.source, tokenizer, eval_fraction=cfg.eval_fraction)
      arrays = lambda c: (c.tokens, c.doc_starts)
    else:
      train, evals = supervised.tokenize_examples(
        cfg.source, cfg.format, tokenizer, template, eval_fraction=cfg.eval_fraction
      )
      arrays = lambda c: (c.tokens, c.starts, c.mask)
    for split, corpus in (("train", train), ("eval", evals)):
      for part, array in zip(parts, arrays(corpus)):
        tmp = folder / f".{split}_{part}.{os.getpid()}.tmp.npy"
        np.save(tmp, array)
        tmp.replace(folder / f"{split}_{part}.npy")  # atomic: a killed run leaves no half file
  if not fresh or manifest.get("files") != stats:
    tmp = folder / f".source.{os.getpid()}.tmp.json"
    tmp.write_text(json.dumps({"sha256": digest or manifest["sha256"], "files": stats}))
    tmp.replace(manifest_path)
  return {
    split: tuple(np.load(folder / f"{split}_{part}.npy", mmap_mode="r") for part in parts)
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
  if len(tokens) < seq_len + 1:
    raise ValueError(
      f"the train split has {len(tokens)} tokens ({len(doc_starts)} documents), fewer than "
      f"train.seq_len + 1 = {seq_len + 1}: add documents, or lower train.seq_len or "
      "data.eval_fraction"
    )
  return batched_rows(
    PackedSequences(tokens, doc_starts, seq_len),
    batch_size=batch_size,
    seed=seed,
    process_index=process_index,
    process_count=process_count,
  )


def batched_rows(
  rows, *, batch_size: int, seed: int, process_index: int = 0, process_count: int = 1
) -> grain.MapDataset:
  """Per-host batches of random-access `rows` (dicts of arrays), shuffled anew every epoch."""
  if batch_size % process_count:
    raise ValueError(
      f"train.batch_size={batch_size} must be divisible by the number of processes "
      f"({process_count})"
    )
  ds = grain.MapDataset.source(rows)
  ds = ds.shuffle(seed=seed).repeat()  # shuffled before repeat: a new order every epoch
  ds = ds[process_index::process_count]
  return ds.batch(batch_size // process_count, drop_remainder=True)


def eval_shortfall(
  tokens: np.ndarray, doc_starts: np.ndarray, *, seq_len: int, batch_size: int, eval_fraction: float
) -> str | None:
  """Why the eval split yields no batch (so there is no eval loss), or None when it yields one."""
  need = batch_size * seq_len + 1
  if eval_fraction == 0 or len(tokens) >= need:
    return None
  return (
    f"the eval split (data.eval_fraction={eval_fraction}) has {len(tokens)} tokens in "
    f"{len(doc_starts)} documents; one eval batch needs train.batch_size * train.seq_len + 1 = "
    f"{need}, so there is no eval loss. Add documents or raise data.eval_fraction"
  )


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
  rows = PackedSequences(tokens, doc_starts, seq_len)
  return _eval_batches(rows, batch_size, n_batches, process_index, process_count)


def _eval_batches(rows, batch_size, n_batches, process_index, process_count, *, pad=False):
  ds = grain.MapDataset.source(rows).batch(batch_size, drop_remainder=not pad)
  share = batch_size // process_count
  lo = process_index * share
  out = []
  for i in range(min(n_batches, len(ds))):
    batch = ds[i]
    short = batch_size - len(batch["tokens"])
    if short:  # the last, partial batch: rows of padding whose loss does not count
      batch = {
        k: np.concatenate([v, np.repeat(v[-1:] * 0, short, axis=0)]) for k, v in batch.items()
      }
    out.append({k: v[lo : lo + share] for k, v in batch.items()})
  return out


def eval_example_batches(
  rows, *, batch_size: int, n_batches: int, process_index: int = 0, process_count: int = 1
) -> list[dict[str, np.ndarray]]:
  """The eval batches of held-out example rows (`atlas_jax.data.supervised.PackedExamples`):
  every row up to n_batches batches, the last batch filled with rows whose loss does not count."""
  if n_batches == 0 or len(rows) == 0:
    return []
  return _eval_batches(rows, batch_size, n_batches, process_index, process_count, pad=True)
