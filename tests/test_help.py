"""Every program's --help prints: train.py, serve.py, the package's `-m` programs, bench/*.py.

argparse builds the help only when asked, so a help string it cannot format (a bare "%") breaks
--help and nothing else. The programs run in this process as the interpreter runs them (`runpy`:
the file or module as `__main__`, its own argv), so their imports are the ones already made; the
bench programs, whose imports set up devices of their own, each run in a process, all at once.
"""

import ast
import contextlib
import io
import os
import runpy
import subprocess
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

# name -> (arguments after `python`, the source whose literal flags the help must show, flags
# the source builds from tables and so cannot be read off it).
PROGRAMS = {
  "train.py": (["train.py", "--help"], "train.py", ["--config", "--set"]),
  "serve.py": (
    ["serve.py", "--help"],
    "serve.py",
    ["--max-num-seqs", "--tensor-parallel-size", "--max-model-len", "--temperature"],
  ),
  "atlas_jax.plan": (["-m", "atlas_jax.plan", "--help"], "atlas_jax/plan/cli.py", []),
  "atlas_jax.hf": (["-m", "atlas_jax.hf", "--help"], None, ["export"]),
  "atlas_jax.hf export": (
    ["-m", "atlas_jax.hf", "export", "--help"],
    "atlas_jax/hf/__main__.py",
    [],
  ),
}
BENCH = sorted(p for p in (ROOT / "bench").glob("*.py") if "ArgumentParser(" in p.read_text())
# The bench programs' (each a process importing jax: under -m slow).
BENCH_PROGRAMS = {
  f"bench/{path.name}": ([f"bench/{path.name}", "--help"], f"bench/{path.name}", [])
  for path in BENCH
}


def defined_flags(source: Path) -> set[str]:
  """The --flags that `source` passes to add_argument as literals, less the hidden ones."""
  flags = set()
  for node in ast.walk(ast.parse(source.read_text())):
    if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
      continue
    hidden = any(
      k.arg == "help" and getattr(k.value, "attr", "") == "SUPPRESS" for k in node.keywords
    )
    names = [a.value for a in node.args if isinstance(a, ast.Constant)]
    if not hidden:
      flags.update(n for n in names if isinstance(n, str) and n.startswith("--"))
  return flags


def run_helps(programs: dict) -> dict[str, subprocess.CompletedProcess]:
  """Each program's --help, run in parallel against this tree (not an installed copy)."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  env["JAX_PLATFORMS"] = "cpu"  # --help needs no accelerator

  def run(args):
    cmd = [sys.executable, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

  with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
    results = pool.map(run, [args for args, _, _ in programs.values()])
    return dict(zip(programs, results))


def run_in_process(args: list[str]) -> subprocess.CompletedProcess:
  """`python *args` (a script under ROOT or `-m module`) run here as `__main__`: its exit status
  and what it printed. The help is wrapped at 80 columns, as in a process whose output is a
  pipe."""
  out, err = io.StringIO(), io.StringIO()
  saved = sys.argv, sys.path[:], os.environ.get("COLUMNS")
  os.environ["COLUMNS"] = "80"
  code = 0
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]  # runpy puts the module's file first, as python -m does
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
      else:
        sys.argv = [str(ROOT / args[0]), *args[1:]]
        sys.path.insert(0, str(ROOT))  # a script's folder leads sys.path
        runpy.run_path(str(ROOT / args[0]), run_name="__main__")
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else int(e.code is not None)
  except Exception:  # as the interpreter would: the traceback on stderr, status 1
    err.write(traceback.format_exc())
    code = 1
  finally:
    sys.argv, sys.path[:] = saved[0], saved[1]
    if saved[2] is None:
      os.environ.pop("COLUMNS", None)
    else:
      os.environ["COLUMNS"] = saved[2]
  return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def helps() -> dict[str, subprocess.CompletedProcess]:
  return {name: run_in_process(args) for name, (args, _, _) in PROGRAMS.items()}


@pytest.fixture(scope="module")
def bench_helps() -> dict[str, subprocess.CompletedProcess]:
  return run_helps(BENCH_PROGRAMS)


def test_every_argparse_bench_is_covered():
  assert len(BENCH) >= 20  # the glob found the bench programs, not an empty folder


def check_help(name: str, program, result) -> None:
  _, source, extra = program
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("usage:"), result.stdout[:500]
  expected = set(extra) | (defined_flags(ROOT / source) if source else set())
  assert expected, f"{name}: no flags to look for"
  missing = sorted(f for f in expected if f not in result.stdout)
  assert not missing, f"{name}: --help does not show {missing}"


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_help_prints_the_flags(name, helps):
  check_help(name, PROGRAMS[name], helps[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BENCH_PROGRAMS))
def test_bench_help_prints_the_flags(name, bench_helps):
  check_help(name, BENCH_PROGRAMS[name], bench_helps[name])
