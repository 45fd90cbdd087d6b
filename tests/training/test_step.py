"""The train step: learning, gradient accumulation, precision, loss scaling, NaN skipping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from atlas_jax.training.checkpoint import single_device_mesh
from atlas_jax.training.step import make_train_step, make_trainer

from .common import batches, tiny_config


def run(cfg, data):
  trainer = make_trainer(cfg, mesh=single_device_mesh())
  step = make_train_step(trainer)
  state = trainer.init(jax.random.key(0))
  losses = []
  for b in data:
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  return state, losses


def test_loss_decreases_on_a_repeated_batch():
  cfg = tiny_config()
  _, losses = run(cfg, batches(1) * 12)
  assert losses[-1] < losses[0] - 1.0  # memorising one batch: well below ln(64) = 4.16


def test_grad_accumulation_equals_the_full_batch():
  data = batches(3)
  _, full = run(tiny_config(), data)
  _, accum = run(tiny_config("train.grad_accum=4"), data)
  np.testing.assert_allclose(accum, full, rtol=1e-5)


def test_bf16_keeps_float32_master_weights_and_tracks_fp32():
  data = batches(4)
  state, bf16 = run(tiny_config("train.precision=bf16"), data)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
  assert all(
    x.dtype == jnp.float32
    for x in jax.tree.leaves(state.opt_state)
    if hasattr(x, "dtype") and x.ndim > 0
  )
  _, fp32 = run(tiny_config(), data)
  np.testing.assert_allclose(bf16, fp32, rtol=3e-2)


def test_master_weights_keep_small_updates():
  """0.5 + 1e-6 rounds back to 0.5 in bf16 parameters, but accumulates in float32 masters."""
  update = jnp.full((4,), 1e-4, jnp.float32) / 100  # 1e-6 per step
  p_bf16 = jnp.full((4,), 0.5, jnp.bfloat16)
  p_f32 = jnp.full((4,), 0.5, jnp.float32)
  for _ in range(100):
    p_bf16 = optax.apply_updates(p_bf16, update.astype(jnp.bfloat16))
    p_f32 = optax.apply_updates(p_f32, update)
  assert float(p_bf16[0]) == 0.5  # every update was lost
  np.testing.assert_allclose(p_f32, 0.5 + 1e-4, rtol=1e-4)


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
  cfg = tiny_config("train.precision=fp16", "train.loss_scale=1e30")
  trainer = make_trainer(cfg, mesh=single_device_mesh())
  step = make_train_step(trainer)
  state = trainer.init(jax.random.key(0))
  before = jax.tree.map(np.asarray, state.params)
  state, m = step(state, batches(1)[0])
  assert int(m["skipped"]) == 1
  assert float(state.loss_scale.scale) == pytest.approx(5e29)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), before)
  # A sane scale trains normally.
  cfg = tiny_config("train.precision=fp16")
  _, losses = run(cfg, batches(1) * 8)
  assert losses[-1] < losses[0]


def test_nan_batch_is_skipped_when_asked():
  cfg = tiny_config("train.on_nan=skip", "model.vocab_size=64")
  trainer = make_trainer(cfg, mesh=single_device_mesh())
  step = make_train_step(trainer)
  state = trainer.init(jax.random.key(0))
  before = jax.tree.map(np.asarray, state.params)
  # Poison one parameter so the loss is NaN.
  poisoned = jax.tree.map(lambda x: x, state.params)
  scale = poisoned["final_norm"]["scale"]
  scale.set_value(jnp.full_like(scale[...], jnp.nan))
  state = state.replace(params=poisoned)
  state, m = step(state, batches(1)[0])
  assert int(m["skipped"]) == 1 and not np.isfinite(float(m["loss"]))
  np.testing.assert_array_equal(state.params["embed"][...], before["embed"])


def test_nonfinite_step_is_recorded_and_leaves_the_state_clean():
  """on_nan=stop (default): the bad step does not update; its number is kept for the host."""
  trainer = make_trainer(tiny_config(), mesh=single_device_mesh())
  step = make_train_step(trainer)
  state = trainer.init(jax.random.key(0))
  state, _ = step(state, batches(1)[0])
  assert int(state.first_nonfinite) == 0
  scale = state.params["final_norm"]["scale"]
  scale.set_value(jnp.full_like(scale[...], jnp.inf))
  before = np.asarray(state.params["embed"][...])
  state, m = step(state, batches(2)[1])
  assert int(state.first_nonfinite) == 2 and int(m["skipped"]) == 1
  np.testing.assert_array_equal(state.params["embed"][...], before)


def test_mtp_models_report_the_next_token_loss_alone():
  """`loss` and the eval loss are the next-token cross-entropy of the main head, not the MTP
  objective; the objective and each head's loss are reported beside it."""
  from flax import nnx

  from atlas_jax.training.loss import cross_entropy
  from atlas_jax.training.step import make_eval_step

  cfg = tiny_config("model.mtp.n_predict=2", "model.mtp.loss_weight=0.5", "train.z_loss=1e-3")
  trainer = make_trainer(cfg, mesh=single_device_mesh())
  state = trainer.init(jax.random.key(0))
  (batch,) = batches(1)
  model = nnx.merge(trainer.graphdef, state.params)
  tokens = jnp.asarray(batch["tokens"])
  want, _ = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
  np.testing.assert_allclose(make_eval_step(trainer)(state.params, batch), want, rtol=1e-5)
  _, m = make_train_step(trainer)(state, batch)
  np.testing.assert_allclose(m["loss"], want, rtol=1e-5)
  objective = m["loss"] + 0.5 * (m["loss_mtp_1"] + m["loss_mtp_2"]) / 2
  np.testing.assert_allclose(m["loss_total"], objective, rtol=1e-5)
