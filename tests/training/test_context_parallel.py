"""Context parallelism on fake CPU devices: the striping, the attention against one device's, and
training steps (losses, gradients, updated parameters) equal to the single-device step."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from atlas_jax import kernels
from atlas_jax.config import ConfigError
from atlas_jax.model import context_parallel as cp
from atlas_jax.training import checkpoint
from atlas_jax.training import sharding as shd
from atlas_jax.training.checkpoint import single_device_mesh
from atlas_jax.training.step import make_train_step, make_trainer

from .common import batches, tiny_config

SMALL = ["model.n_layers=2", "train.seq_len=16", "train.batch_size=4"]
STEPS = 3


def _mesh(cfg, n):
  return shd.make_mesh(cfg.mesh, jax.devices()[:n])


def _run(cfg, mesh, steps=STEPS):
  trainer = make_trainer(cfg, mesh=mesh)
  step = make_train_step(trainer)
  state = trainer.init(jax.random.key(0))
  metrics = []
  for b in batches(steps, batch=4):
    state, m = step(state, b)
    metrics.append((float(m["loss"]), float(m["grad_norm"])))
  return np.asarray(metrics), state, trainer, step


@pytest.fixture(scope="module")
def one_device():
  """The single-device run's (loss, grad_norm) per step, final parameters, trainer and step."""
  metrics, state, trainer, step = _run(tiny_config(*SMALL), single_device_mesh())
  return metrics, jax.device_get(state.params), trainer, step


def test_stripe_permutation_and_inverse():
  perm = cp.stripe_permutation(16, 2)
  # Device 0: chunks 0 and 3 of 4 (4 tokens each); device 1: chunks 1 and 2.
  assert perm.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
  for T, C in ((16, 4), (24, 3), (8, 1)):
    perm, inv = cp.stripe_permutation(T, C), cp.unstripe_permutation(T, C)
    assert sorted(perm.tolist()) == list(range(T))
    np.testing.assert_array_equal(perm[inv], np.arange(T))
    x = np.arange(2 * T).reshape(2, T)
    np.testing.assert_array_equal(cp.unstripe(cp.stripe(jnp.asarray(x), C), C), x)
    # Causal work (keys each device's queries see) is even across the devices.
    work = (perm.reshape(C, -1) + 1).sum(axis=1)
    assert len(set(work.tolist())) == 1


def test_config_errors_name_the_field():
  with pytest.raises(ConfigError, match=r"train.seq_len=12.*2 \* mesh.context = 8"):
    tiny_config("mesh.context=4", "train.seq_len=12")
  with pytest.raises(ConfigError, match="train.context_parallel"):
    tiny_config("train.context_parallel=ulysses")
  with pytest.raises(ConfigError, match=r"mesh.context=2.*mesh.stage=2"):
    tiny_config("mesh.context=2", "mesh.stage=2", "mesh.fsdp=1")


@pytest.mark.parametrize("mode", ["all_gather", "ring"])
def test_attention_and_its_gradients_match_one_device(mode):
  """Packed documents and a sliding window: the split attention's output and the gradients of
  q, k, v equal the whole sequence's through `kernels.attention`."""
  B, T, N, K, H, C = 2, 16, 4, 2, 8, 4
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.float32) for n in (N, K, K))
  seg = jnp.asarray(np.repeat([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7], 1, axis=0), jnp.int32)
  weights = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)

  def whole(q, k, v):
    out = kernels.attention(
      q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg, sliding_window=6
    )
    return jnp.sum(out * weights), out

  mesh = shd.make_mesh(
    tiny_config("mesh.fsdp=1", "mesh.data=2", f"mesh.context={C}").mesh, jax.devices()
  )

  def split(q, k, v):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      st = lambda x: cp.stripe(x, C)
      out = cp.context_attention(
        st(q), st(k), st(v), segment_ids_BT=st(seg), sliding_window=6, mode=mode
      )
    out = cp.unstripe(out, C)
    return jnp.sum(out * weights), out

  (_, want), want_grads = jax.value_and_grad(whole, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  with jax.sharding.set_mesh(mesh):
    (_, got), got_grads = jax.jit(jax.value_and_grad(split, argnums=(0, 1, 2), has_aux=True))(
      q, k, v
    )
  np.testing.assert_allclose(got, want, atol=1e-5)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, w, atol=1e-5)


def test_merge_partials_is_one_softmax():
  rng = np.random.default_rng(1)
  s = jnp.asarray(rng.normal(size=(3, 10)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(10, 4)), jnp.float32)

  def partial(lo, hi):
    p = jax.nn.softmax(s[:, lo:hi], axis=-1)
    return (p @ v[lo:hi])[:, None], jax.nn.logsumexp(s[:, lo:hi], axis=-1)[:, None]

  out, lse = cp.merge_partials(*partial(0, 4), *partial(4, 10))
  np.testing.assert_allclose(out[:, 0], jax.nn.softmax(s, axis=-1) @ v, atol=1e-6)
  np.testing.assert_allclose(lse[:, 0], jax.nn.logsumexp(s, axis=-1), atol=1e-6)
  # A block no query sees (lse -inf, output 0) changes nothing.
  none = (jnp.zeros_like(out), jnp.full_like(lse, -jnp.inf))
  got, got_lse = cp.merge_partials(out, lse, *none)
  np.testing.assert_allclose(got, out)
  np.testing.assert_allclose(got_lse, lse)


CASES = {
  "context2": (2, ["mesh.fsdp=1", "mesh.context=2"]),
  "fsdp2_tensor2_context2_ring": (
    8,
    ["mesh.fsdp=2", "mesh.tensor=2", "mesh.context=2", "train.sharding=fsdp"]
    + ["train.context_parallel=ring"],
  ),
}
SLOW_CASES = {
  "context4_ring": (4, ["mesh.fsdp=1", "mesh.context=4", "train.context_parallel=ring"]),
  "fsdp2_context4": (8, ["mesh.fsdp=2", "mesh.context=4", "train.sharding=fsdp"]),
  "context2_ring": (2, ["mesh.fsdp=1", "mesh.context=2", "train.context_parallel=ring"]),
  "context4": (4, ["mesh.fsdp=1", "mesh.context=4"]),
  "fsdp2_tensor2_context2": (
    8,
    ["mesh.fsdp=2", "mesh.tensor=2", "mesh.context=2", "train.sharding=fsdp"],
  ),
  "fsdp2_context4_ring": (
    8,
    ["mesh.fsdp=2", "mesh.context=4", "train.sharding=fsdp", "train.context_parallel=ring"],
  ),
  "tensor2_context4_ring": (
    8,
    ["mesh.fsdp=1", "mesh.tensor=2", "mesh.context=4", "train.context_parallel=ring"],
  ),
}


@pytest.mark.parametrize(
  "name",
  [*CASES, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW_CASES)],
)
def test_training_steps_equal_one_device(name, one_device):
  """Loss and gradient norm at every step, and the parameters after the last update (which the
  gradients made), equal the single-device run's."""
  n, overrides = {**CASES, **SLOW_CASES}[name]
  cfg = tiny_config(*SMALL, *overrides)
  metrics, state, trainer, _ = _run(cfg, _mesh(cfg, n))
  want_metrics, want_params = one_device[:2]
  np.testing.assert_allclose(metrics, want_metrics, rtol=2e-5)
  chex.assert_trees_all_close(jax.device_get(state.params), want_params, atol=2e-5)
  assert trainer.mesh.shape["context"] == cfg.mesh.context


def test_saved_under_context_resumes_on_one_device(tmp_path, one_device):
  """A checkpoint of step 1 under context 2 restores on one device exactly (every parameter and
  moment bitwise) and its next loss is the one the context run itself gets next."""
  cfg = tiny_config(*SMALL, "mesh.fsdp=1", "mesh.context=2")
  trainer = make_trainer(cfg, mesh=_mesh(cfg, 2))
  step = make_train_step(trainer)
  state = trainer.init(jax.random.key(0))
  data = batches(2, batch=4)
  state, _ = step(state, data[0])
  mngr = checkpoint.manager(tmp_path)
  checkpoint.save(mngr, 1, state, trainer.checkpoint_meta(1))
  mngr.wait_until_finished()
  saved = jax.device_get(state)
  _, m = step(state, data[1])

  _, _, single, single_step = one_device
  restored, meta = checkpoint.restore(mngr, single.abstract_state(), single.state_shardings)
  restored = single.restored(restored, meta)
  assert meta["step"] == 1
  chex.assert_trees_all_equal(jax.device_get(restored), saved)
  _, m1 = single_step(restored, data[1])
  # The same state and batch: the two meshes' steps differ only in summation order.
  assert float(m1["loss"]) == pytest.approx(float(m["loss"]), rel=1e-6)
  assert float(m1["loss"]) == pytest.approx(one_device[0][1, 0], rel=2e-5)


def test_abstract_context_mesh_splits_activations_not_parameters():
  """Under an abstract 8-device mesh with context 4 the parameters are laid out as without it
  (replicated over `context`), nothing allocated."""
  cfg = tiny_config(*SMALL, "mesh.fsdp=2", "mesh.context=4", "train.sharding=fsdp")
  sizes = {"fsdp": 2, "context": 4}
  mesh = AbstractMesh(tuple(sizes.get(a, 1) for a in shd.AXES), shd.AXES)
  trainer = make_trainer(cfg, mesh=mesh)
  for sh in jax.tree.leaves(trainer.state_shardings.params):
    assert "context" not in jax.tree.leaves(tuple(sh.spec))


@pytest.mark.slow
def test_ring_partials_by_flash_attention_equal_xla():
  """The ring's per-block partial softmax by the Pallas kernel (interpreted here) equals the XLA
  block's, blocks the queries cannot see (output 0, log-sum-exp -inf) included."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 8, 4, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(1, 8, 2, 8)), jnp.float32) for _ in range(2))
  q_pos = jnp.asarray(np.r_[2:6, 26:30][None], jnp.int32)
  seg_q, seg_kv = jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 8), jnp.int32)
  for kv_pos in (np.r_[0:4, 28:32], np.r_[4:8, 24:28]):
    args = (q, k, v, q_pos, jnp.asarray(kv_pos, jnp.int32), seg_q, seg_kv)
    want_o, want_lse = cp._xla_partial(*args, sliding_window=None)
    got_o, got_lse = cp._flash_partial(*args, sliding_window=None)
    np.testing.assert_allclose(got_o, want_o, atol=1e-5)
    np.testing.assert_allclose(got_lse, want_lse, atol=1e-5)


@pytest.mark.slow
def test_mixture_of_experts_with_expert_and_context_axes_equals_one_device():
  """Routed experts over `expert` while sequences split over `context` (fsdp 2 x expert 2 x
  context 2, ZeRO-3): losses, balance terms and gradient norms equal one device's."""
  from .test_moe_training import MOE, run

  want, _, _ = run(tiny_config(MOE), mesh=single_device_mesh())
  mesh = ["mesh.fsdp=2", "mesh.expert=2", "mesh.context=2", "train.sharding=zero3"]
  got, _, trainer = run(tiny_config(MOE, *mesh))
  assert trainer.mesh.shape["context"] == 2
  for key in ("loss", "moe_balance_loss", "moe_load_max", "grad_norm"):
    np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=2e-5)


@pytest.mark.parametrize("mode", ["all_gather", "ring"])
def test_soft_capped_attention_with_sinks_matches_one_device(mode):
  """Gemma's scale and soft-cap and gpt-oss's sinks on the split sequence: the output and the
  gradients (the sinks' too) equal the whole sequence's; the ring adds the sinks once, after
  merging its blocks."""
  B, T, N, K, H, C = 2, 16, 4, 2, 8, 4
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.float32) for n in (N, K, K))
  sinks = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
  weights = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
  options = dict(scale=0.3, soft_cap=2.0, sliding_window=6)

  def whole(q, k, v, sinks):
    out = kernels.attention(q, k, v, causal=True, sinks=sinks, **options)
    return jnp.sum(out * weights), out

  mesh = shd.make_mesh(
    tiny_config("mesh.fsdp=1", "mesh.tensor=2", f"mesh.context={C}").mesh, jax.devices()
  )

  def split(q, k, v, sinks):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      st = lambda x: cp.stripe(x, C)
      out = cp.context_attention(st(q), st(k), st(v), sinks=sinks, mode=mode, **options)
    out = cp.unstripe(out, C)
    return jnp.sum(out * weights), out

  grad = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)
  (_, want), want_grads = grad(whole)(q, k, v, sinks)
  with jax.sharding.set_mesh(mesh):
    (_, got), got_grads = jax.jit(grad(split))(q, k, v, sinks)
  np.testing.assert_allclose(got, want, atol=1e-5)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, w, atol=1e-5)
