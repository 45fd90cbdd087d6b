"""atlas_jax.serving."""
