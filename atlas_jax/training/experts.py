"""Load balancing for mixture-of-experts training: the auxiliary losses, DeepSeek-V3's selection
bias update, and the load metrics.

* `train.moe_aux_loss`: the Switch Transformer / Mixtral load-balancing loss per MoE layer,
  E * sum_e f_e P_e (f_e: the share of the step's assignments expert e took; P_e: its mean
  routing probability), 1.0 when the load is even; its gradient pushes probability away from the
  experts that took more than their share. Averaged over layers.
* `train.moe_z_loss`: ST-MoE's router z-loss, the mean of logsumexp(router logits)^2, which keeps
  the logits small (a large logit makes the softmax, and the routing, brittle in low precision).
* `train.moe_bias_update_rate` (gamma): DeepSeek-V3's auxiliary-loss-free balancing. After each
  step, every expert's selection bias moves by gamma towards balance: up when it took fewer
  assignments than the mean, down when more (b_e += gamma * sign(mean load - load_e)). The bias
  is a `RouterBias` variable, outside the gradient and the optimizer, saved with the parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax.model.moe import RouterBias, RouterStats

Array = jax.Array

COUNTS = "moe_counts"  # aux key: f32[L_moe, E] assignments per expert; the step pops it


def router_terms(
  stats: RouterStats | None, *, aux_loss: float, z_loss: float
) -> tuple[Array, dict]:
  """(what the routers add to the loss, their aux entries) for stats stacked [L_moe, ...]:
  aux_loss x the balance loss + z_loss x the router z-loss (train.moe_aux_loss, moe_z_loss)."""
  if stats is None:
    return jnp.zeros((), jnp.float32), {}
  balance = jnp.mean(stats.balance_loss())
  z = jnp.mean(stats.z_loss)
  aux = {"moe_balance_loss": balance, "moe_z_loss": z, "moe_dropped": jnp.sum(stats.dropped)}
  aux[COUNTS] = stats.counts_E
  return aux_loss * balance + z_loss * z, aux


def load_metrics(counts_LE: Array, dropped: Array) -> dict[str, Array]:
  """Scalars for the log: the busiest expert's tokens over the mean (1.0: even; the worst layer),
  the mean tokens per expert, and the share of assignments the capacity limit dropped."""
  mean_L = jnp.mean(counts_LE, axis=-1)
  return {
    "moe_load_max": jnp.max(jnp.max(counts_LE, axis=-1) / jnp.maximum(mean_L, 1e-9)),
    "moe_tokens_per_expert": jnp.mean(mean_L),
    "moe_dropped": dropped / jnp.maximum(jnp.sum(counts_LE), 1.0),
  }


def update_router_bias(frozen: nnx.State, counts_LE: Array, rate: float) -> nnx.State:
  """The non-trainable state with the trunk's selection biases stepped towards balance.

  Args:
    frozen: what the optimizer does not update (`atlas_jax.training.step.split_trainable`);
      the MoE stack's `RouterBias` is [L_moe, E], in the order of the router stats.
    counts_LE: f32[L_moe, E] assignments per expert this step.
  """
  if rate == 0:
    return frozen

  def step(path, v):
    if not isinstance(v, RouterBias) or path[0] != "blocks":
      return v
    gap_LE = jnp.mean(counts_LE, axis=-1, keepdims=True) - counts_LE
    return v.replace(v[...] + rate * jnp.sign(gap_LE))

  return nnx.map_state(step, frozen)
