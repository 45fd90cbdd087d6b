"""FP8 matmuls for training (train.fp8): the projections multiply 8-bit operands (qwix's
quantized-training dot_general), the loss stays with the bf16 run's, and the step lowered for a
GPU carries e4m3 and e5m2 operands."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.config import ConfigError
from atlas_jax.model.layers import Ops, dense
from atlas_jax.training.step import make_train_step, make_trainer

from .common import batches, tiny_config


def test_fp8_dense_and_its_gradients_are_close_to_the_float_product():
  """Per-row and per-column e4m3 scaling forward, e5m2 gradients: within a few percent of the
  float32 product and gradients (e4m3 keeps 3 mantissa bits: a relative step of 2^-4 at most)."""
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (64, 32), jnp.float32)
  w = jax.random.normal(kw, (32, 48), jnp.float32) / 32**0.5
  dy = jax.random.normal(kg, (64, 48), jnp.float32)
  fp8 = Ops(fp8="current")
  y, vjp = jax.vjp(lambda x, w: dense(x, w, 1, fp8), x, w)
  dx, dw = vjp(dy)
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  assert rel(y, x @ w) < 0.05
  assert rel(dx, dy @ w.T) < 0.08  # e5m2 gradients: 2 mantissa bits
  assert rel(dw, x.T @ dy) < 0.08
  assert rel(y, x @ w) > 0  # the product really was quantized


def test_fp8_training_follows_the_bf16_run():
  """Five steps from the same init on one batch: every loss finite and within 3% of the bf16
  run's, and the run learns as bf16's does. The first step's loss is the forward's alone (within
  0.1%); the gap then grows as each run's updates compound (1.5% at the fifth step)."""
  losses = {}
  for fp8 in ("null", "current"):
    cfg = tiny_config("train.precision=bf16", f"train.fp8={fp8}")
    trainer = make_trainer(cfg)
    state, step = trainer.init(jax.random.key(0)), make_train_step(trainer)
    batch = batches(1)[0]
    losses[fp8] = []
    for _ in range(5):
      state, metrics = step(state, batch)
      losses[fp8].append(float(metrics["loss"]))
  bf16, fp8 = np.array(losses["null"]), np.array(losses["current"])
  assert np.isfinite(fp8).all()
  np.testing.assert_allclose(fp8[0], bf16[0], rtol=1e-3)
  np.testing.assert_allclose(fp8, bf16, rtol=0.03)
  assert fp8[-1] < fp8[0] - 0.1


def test_the_fp8_train_step_lowers_for_a_gpu_with_fp8_operands():
  cfg = tiny_config("train.precision=bf16", "train.fp8=current")
  trainer = make_trainer(cfg)
  state = jax.eval_shape(lambda: trainer.init(jax.random.key(0)))
  state = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, trainer.state_shardings
  )
  batch = {"tokens": jax.ShapeDtypeStruct((8, 17), jnp.int32)}
  text = make_train_step(trainer).trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()
  assert "f8E4M3FN" in text  # the forward operands (and the backward's saved ones)
  assert "f8E5M2" in text  # the gradients
  plain = tiny_config("train.precision=bf16")
  trainer = make_trainer(plain)
  text = make_train_step(trainer).trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()
  assert "f8E4M3FN" not in text  # bf16 stays the default


def test_fp8_scaling_is_named():
  with pytest.raises(ConfigError, match=r"train.fp8='delayed'.*current"):
    tiny_config("train.fp8=delayed")
