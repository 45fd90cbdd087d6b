"""Decoding: samplers and generation loops."""

from atlas_jax.decoding.generate import SamplingParams, generate
from atlas_jax.decoding.sampling import sample

__all__ = ["SamplingParams", "generate", "sample"]
