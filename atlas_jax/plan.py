"""`python -m atlas_jax.plan`: the planner's command line (`atlas_jax.analysis.cli`)."""

from atlas_jax.analysis.cli import main

if __name__ == "__main__":
  raise SystemExit(main())
