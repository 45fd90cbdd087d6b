"""Checkpoints restore onto another mesh; the big presets' per-device memory, by eval_shape."""

from pathlib import Path

import chex
import jax
import pytest
from jax.sharding import AbstractMesh

from atlas_jax.config import load_config
from atlas_jax.training import checkpoint
from atlas_jax.training import sharding as shd
from atlas_jax.training.step import make_train_step, make_trainer

from .common import batches, tiny_config

ROOT = Path(__file__).parents[2]


def test_restore_onto_a_different_mesh(tmp_path):
  saved_cfg = tiny_config("mesh.fsdp=8", "train.sharding=zero3")
  trainer = make_trainer(saved_cfg)
  step = make_train_step(trainer)
  state = trainer.init(jax.random.key(0))
  state, _ = step(state, batches(1)[0])
  mngr = checkpoint.manager(tmp_path)
  checkpoint.save(mngr, 1, state, {"step": 1, "data_index": 1})
  mngr.wait_until_finished()

  other = make_trainer(tiny_config("mesh.data=4", "mesh.fsdp=1", "mesh.tensor=2"))
  restored, meta = checkpoint.restore(mngr, other.abstract_state(), other.state_shardings)
  assert meta["data_index"] == 1
  chex.assert_trees_all_equal(jax.device_get(restored.params), jax.device_get(state.params))
  wq = restored.params["blocks"]["attn"]["wq"][...]
  assert wq.sharding.spec[2] == "tensor"  # laid out for the new mesh
  # Training continues on the new mesh.
  new_step = make_train_step(other)
  restored, m = new_step(restored, batches(2)[1])
  assert float(m["loss"]) > 0


@pytest.mark.parametrize(
  "preset, devices, max_gib", [("llama3-8b", 8, 16.0), ("llama3-70b", 64, 18.0)]
)
def test_big_presets_fit_per_device(preset, devices, max_gib):
  """Parameters + Adam state under zero3 (12 bytes/param in float32) split over the devices of an
  abstract mesh: nothing is allocated and no real devices are needed."""
  cfg = load_config(ROOT / "configs" / f"{preset}.yaml", ["train.sharding=zero3"])
  tensor = cfg.mesh.tensor
  sizes = {"fsdp": devices // tensor, "tensor": tensor}
  mesh = AbstractMesh(tuple(sizes.get(axis, 1) for axis in shd.AXES), shd.AXES)
  trainer = make_trainer(cfg, mesh=mesh)
  abstract = trainer.abstract_state()
  n = sum(x.size for x in jax.tree.leaves(abstract.params))
  per_device = shd.sharded_bytes(
    abstract.params, trainer.state_shardings.params
  ) + shd.sharded_bytes(abstract.opt_state, trainer.state_shardings.opt_state)
  assert per_device == pytest.approx(12 * n / devices, rel=0.01)
  assert per_device / 2**30 < max_gib
