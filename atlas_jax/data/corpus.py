"""Training text available on every machine: the Python standard library's own source.

Files are listed in sorted relative-path order so a run is reproducible on a given Python version.
Any folder of text files or a JSONL file with a "text" field works the same way.
"""

from __future__ import annotations

import json
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
}


def stdlib_root() -> Path:
  return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
  """The standard library's .py files (tests and vendored packages excluded), in a fixed order."""
  root = stdlib_root()
  files = [
    p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
  ]
  return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def iter_documents(source: str = "stdlib") -> Iterator[tuple[str, str]]:
  """(name, text) pairs from "stdlib", a folder of text files, or a .jsonl file."""
  if source == "stdlib":
    root = stdlib_root()
    for p in stdlib_files():
      yield p.relative_to(root).as_posix(), p.read_text(encoding="utf-8", errors="replace")
    return
  path = Path(source)
  if path.is_file() and path.suffix == ".jsonl":
    with path.open(encoding="utf-8") as f:
      for i, line in enumerate(f):
        if line.strip():
          record = json.loads(line)
          if "text" not in record:
            raise ValueError(f"data.source={source!r}: line {i + 1} has no 'text' field")
          yield f"{path.name}:{i + 1}", record["text"]
    return
  if path.is_dir():
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
      yield p.relative_to(path).as_posix(), p.read_text(encoding="utf-8", errors="replace")
    return
  raise ValueError(
    f"data.source={source!r}: expected 'stdlib', a folder of text files or a .jsonl file"
  )
