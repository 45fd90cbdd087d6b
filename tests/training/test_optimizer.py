"""`training.optimizer.adamw` against optax's clipping and AdamW chain, step by step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from atlas_jax.config import TrainConfig
from atlas_jax.training.optimizer import (
  AdamWState,
  decay_mask,
  learning_rate_schedule,
  make_optimizer,
)


def params_and_grads(seed=0):
  """An nnx.State of three Params, one without weight decay, and gradients for 5 steps."""
  rng = np.random.default_rng(seed)
  shapes = {"w": (8, 16), "u": (16, 4), "scale": (16,)}
  params = nnx.State(
    {
      name: nnx.Param(
        jnp.asarray(rng.standard_normal(s), jnp.float32), weight_decay=name != "scale"
      )
      for name, s in shapes.items()
    }
  )
  # Norms about 0.3-3 against a clip of 1: some steps clipped, some not.
  grads = [
    jax.tree.map(
      lambda p, k=k: jnp.asarray(rng.standard_normal(p.shape) * 0.1 * k, p.dtype), params
    )
    for k in (1, 5, 0.3, 3, 1)
  ]
  return params, grads


def optax_reference(cfg: TrainConfig):
  parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
  sched = learning_rate_schedule(cfg)
  adamw = optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask)
  return optax.chain(*parts, adamw)


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_updates_equal_optax_clipping_and_adamw(grad_clip):
  cfg = TrainConfig(steps=20, warmup_steps=2, learning_rate=1e-2, grad_clip=grad_clip)
  params, grads = params_and_grads()
  ours, theirs = make_optimizer(cfg), optax_reference(cfg)
  got, want = params, params
  ours_state, theirs_state = ours.init(params), theirs.init(params)
  update = jax.jit(ours.update)
  norms = [float(optax.tree.norm(g)) for g in grads]
  assert min(norms) < 1 < max(norms)  # both sides of the clip
  for i, g in enumerate(grads):
    # The norm passed in (as the train step does) on odd steps, computed inside on even ones.
    extra = {"grad_norm": optax.tree.norm(g)} if i % 2 else {}
    u, ours_state = update(g, ours_state, got, **extra)
    got = optax.apply_updates(got, u)
    u, theirs_state = theirs.update(g, theirs_state, want)
    want = optax.apply_updates(want, u)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
  assert int(ours_state.count) == len(grads)
  adam = theirs_state[-1][0]
  for a, b in zip(
    jax.tree.leaves((ours_state.mu, ours_state.nu)), jax.tree.leaves((adam.mu, adam.nu))
  ):
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-9)
  # With no gradient and no moments, only decay moves a parameter, and not the masked one.
  zero = jax.tree.map(jnp.zeros_like, params)
  u, _ = ours.update(zero, AdamWState(jnp.int32(3), zero, zero), params)
  rate = learning_rate_schedule(cfg)(3)
  np.testing.assert_allclose(u["w"][...], -rate * cfg.weight_decay * params["w"][...], rtol=1e-6)
  np.testing.assert_array_equal(u["scale"][...], 0.0)


def test_update_without_params_is_refused():
  cfg = TrainConfig()
  params, grads = params_and_grads()
  opt = make_optimizer(cfg)
  with pytest.raises(ValueError, match="needs params"):
    opt.update(grads[0], opt.init(params))
