"""AdamW with linear warmup, cosine decay, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

import jax
import optax
from flax import nnx

from atlas_jax.config import TrainConfig


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
  warmup = min(cfg.warmup_steps, cfg.steps)
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=cfg.learning_rate,
    warmup_steps=warmup,
    decay_steps=max(cfg.steps, warmup + 1),
    end_value=cfg.learning_rate * cfg.min_lr_ratio,
  )


def decay_mask(params):
  """A pytree of bools, a prefix of `params`: True where weight decay applies.

  Read from each parameter's `weight_decay` tag (`atlas_jax.model.layers.param`): norm scales and
  biases are created with decay=False.
  """
  is_variable = lambda x: isinstance(x, nnx.Variable)
  return jax.tree.map(
    lambda v: bool(v.get_metadata().get("weight_decay", True)) if is_variable(v) else True,
    params,
    is_leaf=is_variable,
  )


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  parts = []
  if cfg.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip))
  parts.append(
    optax.adamw(
      learning_rate_schedule(cfg),
      b1=cfg.b1,
      b2=cfg.b2,
      weight_decay=cfg.weight_decay,
      mask=decay_mask,
    )
  )
  return optax.chain(*parts)
