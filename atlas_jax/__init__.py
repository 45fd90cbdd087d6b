"""atlas_jax."""
