"""atlas_jax.training."""
