"""Pipeline parallelism on 8 fake CPU devices: the unpipelined step's loss and gradients, the
schedule's iterations and bubble, stage-sharded state, resume across meshes, named errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax import measure
from atlas_jax.config import ConfigError, load_config
from atlas_jax.schedule import Schedule
from atlas_jax.training import checkpoint, pipeline
from atlas_jax.training import sharding as shd
from atlas_jax.training.checkpoint import single_device_mesh
from atlas_jax.training.step import _accumulated_grads, make_train_step, make_trainer

from .common import TINY, batches

B = 16  # rows: 2 per data shard under fsdp 2 x 4 micro-batches, or fsdp 4 x 2 micro-batches
MLA = [
  "model.mla.kv_lora_rank=16",
  "model.mla.q_lora_rank=16",
  "model.mla.qk_rope_head_dim=8",
  "model.mla.qk_nope_head_dim=8",
  "model.mla.v_head_dim=8",
]
MODELS = {
  "llama": ["model.qkv_bias=true"],
  "mla_mtp": [*MLA, "model.mtp.kind=sequential", "model.mtp.n_predict=1"],
  # Parallel MTP heads read the last block's input: a second activation through the stages.
  "llama_parallel_mtp": ["model.mtp.kind=parallel", "model.mtp.n_predict=2", "train.z_loss=1e-3"],
  "base": [],  # the MoE cases bring their own layers
  # Gemma's layout: local and global layers alternating (each stage of a circular pipeline
  # holds layers of one kind), post-norms, GeGLU, scaled embeddings, both soft-caps.
  "gemma": [
    "model.layer_types=[sliding_attention,full_attention,sliding_attention,full_attention]",
    "model.sliding_window=5",
    "model.rope_local_theta=1000.0",
    "model.post_norms=true",
    "model.mlp_activation=gelu_tanh",
    "model.scale_embeddings=true",
    "model.attn_logit_softcapping=5.0",
    "model.final_logit_softcapping=3.0",
  ],
}
STAGE2_FSDP2_TENSOR2 = ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2"]
# (model, pipeline and training overrides): GPipe and circular, with remat, grad accumulation,
# every ZeRO strategy, the chunked loss.
CASES = {
  "gpipe": ("llama", ["mesh.stage=2", "mesh.fsdp=4", "train.pipeline_microbatches=2"]),
  "gpipe_4_stages_every_k": (
    "llama",
    [
      "mesh.stage=4",
      "mesh.fsdp=2",
      "model.n_layers=8",
      "train.pipeline_microbatches=2",
      "train.remat=every_k",
      "train.remat_every=2",
    ],
  ),
  "circular_zero3_remat_full": (
    "llama",
    [
      *STAGE2_FSDP2_TENSOR2,
      "train.sharding=zero3",
      "train.pipeline_microbatches=4",
      "train.pipeline_repeats=2",
      "train.remat=full",
    ],
  ),
  "circular_more_microbatches_than_stages_accum": (
    "llama",
    [
      "mesh.stage=2",
      "mesh.data=2",
      "mesh.fsdp=2",
      "train.sharding=zero2",
      "train.pipeline_microbatches=4",
      "train.pipeline_repeats=2",
      "train.grad_accum=2",
      "train.batch_size=32",
    ],
  ),
  "mla_mtp_gpipe_selective_chunked": (
    "mla_mtp",
    [
      *STAGE2_FSDP2_TENSOR2,
      "train.sharding=zero1",
      "train.pipeline_microbatches=4",
      "train.remat=selective",
      "train.loss_chunk=8",
    ],
  ),
  # LoRA: the adapters' gradients (b's; a's are zero while b is) through the stages.
  "lora_circular_zero3": (
    "llama",
    [
      *STAGE2_FSDP2_TENSOR2,
      "train.sharding=zero3",
      "train.lora={rank: 4}",
      "train.pipeline_microbatches=4",
      "train.pipeline_repeats=2",
    ],
  ),
  "gemma_circular_chunked": (
    "gemma",
    [
      *STAGE2_FSDP2_TENSOR2,
      "train.pipeline_microbatches=2",
      "train.pipeline_repeats=2",
      "train.loss_chunk=8",
    ],
  ),
  "parallel_mtp_circular": (
    "llama_parallel_mtp",
    [
      *STAGE2_FSDP2_TENSOR2,
      "train.pipeline_microbatches=2",
      "train.pipeline_repeats=2",
    ],
  ),
}


def config(model: str, *overrides: str):
  return load_config(None, [*TINY, f"train.batch_size={B}", *MODELS[model], *overrides])


def loss_and_grads(cfg, batch, mesh=None):
  """(loss, aux, float32 gradients in depth order) of the trainer's own step function."""
  trainer = make_trainer(cfg, mesh=mesh)
  state = trainer.init(jax.random.key(0))
  grads, loss, aux = jax.jit(lambda p, b: _accumulated_grads(trainer, p, b, jnp.float32(1.0)))(
    state.params, batch
  )
  grads = pipeline.reorder_layers(grads, trainer.layout, (1, 1))
  return float(loss), jax.tree.map(float, aux), jax.device_get(nnx.to_pure_dict(grads))


def assert_relative(got, want, tol=1e-5, floor=1e-30):
  """Every leaf within tol of the reference, relative to the leaf's largest entry (or `floor`,
  if larger: gradients that are rounding noise, as a key bias's under softmax)."""
  for path, w in jax.tree_util.tree_leaves_with_path(want):
    g = got
    for k in path:
      g = g[k.key]
    scale = max(float(np.abs(w).max()), floor)
    assert float(np.abs(np.asarray(g) - w).max()) <= tol * scale, jax.tree_util.keystr(path)


# The default run keeps one case of each mechanism; the variants of a mechanism run with -m slow.
SLOW_CASES = {
  "gpipe_4_stages_every_k",
  "lora_circular_zero3",
  "parallel_mtp_circular",
  "circular_more_microbatches_than_stages_accum",
}


@pytest.mark.parametrize(
  "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES]
)
def test_pipelined_loss_and_gradients_equal_the_unpipelined_step(case):
  model, overrides = CASES[case]
  batch_size = 32 if "train.batch_size=32" in overrides else B
  (batch,) = batches(1, batch=batch_size)
  unpiped = [o for o in overrides if not o.startswith(("mesh.", "train.pipeline"))]
  want = loss_and_grads(config(model, *unpiped), batch, mesh=single_device_mesh())
  got = loss_and_grads(config(model, *overrides), batch)
  assert got[0] == pytest.approx(want[0], rel=1e-5)
  for k in want[1]:
    assert got[1][k] == pytest.approx(want[1][k], rel=1e-5, abs=1e-7), k
  assert_relative(got[2], want[2])


def test_schedule_table_iterations_and_bubble():
  """GPipe: stage s runs micro-batch i - s; circular: repeat j of micro-batch u is step
  j U + u, and every stage idles exactly p - 1 of the U r + p - 1 iterations."""
  gpipe = Schedule(stages=3, microbatches=4)
  assert gpipe.table().tolist() == [
    [0, -1, -1],
    [1, 0, -1],
    [2, 1, 0],
    [3, 2, 1],
    [-1, 3, 2],
    [-1, -1, 3],
  ]
  circular = Schedule(stages=2, microbatches=3, repeats=2)
  assert circular.table()[:, 0].tolist() == [0, 1, 2, 3, 4, 5, -1]
  assert circular.table()[:, 1].tolist() == [-1, 0, 1, 2, 3, 4, 5]
  for p, U, r in [(2, 4, 1), (4, 8, 1), (4, 8, 2), (4, 4, 4), (8, 16, 3)]:
    sched = Schedule(p, U, r)
    table = sched.table()
    assert table.shape == (U * r + p - 1, p)
    assert ((table == -1).sum(axis=0) == p - 1).all()
    assert (table == -1).mean() == pytest.approx((p - 1) / (r * U + p - 1))


# Two-stage GPipe under -m slow: four stages run GPipe's loop, two the circular one.
@pytest.mark.parametrize(
  "p, U, r", [pytest.param(2, 4, 1, marks=pytest.mark.slow), (2, 2, 2), (4, 4, 1)]
)
def test_the_compiled_step_runs_the_schedules_iterations(p, U, r):
  """The train step's pipeline loops (forward and backward, the ones that ppermute) run
  U r + p - 1 iterations, and the program's own busy flags idle (p-1)/(U r + p - 1)."""
  cfg = config(
    "llama",
    f"mesh.stage={p}",
    f"mesh.fsdp={8 // p}",
    "model.n_layers=8",
    f"train.pipeline_microbatches={U}",
    f"train.pipeline_repeats={r}",
    "train.batch_size=32",
  )
  trainer = make_trainer(cfg)
  state = trainer.init(jax.random.key(0))
  hlo = measure.compiled_train_step(cfg, mesh=trainer.mesh)
  assert measure.pipeline_loops(hlo) == [U * r + p - 1] * 2

  model = nnx.merge(trainer.graphdef, state.params)
  graphdef, blocks = nnx.split(model.blocks)
  x_BTD = jnp.zeros((32, 16, 32))
  rows = (jnp.zeros((32, 16), jnp.int32), None)

  def step(x, layer, rows):
    return nnx.merge(graphdef, layer)(x, rows[0])[0], None

  _, _, busy_pI = jax.jit(lambda b, x: model.pipeline.run(step, x, b, rows))(blocks, x_BTD)
  busy_pI = np.asarray(busy_pI)
  assert busy_pI.shape == (p, U * r + p - 1)
  np.testing.assert_array_equal(busy_pI.T, Schedule(p, U, r).table() != -1)
  assert 1 - busy_pI.mean() == pytest.approx((p - 1) / (r * U + p - 1))


@pytest.mark.parametrize("repeats", [1, 2])
def test_each_stage_holds_its_layers_and_a_share_of_the_state(repeats):
  """Per-device bytes of the block parameters are total / (stage x fsdp x tensor) under ZeRO-3,
  and the rows a stage holds are the layers the schedule gives it (circular: every p-th group)."""
  cfg = config(
    "llama",
    *STAGE2_FSDP2_TENSOR2,
    "train.sharding=zero3",
    "model.n_layers=8",
    "train.pipeline_microbatches=2",
    f"train.pipeline_repeats={repeats}",
  )
  trainer = make_trainer(cfg)
  state = trainer.init(jax.random.key(0))
  reference = make_trainer(config("llama", "model.n_layers=8"), mesh=single_device_mesh())
  depth_order = reference.init(jax.random.key(0)).params
  for name in ("wq", "wk", "wo"):
    array = state.params["blocks"]["attn"][name][...]
    assert array.addressable_shards[0].data.nbytes == array.nbytes // 8, name
  for name in ("w_gate", "w_down"):
    array = state.params["blocks"]["mlp"][name][...]
    assert array.addressable_shards[0].data.nbytes == array.nbytes // 8, name
  abstract = trainer.abstract_state()
  per_device = shd.sharded_bytes(
    abstract.params["blocks"], trainer.state_shardings.params["blocks"]
  )
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.params["blocks"]))
  # Norm scales and biases have no tensor axis: within 2% of the whole split 8 ways.
  assert per_device == pytest.approx(total / 8, rel=0.02)
  # Stage s's devices hold, in order, the layers of its groups: layers 2s, 2s + 1 (GPipe:
  # 4s .. 4s + 3) of the eight.
  wq = state.params["blocks"]["attn"]["wq"][...]
  full = np.asarray(depth_order["blocks"]["attn"]["wq"][...])
  per = 8 // (2 * repeats)
  for shard in wq.addressable_shards:
    s = _stage_of(trainer, shard.device)
    layers = [g * 2 * per + s * per + j for g in range(repeats) for j in range(per)]
    # To float rounding: the two inits are different programs, and XLA's CPU emitters may
    # vectorise their draws' transcendentals differently (another layer's weights differ wholly).
    np.testing.assert_allclose(
      np.asarray(shard.data), full[layers][(slice(None), *shard.index[1:])], rtol=1e-6
    )


def _stage_of(trainer, device) -> int:
  coords = np.argwhere(trainer.mesh.devices == device)[0]
  return int(coords[shd.AXES.index("stage")])


def test_layer_order_is_stage_major():
  assert pipeline.layer_order(8, (2, 2)).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
  assert pipeline.layer_order(8, (2, 1)).tolist() == list(range(8))
  x = {"w": nnx.Param(jnp.arange(8.0)[:, None], logical_axes=("layers", "embed"))}
  moved = pipeline.reorder_layers(x, (1, 1), (2, 2))
  assert moved["w"][...][:, 0].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
  back = pipeline.reorder_layers(moved, (2, 2), (4, 2))  # onto 4 stages: [0, 4, 1, 5, ...]
  assert back["w"][...][:, 0].tolist() == pipeline.layer_order(8, (4, 2)).tolist()


MESHES = {
  "circular": [*STAGE2_FSDP2_TENSOR2, "train.pipeline_microbatches=2", "train.pipeline_repeats=2"],
  "unpipelined": ["mesh.fsdp=8", "train.sharding=zero3"],
}


@pytest.mark.parametrize(
  "saved, resumed",
  [pytest.param("circular", "unpipelined", marks=pytest.mark.slow), ("unpipelined", "circular")],
)
def test_checkpoints_resume_across_meshes_bitwise(tmp_path, saved, resumed):
  data = batches(2, batch=B)
  first = make_trainer(config("llama", *MESHES[saved]))
  state, _ = make_train_step(first)(first.init(jax.random.key(0)), data[0])
  mngr = checkpoint.manager(tmp_path)
  checkpoint.save(mngr, 1, state, first.checkpoint_meta(1))
  mngr.wait_until_finished()
  in_depth_order = lambda trainer, s: jax.device_get(
    pipeline.reorder_layers(s.replace(loss_scale=None), trainer.layout, (1, 1))
  )
  saved_state = in_depth_order(first, state)

  second = make_trainer(config("llama", *MESHES[resumed]))
  restored, meta = checkpoint.restore(mngr, second.abstract_state(), second.state_shardings)
  restored = second.restored(restored, meta)
  for a, b in zip(jax.tree.leaves(in_depth_order(second, restored)), jax.tree.leaves(saved_state)):
    np.testing.assert_array_equal(a, b)
  # And both meshes take the same next step.
  _, m_first = make_train_step(first)(state, data[1])
  _, m_second = make_train_step(second)(restored, data[1])
  assert float(m_second["loss"]) == pytest.approx(float(m_first["loss"]), rel=1e-5)
  # Serving reads the model in depth order, whatever the run's layout.
  checkpoint.write_run_files(tmp_path, first.cfg)
  model, _, _ = checkpoint.load_model(tmp_path)
  served = jax.device_get(nnx.to_pure_dict(nnx.state(model)))
  want = nnx.to_pure_dict(saved_state.params)
  for a, b in zip(jax.tree.leaves(served), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
  "overrides, message",
  [
    (
      ["mesh.stage=3", "mesh.fsdp=1"],
      r"model.n_layers=4 is not allowed: must be divisible by "
      r"mesh.stage x train.pipeline_repeats = 3 x 1",
    ),
    (["mesh.stage=2", "train.pipeline_repeats=4"], r"model.n_layers=4 .* = 2 x 4"),
    (
      [
        "mesh.stage=2",
        "model.n_layers=8",
        "train.pipeline_repeats=2",
        "train.pipeline_microbatches=1",
      ],
      r"train.pipeline_microbatches=1 is not allowed: must be >= mesh.stage=2 with "
      r"train.pipeline_repeats=2",
    ),
    (
      ["train.pipeline_microbatches=4"],
      r"train.pipeline_microbatches=4 is not allowed: must be 1 "
      r"with mesh.stage=1",
    ),
    (
      ["train.pipeline_repeats=2"],
      r"train.pipeline_repeats=2 is not allowed: must be 1 with mesh.stage=1",
    ),
    (
      ["mesh.stage=2", "train.pipeline_microbatches=0"],
      r"train.pipeline_microbatches=0 .* must be > 0",
    ),
    (
      [
        "mesh.stage=2",
        "model.n_layers=8",
        "train.remat=every_k",
        "train.remat_every=4",
        "train.pipeline_repeats=2",
        "train.pipeline_microbatches=2",
      ],
      r"train.remat_every=4 is not allowed: must divide the layers a stage runs at a time, "
      r"n_layers / \(stage x repeats\) = 2",
    ),
  ],
)
def test_bad_pipelines_are_named_at_load(overrides, message):
  with pytest.raises(ConfigError, match=message):
    load_config(None, [*TINY, *overrides])


# Mixture-of-experts models through the stages: the stages split the MoE layers; DeepSeek's
# dense first layers run before the pipeline. Dropless routers, so the pipeline's micro-batches
# see what the whole batch does, and the merged router stats equal one call's.
MOE_V3 = (
  "model.moe={n_experts: 8, top_k: 2, expert_ffn_dim: 16, first_k_dense: 1, shared_ffn_dim: 16,"
  " scoring: sigmoid, topk_method: noaux_tc, n_group: 4, topk_group: 2,"
  " routed_scaling_factor: 2.5}"
)
MOE_MIXTRAL = "model.moe={n_experts: 4, top_k: 2, expert_ffn_dim: 32}"
MOE_CASES = {
  # MLA + V3 router, 1 dense + 4 MoE layers: 2 MoE layers per stage, experts over 2 devices.
  "v3_dense_first_gpipe_expert2": (
    [*MLA, MOE_V3, "model.n_layers=5"],
    ["mesh.stage=2", "mesh.expert=2", "mesh.fsdp=2", "train.pipeline_microbatches=2"],
  ),
  # Every layer MoE, circular: each stage holds two groups of one layer, selective remat, ZeRO-3
  # with the experts' width over tensor.
  "mixtral_circular_tensor_zero3": (
    [MOE_MIXTRAL, "train.remat=selective", "train.sharding=zero3"],
    [
      "mesh.stage=2",
      "mesh.expert=2",
      "mesh.tensor=2",
      "mesh.fsdp=1",
      "train.pipeline_microbatches=2",
      "train.pipeline_repeats=2",
    ],
  ),
}


def moe_loss_and_grads(cfg, batch, mesh=None):
  """(loss, aux with the router's per-layer counts in depth order, gradients in depth order,
  the parameters as the trainer holds them)."""
  trainer = make_trainer(cfg, mesh=mesh)
  state = trainer.init(jax.random.key(0))
  grads, loss, aux = jax.jit(lambda p, b: _accumulated_grads(trainer, p, b, jnp.float32(1.0)))(
    state.params, batch
  )
  grads = pipeline.reorder_layers(grads, trainer.layout, (1, 1))
  aux = jax.device_get(aux)
  n_moe = aux["moe_counts"].shape[0]
  depth = np.argsort(pipeline.layer_order(n_moe, trainer.layout))
  aux["moe_counts"] = aux["moe_counts"][depth]
  return float(loss), aux, jax.device_get(nnx.to_pure_dict(grads)), state.params


@pytest.mark.parametrize(
  "case",
  [pytest.param(c, marks=pytest.mark.slow) if "circular" in c else c for c in MOE_CASES],
)
def test_moe_pipelines_equal_the_unpipelined_step(case):
  """Loss (with the balance and z losses), each MoE layer's expert counts and every gradient
  (routers and experts included) of the pipelined step equal the single-device step's."""
  model, piped = MOE_CASES[case]
  (batch,) = batches(1, batch=B)
  want = moe_loss_and_grads(config("base", *model), batch, mesh=single_device_mesh())
  got = moe_loss_and_grads(config("base", *model, *piped), batch)
  assert got[0] == pytest.approx(want[0], rel=1e-5)
  for key in ("ce", "moe_balance_loss", "moe_z_loss", "moe_dropped"):
    assert float(got[1][key]) == pytest.approx(float(want[1][key]), rel=1e-5, abs=1e-7), key
  np.testing.assert_array_equal(got[1]["moe_counts"], want[1]["moe_counts"])
  assert float(want[1]["moe_balance_loss"]) > 1.0  # the routers are not balanced: a real test
  assert_relative(got[2], want[2])
  # The stages split the MoE layers' stack; a dense first layer is whole on every stage.
  params = got[3]
  assert params["blocks"]["mlp"]["w_gate"][...].sharding.spec[0] == "stage"
  if "dense_blocks" in params:
    for leaf in jax.tree.leaves(params["dense_blocks"]):
      assert "stage" not in jax.tree.leaves(leaf.sharding.spec)


@pytest.mark.slow
def test_a_moe_train_step_through_the_stages_moves_the_selection_bias():
  """The train step of a pipelined DeepSeek-V3-routed model: finite, and the selection biases
  (stored stage by stage) step by the rate towards balance, as on one device."""
  model, piped = MOE_CASES["v3_dense_first_gpipe_expert2"]
  common = [*model, "train.moe_bias_update_rate=0.01"]
  (batch,) = batches(1, batch=B)
  biases = []
  for overrides, mesh in (([], single_device_mesh()), (piped, None)):
    trainer = make_trainer(config("base", *common, *overrides), mesh=mesh)
    state, metrics = make_train_step(trainer)(trainer.init(jax.random.key(0)), batch)
    assert np.isfinite(float(metrics["loss"]))
    assert float(metrics["moe_load_max"]) > 1.0
    biases.append(np.asarray(state.params["blocks"]["mlp"]["score_bias"][...]))
  np.testing.assert_array_equal(biases[1], biases[0])
  assert set(np.unique(np.abs(biases[0]))) <= {0.0, np.float32(0.01)}
  assert np.abs(biases[0]).sum() > 0


@pytest.mark.parametrize(
  "moe, message",
  [
    (
      "model.moe={n_experts: 4, top_k: 2, expert_ffn_dim: 16, sparse_step: 2}",
      r"model.moe.sparse_step=2 is not allowed: with mesh.stage=2 the dense layers must all come "
      r"before the MoE ones .* these layers run as dense x1, MoE x1, dense x1, MoE x1",
    ),
    (
      "model.moe={n_experts: 4, top_k: 2, expert_ffn_dim: 16, dense_layers: [3]}",
      r"model.moe.dense_layers=\[3\] is not allowed: with mesh.stage=2 .* MoE x3, dense x1",
    ),
    (
      "model.moe={n_experts: 4, top_k: 2, expert_ffn_dim: 16, first_k_dense: 1}",
      r"model.n_layers=4 is not allowed: leaves 3 MoE layers after the 1 dense ones, and the "
      r"pipeline stages split the MoE layers: their count must be divisible by mesh.stage x "
      r"train.pipeline_repeats = 2 x 1",
    ),
  ],
)
def test_moe_layouts_a_pipeline_cannot_split_are_named(moe, message):
  with pytest.raises(ConfigError, match=message):
    load_config(None, [*TINY, moe, "mesh.stage=2"])


def test_a_batch_the_pipeline_cannot_split_is_named():
  # 8 rows over fsdp 4: 2 rows per data shard, not divisible into 4 micro-batches.
  cfg = load_config(None, [*TINY, "mesh.stage=2", "mesh.fsdp=4", "train.pipeline_microbatches=4"])
  with pytest.raises(
    ConfigError,
    match=r"train.batch_size=8 is not allowed: must split into train.grad_accum=1 x 4 "
    r"data-parallel shards .* by train.pipeline_microbatches=4 and by mesh.stage=2: a multiple "
    r"of 16",
  ):
    make_trainer(cfg)
  # mesh.stage=-1 takes the devices the others leave: checked once the mesh is built.
  cfg = load_config(None, [*TINY, "mesh.stage=-1", "mesh.fsdp=1", "mesh.tensor=1"])
  with pytest.raises(ConfigError, match=r"model.n_layers=4 .* = 8 x 1"):
    make_trainer(cfg)


def test_bf16_and_the_pallas_kernel_through_the_stages():
  """bf16 compute with the Pallas FlashAttention (interpreted on CPU) inside the stages: the
  unpipelined step's loss and gradients to bf16 rounding."""
  common = ["train.precision=bf16", "attention.implementation=pallas", "model.max_seq_len=16"]
  (batch,) = batches(1, batch=B)
  want = loss_and_grads(config("llama", *common), batch, mesh=single_device_mesh())
  piped = [*STAGE2_FSDP2_TENSOR2, "train.pipeline_microbatches=2", "train.pipeline_repeats=2"]
  got = loss_and_grads(config("llama", *common, *piped), batch)
  assert got[0] == pytest.approx(want[0], rel=1e-3)
  largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(want[2]))
  assert_relative(got[2], want[2], tol=5e-2, floor=1e-2 * largest)


@pytest.mark.slow
def test_fp16_overflow_and_the_nan_policy_through_the_stages():
  """A loss scale that overflows fp16 skips the step and halves the scale; a non-finite
  parameter (on_nan=stop) skips the update and records the step, as without stages."""
  piped = ["mesh.stage=2", "mesh.fsdp=4", "train.pipeline_microbatches=2"]
  trainer = make_trainer(config("llama", *piped, "train.precision=fp16", "train.loss_scale=1e30"))
  step = make_train_step(trainer)
  state = trainer.init(jax.random.key(0))
  before = jax.device_get(nnx.to_pure_dict(state.params))
  state, m = step(state, batches(1, batch=B)[0])
  assert int(m["skipped"]) == 1 and float(state.loss_scale.scale) == pytest.approx(5e29)
  for a, b in zip(
    jax.tree.leaves(jax.device_get(nnx.to_pure_dict(state.params))), jax.tree.leaves(before)
  ):
    np.testing.assert_array_equal(a, b)

  trainer = make_trainer(config("llama", *piped))
  step = make_train_step(trainer)
  state, _ = step(trainer.init(jax.random.key(0)), batches(1, batch=B)[0])
  wq = state.params["blocks"]["attn"]["wq"]
  wq.set_value(wq[...].at[0, 0, 0, 0].set(jnp.inf))  # a block on the first stage
  kept = np.asarray(state.params["embed"][...])
  state, m = step(state, batches(2, batch=B)[1])
  assert int(state.first_nonfinite) == 2 and int(m["skipped"]) == 1
  np.testing.assert_array_equal(state.params["embed"][...], kept)
