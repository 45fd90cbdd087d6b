"""Mixed-precision policies: which dtype parameters live in, and which dtype the math runs in.

* fp32: everything float32.
* bf16: float32 master weights and optimizer state; the model casts them to bfloat16 at use, so
  matmuls and activations are bfloat16 while norms, softmax and the loss stay float32 (the model
  does those in float32 whatever the compute dtype). Gradients arrive in float32 through the cast.
* fp16: as bf16 with float16 compute, plus dynamic loss scaling: float16 has 5 exponent bits, so
  small gradients underflow to zero unless the loss is scaled up first. On overflow the update is
  skipped and the scale halved; after `growth_interval` good steps it doubles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from atlas_jax.config import ModelConfig

COMPUTE_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def training_model_config(model: ModelConfig, precision: str) -> ModelConfig:
  """The model config a run trains with: float32 master weights, compute in the policy's dtype."""
  if precision not in COMPUTE_DTYPE:
    raise ValueError(f"train.precision={precision!r} is not one of {tuple(COMPUTE_DTYPE)}")
  return dataclasses.replace(model, dtype=COMPUTE_DTYPE[precision], param_dtype="float32")


@struct.dataclass
class LossScale:
  scale: jax.Array  # f32[] multiplier applied to the loss before differentiation
  good_steps: jax.Array  # i32[] finite steps since the last change
  growth_interval: int = struct.field(pytree_node=False, default=200)

  @classmethod
  def create(cls, initial: float, growth_interval: int = 200) -> LossScale:
    return cls(jnp.float32(initial), jnp.int32(0), growth_interval)

  def unscale(self, grads):
    return jax.tree.map(lambda g: g / self.scale, grads)

  def update(self, grads_finite: jax.Array) -> LossScale:
    grow = grads_finite & (self.good_steps + 1 >= self.growth_interval)
    scale = jnp.where(
      grads_finite, jnp.where(grow, self.scale * 2, self.scale), jnp.maximum(self.scale / 2, 1.0)
    )
    good = jnp.where(grads_finite & ~grow, self.good_steps + 1, 0)
    return LossScale(scale, good.astype(jnp.int32), self.growth_interval)
