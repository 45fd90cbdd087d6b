"""`python -m atlas_jax.plan`: the planner's command line (`atlas_jax.plan.cli`)."""

from atlas_jax.plan.cli import main

if __name__ == "__main__":
  raise SystemExit(main())
