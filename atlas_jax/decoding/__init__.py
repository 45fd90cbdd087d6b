"""Decoding: samplers and generation loops."""

from atlas_jax.decoding.generate import generate
from atlas_jax.decoding.sampling import SamplingParams, sample

__all__ = ["SamplingParams", "generate", "sample"]
