"""atlas_jax.data."""
