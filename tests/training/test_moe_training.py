"""Mixture-of-experts training: expert-parallel steps on 8 devices equal one device; the balance
loss and DeepSeek-V3's bias update move a skewed router's load towards balance; the bias is
outside the optimizer and inside checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax.training import checkpoint
from atlas_jax.training.checkpoint import single_device_mesh
from atlas_jax.training.step import make_train_step, make_trainer

from .common import batches, tiny_config

MOE = (
  "model.moe={n_experts: 8, top_k: 2, expert_ffn_dim: 16, first_k_dense: 1, shared_ffn_dim: 16,"
  " scoring: sigmoid, topk_method: noaux_tc, n_group: 4, topk_group: 2}"
)
MESHES = {
  "expert8": ["mesh.fsdp=1", "mesh.expert=8"],
  "data2-expert4-zero1": ["mesh.data=2", "mesh.fsdp=1", "mesh.expert=4", "train.sharding=zero1"],
  "fsdp2-expert2-tensor2-zero3": [
    "mesh.fsdp=2",
    "mesh.expert=2",
    "mesh.tensor=2",
    "train.sharding=zero3",
  ],
}


def run(cfg, mesh=None, steps=3, state=None):
  trainer = make_trainer(cfg, mesh=mesh)
  step = make_train_step(trainer)
  state = trainer.init(jax.random.key(0)) if state is None else state(trainer)
  records = []
  for b in batches(steps):
    state, m = step(state, b)
    records.append({k: float(v) for k, v in m.items()})
  return records, state, trainer


@pytest.fixture(scope="module")
def one_device():
  return run(tiny_config(MOE), mesh=single_device_mesh())


@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=pytest.mark.slow) if n.startswith(("data2", "expert8")) else n
    for n in MESHES
  ],
)
def test_expert_parallel_steps_equal_one_device(name, one_device):
  want, want_state, _ = one_device
  got, state, _ = run(tiny_config(MOE, *MESHES[name]))
  for key in ("loss", "loss_total", "moe_balance_loss", "moe_z_loss", "moe_load_max"):
    np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=2e-5)
  # The selection biases took the same steps (they move by exactly the rate, or not at all).
  np.testing.assert_array_equal(
    np.asarray(state.params["blocks"]["mlp"]["score_bias"][...]),
    np.asarray(want_state.params["blocks"]["mlp"]["score_bias"][...]),
  )
  w_gate = state.params["blocks"]["mlp"]["w_gate"][...]
  assert "expert" in tuple(w_gate.sharding.spec)  # [L, E, D, F]: experts over the expert axis
  if "tensor" in name:
    assert tuple(w_gate.sharding.spec) == (None, "expert", "fsdp", "tensor")


def test_the_bias_is_outside_the_optimizer_and_inside_checkpoints(one_device, tmp_path):
  _, state, trainer = one_device
  opt_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
  assert any("score_bias" in p for p in opt_paths if "params" in p)
  assert not any("score_bias" in p for p in opt_paths if "opt_state" in p)
  bias = np.asarray(state.params["blocks"]["mlp"]["score_bias"][...])
  assert np.abs(bias).max() > 0  # the steps moved it
  mngr = checkpoint.manager(tmp_path)
  checkpoint.save(mngr, 3, state, {"step": 3, "data_index": 3})
  mngr.wait_until_finished()
  restored, _ = checkpoint.restore(mngr, trainer.abstract_state(), trainer.state_shardings)
  np.testing.assert_array_equal(np.asarray(restored.params["blocks"]["mlp"]["score_bias"]), bias)


def skewed(trainer, c: float):
  """The initial state with every token's router input sharing a direction, and expert 0's
  router column along it: expert 0 takes nearly every token. Tokens and router columns vary
  enough (embeddings and router weights drawn large) that an even split exists."""
  state = trainer.init(jax.random.key(0))
  model = nnx.merge(trainer.graphdef, state.params)
  u = jax.random.normal(jax.random.key(1), (model.cfg.d_model,)) * 0.2
  model.embed[...] = model.embed[...] * 10 + u
  model.blocks.mlp.router[...] = model.blocks.mlp.router[...] * 15
  graphdef, stack = nnx.split(model.blocks)
  block = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], stack))
  x = jnp.broadcast_to(u, (1, 4, u.shape[0]))
  h, _ = block.attn(block.attn_norm(x), jnp.arange(4)[None])
  r = block.mlp_norm(x + h)[0, 0]  # the router's input for a token whose embedding is u
  model.blocks.mlp.router[...] = model.blocks.mlp.router[...].at[0, :, 0].add(c * r / (r @ r))
  return state.replace(params=nnx.state(model))


def test_the_balance_loss_moves_a_skewed_router_towards_balance():
  moe = "model.moe={n_experts: 4, top_k: 1, expert_ffn_dim: 16}"
  loads = {}
  for weight in (0.0, 1.0):
    cfg = tiny_config("model.n_layers=1", moe, f"train.moe_aux_loss={weight}", "train.steps=40")
    records, _, _ = run(cfg, single_device_mesh(), steps=40, state=lambda t: skewed(t, 6.0))
    loads[weight] = [r["moe_load_max"] for r in records]
  # The busiest expert's tokens over the mean, of 4 at most: skewed at the start, skewed still
  # under the next-token loss alone, near even with the balance loss (the last 5 steps' mean).
  assert loads[0.0][0] == loads[1.0][0] > 3.0
  assert np.mean(loads[0.0][-5:]) > 2.5
  assert np.mean(loads[1.0][-5:]) < 1.7


def test_the_bias_update_moves_a_skewed_router_towards_balance():
  moe = (
    "model.moe={n_experts: 4, top_k: 1, expert_ffn_dim: 16, scoring: sigmoid,"
    " topk_method: noaux_tc}"
  )
  cfg = tiny_config(
    "model.n_layers=1", moe, "train.moe_bias_update_rate=0.05", "train.learning_rate=1e-9"
  )

  def biased(trainer):
    state = trainer.init(jax.random.key(0))
    mlp = state.params["blocks"]["mlp"]
    mlp["router"][...] = mlp["router"][...] * 15  # scores that differ between tokens
    mlp["score_bias"][...] = mlp["score_bias"][...].at[0, 0].set(2.0)  # expert 0 wins them all
    return state

  records, state, _ = run(cfg, single_device_mesh(), steps=60, state=biased)
  load = [r["moe_load_max"] for r in records]
  assert load[0] == 4.0 and np.mean(load[-10:]) < 1.7, load
  bias = np.asarray(state.params["blocks"]["mlp"]["score_bias"][...])[0]
  # Overloaded at the start, expert 0's bias fell by the rate per step until the load evened;
  # every bias moved in whole steps of the rate.
  assert bias[0] < 2.0 - 0.05 * 15
  np.testing.assert_allclose(bias / 0.05, np.round(bias / 0.05), atol=1e-3)
