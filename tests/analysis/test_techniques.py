"""The README's "What each technique buys" is the planner's current output, and every measured
figure it quotes is in BENCHMARKS.md."""

from pathlib import Path

from atlas_jax.analysis.techniques import MEASURED, techniques_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_readme_section_is_the_generated_table():
  readme = (ROOT / "README.md").read_text()
  start, end = "<!-- techniques:start -->\n", "\n<!-- techniques:end -->"
  assert start in readme and end in readme
  section = readme[readme.index(start) + len(start) : readme.index(end)]
  assert section == techniques_markdown(), "regenerate: python -m atlas_jax.analysis.techniques"


def test_quoted_measurements_are_in_benchmarks():
  benchmarks = (ROOT / "BENCHMARKS.md").read_text()
  for key, (_, numbers) in MEASURED.items():
    for number in numbers:
      assert number in benchmarks, (key, number)
