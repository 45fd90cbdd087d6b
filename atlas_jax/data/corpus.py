"""Training text available on every machine: the Python standard library's own source.

Files are listed in sorted relative-path order so a run is reproducible on a given Python version.
Any folder of text files or a JSONL file with a "text" field works the same way.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

_SKIP_DIRS = {
  "site-packages",
  "test",
  "tests",
  "idlelib",
  "lib2to3",
  "__pycache__",
  "turtledemo",
  "dist-packages",
  # Tables and prose rather than code (a fifth of the bytes: codec charmaps, pydoc's topics):
  # a small model trained for minutes learns to write Python faster without them.
  "encodings",
  "pydoc_data",
}


def stdlib_root() -> Path:
  return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
  """The standard library's .py files (tests and vendored packages excluded), in a fixed order."""
  root = stdlib_root()
  files = []
  for folder, dirs, names in os.walk(root):
    dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]  # never descend into site-packages
    files += [Path(folder) / n for n in names if n.endswith(".py")]
  return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def source_files(source: str = "stdlib") -> list[Path]:
  """The files a data source reads, in the order their documents come."""
  if source == "stdlib":
    return stdlib_files()
  path = Path(source)
  if path.is_file() and path.suffix == ".jsonl":
    return [path]
  if path.is_dir():
    return sorted(q for q in path.rglob("*") if q.is_file())
  raise ValueError(
    f"data.source={source!r}: expected 'stdlib', a folder of text files or a .jsonl file"
  )


def iter_json_objects(path: Path) -> Iterator[tuple[int, dict]]:
  """(line number, object) per non-blank line of a JSONL file of objects.

  Raises:
    ValueError naming the file, the line and what is wrong with it.
  """
  with Path(path).open("rb") as f:
    for i, raw in enumerate(f, 1):
      where = f"{path}:{i}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (byte {e.start} of the line)") from None
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
      if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
      yield i, record


def iter_jsonl(path: Path, field: str = "text") -> Iterator[tuple[str, str]]:
  """(name "file:line", value) per non-blank line of a JSONL file whose objects carry a string
  `field`.

  Raises:
    ValueError naming the file, the line and what is wrong with it.
  """
  for i, record in iter_json_objects(path):
    yield f"{Path(path).name}:{i}", string_field(record, field, f"{path}:{i}")


def string_field(record: dict, key: str, where: str) -> str:
  """record[key], or a ValueError at `where` (file:line) when it is missing or not a string."""
  if key not in record:
    raise ValueError(f"{where}: the object has no {key!r} field (fields: {sorted(record)})")
  value = record[key]
  if not isinstance(value, str):
    raise ValueError(
      f"{where}: field {key!r} must be a string, got {type(value).__name__} {value!r:.40}"
    )
  return value


def iter_documents(source: str = "stdlib") -> Iterator[tuple[str, str]]:
  """(name, text) pairs from "stdlib", a folder of text files, or a .jsonl file."""
  files = source_files(source)
  if source == "stdlib":
    root = stdlib_root()
    for p in files:
      yield p.relative_to(root).as_posix(), p.read_text(encoding="utf-8", errors="replace")
    return
  path = Path(source)
  if path.is_file():
    yield from iter_jsonl(path)
    return
  for p in files:
    yield p.relative_to(path).as_posix(), p.read_text(encoding="utf-8", errors="replace")
