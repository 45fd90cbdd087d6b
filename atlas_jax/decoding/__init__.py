"""atlas_jax.decoding."""
