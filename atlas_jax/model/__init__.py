"""atlas_jax.model."""
