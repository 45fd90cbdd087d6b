"""A model folder's tokenizer with the special tokens its files declare, as transformers reads
them (`atlas_jax.serving.model_files` says which files and in what order), and a train.py run's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from atlas_jax import hf
from atlas_jax.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from atlas_jax.hf import gguf_file


def read_json(path: Path) -> dict[str, Any] | None:
  """A JSON object file, or None when there is none; ValueError naming it when malformed."""
  if not path.is_file():
    return None
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(data, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
  return data


def token_text(value) -> str | None:
  """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def _ids(value, where: str) -> tuple[int, ...] | None:
  """An `eos_token_id` field: an id or a list of ids (None: absent)."""
  if value is None:
    return None
  ids = value if isinstance(value, list) else [value]
  if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
    raise ValueError(f"{where}={value!r} is not allowed: must be a token id or a list of them")
  return tuple(ids)


def eos_ids(folder: Path, tokenizer_config: dict | None, token_to_id) -> tuple[int, ...] | None:
  """The folder's eos ids in transformers' order of precedence (None: no file names any)."""
  for name in ("generation_config.json", "config.json"):
    data = read_json(folder / name) or {}
    ids = _ids(data.get("eos_token_id"), f"{folder / name} eos_token_id")
    if ids is not None:
      return ids
  eos = token_text((tokenizer_config or {}).get("eos_token"))
  if eos is not None and token_to_id(eos) is not None:
    return (token_to_id(eos),)
  return None


def load_tokenizer(folder: str | Path, vocab_size: int):
  """The tokenizer of a Hugging Face folder, with its special tokens as its files declare them
  (a byte-level model of 259 tokens without tokenizer.json: `ByteTokenizer`), or of a GGUF file,
  from its metadata as transformers builds it."""
  folder = Path(folder)
  if gguf_file.is_gguf(folder):
    parts = gguf_file.tokenizer_parts(folder)
    return HFTokenizer(
      parts["tokenizer"],
      bos=parts["bos"],
      eos=parts["eos"],
      pad=parts["pad"],
      eos_ids=parts["eos_ids"],
    )
  if not (folder / "tokenizer.json").is_file():
    if vocab_size != ByteTokenizer.vocab_size:
      raise ValueError(f"{folder}: no tokenizer.json beside the weights")
    return ByteTokenizer()
  raw = hf.load_tokenizer(folder)
  settings = read_json(folder / "tokenizer_config.json")
  names = {}
  if settings is not None:  # it declares them: an absent or null token is none
    names = {k: token_text(settings.get(f"{k}_token")) or "" for k in ("bos", "eos", "pad")}
  return HFTokenizer(raw, **names, eos_ids=eos_ids(folder, settings, raw.token_to_id))


def run_tokenizer(directory: str | Path, vocab_size: int) -> Tokenizer:
  """A train.py run's tokenizer (or a source's, train.init_from): a folder that kept a Hugging
  Face folder's tokenizer files reads them as `load_tokenizer` does, a run's own BPE is its
  tokenizer.json, a run without one is byte-level."""
  directory = Path(directory)
  if (directory / "tokenizer_config.json").is_file() or (directory / "config.json").is_file():
    return load_tokenizer(directory, vocab_size)
  if (directory / "tokenizer.json").is_file():
    return HFTokenizer.from_file(directory / "tokenizer.json")
  return ByteTokenizer()
