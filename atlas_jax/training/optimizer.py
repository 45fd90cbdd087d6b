"""AdamW with linear warmup, cosine decay, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
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


class AdamWState(NamedTuple):
  count: jax.Array  # i32[], updates applied so far
  mu: Any  # first moments, shaped and laid out like the parameters
  nu: Any  # second moments


def adamw(
  learning_rate: optax.Schedule,
  *,
  b1: float,
  b2: float,
  weight_decay: float,
  mask: Callable[[Any], Any],
  max_norm: float = 0.0,
  eps: float = 1e-8,
) -> optax.GradientTransformationExtraArgs:
  """Global-norm clipping and AdamW in one transform, each leaf's update one expression.

  The arithmetic of `optax.chain(optax.clip_by_global_norm(max_norm), optax.adamw(...))`, to
  float rounding: the gradient scaled by min(1, max_norm / norm), the moments, the bias
  corrections, eps outside the square root, decoupled weight decay where `mask(params)` is True,
  the learning rate `learning_rate(count)` before this update is counted. Written so that every
  per-element factor is a scalar computed once (the clip factor and the bias corrections
  multiply, not divide), which lets XLA fuse each leaf into three passes (mu, nu, the update
  with its parameter) with nothing else materialised, where optax's chain writes each
  transformation's output to memory before the next reads it (`bench/cpu_micro.py --only adamw`
  times the two beside PyTorch's fused AdamW).

  `update(grads, state, params, grad_norm=None)`: `grad_norm` is the gradient's global norm if
  the caller has it (the train step computes it once for the finite check, the metric and here).

  Args:
    learning_rate: the schedule, step count -> rate.
    b1, b2: the moments' decay rates.
    weight_decay: the decoupled decay's rate (times the learning rate).
    mask: params -> a prefix tree of bools, True where decay applies.
    max_norm: clip the gradient's global norm to this; 0 for no clipping.
    eps: added to the second moment's square root.
  """

  def init(params):
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)
    return AdamWState(jnp.zeros([], jnp.int32), zeros(), zeros())

  def update(grads, state, params=None, *, grad_norm=None, **_):
    if params is None:
      raise ValueError("adamw: update(grads, state, params) needs params for the weight decay")
    if max_norm > 0:
      norm = optax.tree.norm(grads) if grad_norm is None else grad_norm
      clip = jnp.minimum(jnp.float32(1), max_norm / norm)
      grads = jax.tree.map(lambda g: g * clip.astype(g.dtype), grads)
    count = state.count + 1
    rate = learning_rate(state.count)
    t = count.astype(jnp.float32)
    correct_mu, correct_nu = 1 / (1 - jnp.float32(b1) ** t), 1 / (1 - jnp.float32(b2) ** t)
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), state.nu, grads)

    def leaf(decay, p, m, v):
      step = m * correct_mu / (jnp.sqrt(v * correct_nu) + eps)
      if decay:  # a Python bool per leaf: the mask is static
        step = step + weight_decay * p
      return (-rate * step).astype(p.dtype)

    # The mask is a prefix of the parameters (a bool where each Variable is), so its leaves meet
    # whole subtrees there, mapped leaf by leaf in turn.
    updates = jax.tree.map(
      lambda decay, *trees: jax.tree.map(functools.partial(leaf, decay), *trees),
      mask(params),
      params,
      mu,
      nu,
    )
    return updates, AdamWState(count, mu, nu)

  return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformationExtraArgs:
  """AdamW with clipping (`adamw`) on the run's schedule and hyperparameters."""
  return adamw(
    learning_rate_schedule(cfg),
    b1=cfg.b1,
    b2=cfg.b2,
    weight_decay=cfg.weight_decay,
    mask=decay_mask,
    max_norm=max(cfg.grad_clip, 0.0),
  )
