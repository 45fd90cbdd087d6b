"""Sharding strategies on 8 fake CPU devices: same losses as one device, ZeRO's memory formulas."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import ConfigError, MeshConfig, MLAConfig, MTPConfig
from atlas_jax.training import sharding as shd
from atlas_jax.training.checkpoint import single_device_mesh
from atlas_jax.training.optimizer import decay_mask
from atlas_jax.training.step import make_train_step, make_trainer

from .common import batches, tiny_config

STRATEGIES = {
  "dp": ["mesh.data=8", "mesh.fsdp=1", "train.sharding=dp"],
  "zero1": ["mesh.fsdp=8", "train.sharding=zero1"],
  "zero2": ["mesh.fsdp=8", "train.sharding=zero2"],
  "zero3": ["mesh.fsdp=8", "train.sharding=zero3"],
  "tp": ["mesh.data=4", "mesh.fsdp=1", "mesh.tensor=2", "train.sharding=dp"],
  "fsdp_x_tp": ["mesh.fsdp=4", "mesh.tensor=2", "train.sharding=fsdp"],
}


def losses(cfg, mesh=None, steps=3):
  trainer = make_trainer(cfg, mesh=mesh)
  step = make_train_step(trainer)
  state = trainer.init(jax.random.key(0))
  out = []
  for b in batches(steps):
    state, m = step(state, b)
    out.append(float(m["loss"]))
  return out, state, trainer


@pytest.fixture(scope="module")
def single_device_losses():
  return losses(tiny_config(), mesh=single_device_mesh())[0]


# Pure data parallelism under -m slow: "tp" runs it on the data axis with the heads split too.
@pytest.mark.parametrize(
  "name", [pytest.param(n, marks=pytest.mark.slow) if n == "dp" else n for n in STRATEGIES]
)
def test_same_loss_trajectory_as_one_device(name, single_device_losses):
  got, state, trainer = losses(tiny_config(*STRATEGIES[name]))
  np.testing.assert_allclose(got, single_device_losses, rtol=1e-5)
  # The state really is laid out as the strategy says.
  wq = state.params["blocks"]["attn"]["wq"][...]
  spec = tuple(wq.sharding.spec) + (None,) * (wq.ndim - len(wq.sharding.spec))
  want_embed = "fsdp" if name in ("zero3", "fsdp_x_tp") else None
  want_heads = "tensor" if name in ("tp", "fsdp_x_tp") else None
  assert spec == (None, want_embed, want_heads, None), spec


def test_zero_memory_formulas():
  """Per-device bytes of params / grads / Adam state follow the ZeRO paper: Psi, Psi, 2 Psi
  (float32) under dp, and each stage divides one more of them by the 8 devices."""
  per_device = {}
  for name in ("dp", "zero1", "zero2", "zero3"):
    trainer = make_trainer(tiny_config(*STRATEGIES[name], "model.vocab_size=64"))
    abstract = trainer.abstract_state()
    per_device[name] = (
      shd.sharded_bytes(abstract.params, trainer.state_shardings.params),
      shd.sharded_bytes(abstract.params, trainer.grad_shardings),
      shd.sharded_bytes(abstract.opt_state, trainer.state_shardings.opt_state),
    )
  psi = per_device["dp"][0]
  assert per_device["dp"] == (psi, psi, pytest.approx(2 * psi, rel=1e-3))
  # Small leaves (norm scales over D=32 still divide 8; scalars stay replicated): within 1%.
  close = lambda a, b: a == pytest.approx(b, rel=0.01)
  assert close(per_device["zero1"][2], 2 * psi / 8) and per_device["zero1"][:2] == (psi, psi)
  assert close(per_device["zero2"][1], psi / 8) and close(per_device["zero2"][2], 2 * psi / 8)
  assert all(close(a, b) for a, b in zip(per_device["zero3"], (psi / 8, psi / 8, 2 * psi / 8)))


def test_mesh_errors_name_the_fields():
  with pytest.raises(ConfigError, match="needs 12 devices but 8"):
    shd.make_mesh(MeshConfig(data=3, fsdp=4, tensor=1))
  with pytest.raises(ConfigError, match=r"mesh.fsdp=-1.*do not divide 8"):
    shd.make_mesh(MeshConfig(data=1, fsdp=-1, tensor=3))


def test_indivisible_dimensions_stay_replicated():
  mesh = shd.make_mesh(MeshConfig(data=1, fsdp=1, tensor=8))
  assert tuple(shd.spec_for(("vocab", "embed"), (259, 16), shd.TENSOR_RULES, mesh)) == (None, None)
  assert tuple(shd.spec_for(("vocab", "embed"), (256, 16), shd.TENSOR_RULES, mesh)) == (
    "tensor",
    None,
  )
  # One mesh axis shards one dimension: the first whose logical axis maps to it.
  rules = {**shd.TENSOR_RULES, **shd.FSDP_RULES}
  fsdp = shd.make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
  assert tuple(shd.spec_for(("embed", "kv_lora"), (32, 24), rules, fsdp)) == ("fsdp", None)


DEEPSEEK_MTP = [
  "model.mla.q_lora_rank=16",
  "model.mla.kv_lora_rank=16",
  "model.mla.qk_rope_head_dim=8",
  "model.mla.qk_nope_head_dim=8",
  "model.mla.v_head_dim=8",
  "model.mtp.kind=sequential",
  "model.mtp.n_predict=2",
]
PLACEMENTS = {
  "zero3": (["mesh.fsdp=8", "train.sharding=zero3"], {"fsdp": 8}),
  "tensor": (["mesh.data=4", "mesh.fsdp=1", "mesh.tensor=2", "train.sharding=dp"], {"tensor": 2}),
}
# The rules as the sharding module documents them, restated here so the test does not read them
# back from the code under test.
WANT_RULES = {
  "zero3": {
    "embed": "fsdp",
    "q_lora": "fsdp",
    "kv_lora": "fsdp",
    **dict.fromkeys(("q_heads", "kv_heads", "mlp", "vocab"), "tensor"),
  },
  "tensor": dict.fromkeys(("q_heads", "kv_heads", "mlp", "vocab"), "tensor"),
}


@pytest.mark.parametrize("family", ["llama", "deepseek_mtp"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_every_parameter_is_sharded_as_its_logical_axes_say(family, placement):
  overrides, mesh_sizes = PLACEMENTS[placement]
  model = ["model.qkv_bias=true", "model.qk_norm=true"] if family == "llama" else DEEPSEEK_MTP
  cfg = tiny_config(*overrides, *model)
  if family == "deepseek_mtp":
    cfg = dataclasses.replace(
      cfg,
      model=dataclasses.replace(
        cfg.model, mla=MLAConfig(16, 8, 8, 8, 16), mtp=MTPConfig("sequential", 2)
      ),
    )
  trainer = make_trainer(cfg)
  params = trainer.init(jax.random.key(0)).params
  rules = WANT_RULES[placement]
  names, replicated = set(), set()
  for path, v in jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_param):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    names.add(name)
    axes = v.get_metadata()["logical_axes"]
    assert len(axes) == v.ndim, name
    want, used = [], set()
    for dim, axis in zip(v.shape, axes):
      mesh_axis = rules.get(axis)
      n = mesh_sizes.get(mesh_axis, 1)
      if mesh_axis in used or dim % n:
        n = 1
      if n > 1:
        used.add(mesh_axis)
      want.append(dim // n)
    array = v[...]
    assert {s.data.shape for s in array.addressable_shards} == {tuple(want)}, name
    shards = math.prod(v.shape) // math.prod(want)
    assert array.addressable_shards[0].data.nbytes == array.nbytes // shards, name
    if shards == 1:
      replicated.add(name)
  if placement == "zero3":
    # ZeRO-3 leaves whole only what has no model-width or bottleneck axis: the per-head biases
    # and qk-norm scales, a few hundred bytes per layer.
    small = {"bq", "bk", "bv", "q_norm/scale", "k_norm/scale"}
    want = {f"blocks/attn/{n}" for n in small} if family == "llama" else set()
    assert replicated == want
  if family == "deepseek_mtp":
    # The projections that name matching once left replicated are covered.
    for name in ("blocks/attn/wkv_a", "blocks/attn/wk_b", "blocks/attn/wq_b", "mtp/heads/eh_proj"):
      assert name in names


def _is_param(x):
  return isinstance(x, nnx.Param)


def test_a_parameter_without_logical_axes_is_an_error(monkeypatch):
  from atlas_jax.training import step as step_module

  real = step_module.build_model

  def with_stray_param(cfg, key=None, **kwargs):
    model = real(cfg, key, **kwargs)
    model.stray = nnx.Param(jnp.zeros((4, 4)))  # no logical axes
    return model

  monkeypatch.setattr(step_module, "build_model", with_stray_param)
  with pytest.raises(ConfigError, match=r"undeclared: stray \(4, 4\) axes=None"):
    make_trainer(tiny_config())


def test_weight_decay_mask_comes_from_parameter_tags():
  trainer = make_trainer(tiny_config("model.qkv_bias=true", "model.qk_norm=true"))
  params = trainer.abstract_state().params
  mask = decay_mask(params)
  decayed = {
    "/".join(str(getattr(k, "key", k)) for k in path): m
    for path, m in jax.tree_util.tree_leaves_with_path(mask)
  }
  off = sorted(n for n, m in decayed.items() if not m)
  assert off == [
    "blocks/attn/bk",
    "blocks/attn/bq",
    "blocks/attn/bv",
    "blocks/attn/k_norm/scale",
    "blocks/attn/q_norm/scale",
    "blocks/attn_norm/scale",
    "blocks/mlp_norm/scale",
    "final_norm/scale",
  ]
  assert all(decayed[n] for n in ("embed", "lm_head", "blocks/attn/wq", "blocks/mlp/w_up"))
