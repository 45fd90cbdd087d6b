"""AdamW with linear warmup, cosine decay, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

import jax
import optax

from atlas_jax.config import TrainConfig

# Norm scales and biases are not decayed: shrinking them toward 0 only distorts the model.
_NO_DECAY_LEAVES = {"scale", "bq", "bk", "bv"}


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
  """A pytree of bools like `params`: True where weight decay applies."""

  def leaf_name(path) -> str:
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    names = [n for n in names if isinstance(n, str) and n != "value"]
    return names[-1] if names else ""

  return jax.tree_util.tree_map_with_path(lambda p, _: leaf_name(p) not in _NO_DECAY_LEAVES, params)


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
