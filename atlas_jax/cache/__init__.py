"""atlas_jax.cache."""
