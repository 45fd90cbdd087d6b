"""The pure training step: (state, batch) -> (state, metrics), jitted with the state donated."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from atlas_jax.config import Config
from atlas_jax.model.transformer import Transformer
from atlas_jax.training.loss import cross_entropy
from atlas_jax.training.optimizer import learning_rate_schedule, make_optimizer

Array = jax.Array


@struct.dataclass
class TrainState:
  params: Any  # nnx.State of the model's Params
  opt_state: Any  # optax state for `params`
  step: Array  # i32[]


def init_state(
  cfg: Config, key: Array, *, implementation: str | None = None
) -> tuple[nnx.GraphDef, TrainState]:
  """Initialises model and optimizer under jit, so no unjitted copy of the weights is made."""
  graphdef = nnx.graphdef(
    nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0), implementation=implementation))
  )
  optimizer = make_optimizer(cfg.train)

  @jax.jit
  def init(key):
    params = nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(key), implementation=implementation))
    return TrainState(
      params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32)
    )

  return graphdef, init(key)


def loss_fn(graphdef: nnx.GraphDef, params, batch: dict[str, Array]) -> tuple[Array, dict]:
  """Cross-entropy of the model on batch["tokens"] i32[B, T + 1] (inputs and shifted targets)."""
  tokens_BT1 = batch["tokens"]
  inputs_BT, targets_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
  model = nnx.merge(graphdef, params)
  logits_BTV = model(
    inputs_BT, positions_BT=batch.get("positions"), segment_ids_BT=batch.get("segment_ids")
  )
  return cross_entropy(logits_BTV, targets_BT, batch.get("loss_mask"))


def make_train_step(cfg: Config, graphdef: nnx.GraphDef) -> Callable:
  """The jitted step; `state` is donated, so its buffers are reused for the new state."""
  optimizer = make_optimizer(cfg.train)
  schedule = learning_rate_schedule(cfg.train)

  def train_step(state: TrainState, batch: dict[str, Array]) -> tuple[TrainState, dict]:
    (loss, aux), grads = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)(
      graphdef, state.params, batch
    )
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
      "loss": loss,
      "grad_norm": optax.tree.norm(grads),
      "learning_rate": schedule(state.step),
      **aux,
    }
    return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

  return jax.jit(train_step, donate_argnums=0)


def make_eval_step(graphdef: nnx.GraphDef) -> Callable:
  @jax.jit
  def eval_step(params, batch):
    return loss_fn(graphdef, params, batch)[0]

  return eval_step
