"""The README's "What each technique buys" is the planner's current output, and every measured
figure it quotes is in BENCHMARKS.md."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from techniques import MEASURED, techniques_markdown  # noqa: E402


def test_readme_section_is_the_generated_table():
  readme = (ROOT / "README.md").read_text()
  start, end = "<!-- techniques:start -->\n", "\n<!-- techniques:end -->"
  assert start in readme and end in readme
  section = readme[readme.index(start) + len(start) : readme.index(end)]
  assert section == techniques_markdown(), "regenerate: python bench/techniques.py"


def test_quoted_measurements_are_in_benchmarks():
  benchmarks = (ROOT / "BENCHMARKS.md").read_text()
  for key, (_, numbers) in MEASURED.items():
    for number in numbers:
      assert number in benchmarks, (key, number)
