"""README.md says what the code holds: the map's paths exist and its rows stay short, every
--flag it names is in its program's --help, and its test command is the one CI runs.

A flag belongs to the program invoked before it in the same paragraph (`serve.py --port`,
`python -m atlas_jax.hf export --out`), else to its section's programs (a flag in "Serving"
is serve.py's). Each program's --help runs once, in this process as the interpreter runs it
(tests/test_help.py's `run_in_process`), against this tree.
"""

import functools
import re
from pathlib import Path

from tests.test_help import run_in_process

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

# program -> the arguments after `python` that print its --help; None: flags not checked here
# (the bench programs' own --help is tests/test_help.py's).
HELP_ARGS = {
  "serve.py": ["serve.py", "--help"],
  "train.py": ["train.py", "--help"],
  "atlas_jax.plan": ["-m", "atlas_jax.plan", "--help"],
  "atlas_jax.hf export": ["-m", "atlas_jax.hf", "export", "--help"],
  "atlas_jax.data.synthetic": ["-m", "atlas_jax.data.synthetic", "--help"],
  "bench": None,
}
# How the README invokes a program: its name, perhaps a subcommand, then a flag.
INVOCATION = re.compile(
  r"(?:python\s+(?:-m\s+)?)?"
  r"(?P<name>serve\.py|train\.py|atlas-plan|atlas_jax\.plan|atlas_jax\.hf export"
  r"|atlas_jax\.data\.synthetic|bench/\w+\.py)"
  r"(?=(?:\s+[a-z_]+)?\s+-)"
)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# The programs a section's flags belong to when no invocation precedes them; other sections:
# any program's.
SECTIONS = {
  "Training": ("train.py",),
  "Fine-tuning": ("train.py", "atlas_jax.hf export", "atlas_jax.data.synthetic"),
  "Serving": ("serve.py",),
  "Planning": ("atlas_jax.plan",),
}
MAP_HEADING = "## Map of the code"
MAP_ROW_CHARS = 300  # one to three lines of a rendered table


def program_of(name: str) -> str:
  if name.startswith("bench/"):
    return "bench"
  return {"atlas-plan": "atlas_jax.plan"}.get(name, name)


def sections(text: str) -> list[tuple[str, str]]:
  """(heading, body) per `## ` section, the generated techniques table left out."""
  text = re.sub(r"<!-- techniques:start -->.*?<!-- techniques:end -->", "", text, flags=re.S)
  parts = re.split(r"^## (.+)$", text, flags=re.M)
  return list(zip(parts[1::2], parts[2::2]))


def paragraphs(body: str) -> list[str]:
  """Prose paragraphs and table blocks (split at blank lines), and each code-block line alone."""
  out = []
  for i, chunk in enumerate(re.split(r"^```.*$", body, flags=re.M)):
    out += chunk.splitlines() if i % 2 else re.split(r"\n\s*\n", chunk)
  return out


def flag_mentions() -> list[tuple[str, tuple[str, ...], str]]:
  """(flag, the programs it may belong to, where) for every --flag the README names."""
  mentions = []
  for heading, body in sections(README):
    default = SECTIONS.get(heading, tuple(p for p, args in HELP_ARGS.items() if args))
    for para in paragraphs(body):
      invoked = [(m.start(), program_of(m.group("name"))) for m in INVOCATION.finditer(para)]
      for flag in FLAG.finditer(para):
        before = [program for start, program in invoked if start < flag.start()]
        programs = (before[-1],) if before else default
        if "bench" not in programs:
          mentions.append((flag.group(), programs, f"{heading}: {para.strip()[:80]!r}"))
  return mentions


@functools.cache
def help_text(program: str) -> str:
  result = run_in_process(HELP_ARGS[program])
  assert result.returncode == 0, f"{program} --help: {result.stderr[-2000:]}"
  return result.stdout


def in_help(flag: str, program: str) -> bool:
  return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text(program)) is not None


def map_rows() -> list[list[str]]:
  """The map's table rows, as lists of cells (the header and its rule left out)."""
  body = README.split(MAP_HEADING, 1)[1].split("\n## ", 1)[0]
  lines = [line for line in body.splitlines() if line.startswith("|")]
  return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]


def test_map_paths_exist():
  rows = map_rows()
  assert len(rows) >= 15, "the map has lost its rows"
  for row in rows:
    paths = re.findall(r"`([^`]+)`", row[0])
    assert paths, f"a map row names no path: {row[0]!r}"
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"the map names paths that do not exist: {missing}"


def test_map_rows_are_short():
  body = README.split(MAP_HEADING, 1)[1].split("\n## ", 1)[0]
  long = [line[:60] for line in body.splitlines() if len(line) > MAP_ROW_CHARS]
  assert not long, f"map rows over {MAP_ROW_CHARS} characters: {long}"


def test_flags_are_in_help():
  mentions = flag_mentions()
  seen = {program for _, programs, _ in mentions if len(programs) == 1 for program in programs}
  assert {"serve.py", "train.py", "atlas_jax.plan"} <= seen, seen  # the parser found them
  missing = [
    (flag, programs, where)
    for flag, programs, where in mentions
    if not any(in_help(flag, program) for program in programs)
  ]
  assert not missing, f"flags the README names that no --help shows: {missing}"


def test_test_command_is_what_ci_runs():
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  runs = [line for line in ci if line.endswith("python -m pytest")]
  assert len(runs) == 1, ".ci/run: expected one line that runs `python -m pytest`"
  assert runs[0] in README.splitlines(), f"README lacks CI's command: {runs[0]}"
