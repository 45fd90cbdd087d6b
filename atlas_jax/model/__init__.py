"""atlas_jax.model: one decoder for every family (Llama-style GQA, DeepSeek MLA, MTP heads).

model = atlas_jax.model.build(cfg, rngs=nnx.Rngs(0))
"""

from atlas_jax.model.transformer import Transformer, build

__all__ = ["Transformer", "build"]
