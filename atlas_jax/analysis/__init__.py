"""atlas_jax.analysis."""
