"""Imports run one way: no module, and no package, imports one that imports it back.

The graph is read from the source with `ast` (every `import` and `from ... import`, inside
functions too: a lazy import is still a dependency), over `atlas_jax/`. A parent package's own
`__init__` is not counted as a dependency of its children (Python runs it first, but it only
re-exports), and the top-level `atlas_jax/__init__.py`, the curated public API that imports
everything, is left out of the package graph.
"""

import ast
import importlib.metadata
from pathlib import Path

ROOT = Path(__file__).parents[1]
SOURCES = {"atlas_jax": ROOT / "atlas_jax"}


def modules() -> dict[str, Path]:
  """Every module's dotted name -> its file (a package is its __init__.py)."""
  out = {}
  for prefix, folder in SOURCES.items():
    for path in sorted(folder.rglob("*.py")):
      parts = list(path.relative_to(folder).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts.pop()
      out[".".join([prefix, *parts])] = path
  return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
  """The project modules `name` imports (resolved to the deepest module that exists)."""
  is_package = path.name == "__init__.py"
  package = name if is_package else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      targets = [f"{base}.{a.name}" for a in node.names]
    else:
      continue
    for target in targets:
      while target and target not in known:
        target = target.rpartition(".")[0]
      if target and target != name and not name.startswith(target + "."):
        found.add(target)
  return found


def graph() -> dict[str, set[str]]:
  known = modules()
  return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one node (Tarjan), each sorted."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in edges.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return sorted(out)


def package_of(module: str) -> str:
  """atlas_jax.training.step -> atlas_jax.training; atlas_jax.config stays itself."""
  return ".".join(
    module.split(".")[:3] if module.startswith("atlas_jax.kernels") else module.split(".")[:2]
  )


def package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
  out: dict[str, set[str]] = {}
  for src, targets in edges.items():
    if src == "atlas_jax":
      continue
    a = package_of(src)
    for t in targets:
      b = package_of(t)
      if b != a and t != "atlas_jax":
        out.setdefault(a, set()).add(b)
  return out


def test_the_graph_sees_real_imports():
  edges = graph()
  assert "atlas_jax.model.block" in edges["atlas_jax.model.transformer"]
  assert "atlas_jax.model.block" in edges["atlas_jax.model.mtp"]
  assert "atlas_jax.kernels" in edges["atlas_jax.model.attention"]
  assert "atlas_jax.model.transformer" in edges["atlas_jax.model"]
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_one_that_imports_it_back():
  assert cycles(graph()) == []


def test_no_package_imports_one_that_imports_it_back():
  assert cycles(package_graph(graph())) == []


def test_nothing_at_the_root_shadows_an_installed_package():
  """A program run from the repository root has the root first on `sys.path`, so a package or
  module there named like an installed one hides it: a top-level `kernels/` once hid Hugging
  Face's `kernels`, which transformers imports."""
  installed = importlib.metadata.packages_distributions()
  assert "jax" in installed  # the table is read, not empty
  importable = [p.stem for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()]
  shadowing = {
    name: installed[name]
    for name in importable
    if name in installed and set(installed[name]) != {"atlas-jax"}
  }
  assert importable and not shadowing


def test_serving_a_folder_does_not_import_orbax():
  """serve.py imports no checkpoint library until it reads a run's steps: orbax (and tensorstore)
  stay resident once imported, and a server of a Hugging Face folder never needs them."""
  import subprocess
  import sys

  code = (
    "import sys, logging; logging.basicConfig(); import serve; "
    "print(sorted(m for m in ('orbax', 'tensorstore') if m in sys.modules)); "
    "from atlas_jax.training import checkpoint; checkpoint._orbax(); "
    "print(len(logging.getLogger().handlers))"
  )
  out = subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
  ).stdout.split("\n")
  assert out[0] == "[]", out
  assert out[1] == "1", "orbax's import added a second root handler"
