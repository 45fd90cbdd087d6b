"""The planner's pipeline figures against the real trainer on 8 fake CPU devices: state per
device against the stage-sharded train state, activations against the residuals the compiled
pipelined step keeps per device, ppermute bytes and iterations against the compiled program."""

import dataclasses

import jax
import pytest

from atlas_jax import measure
from atlas_jax.config import load_config
from atlas_jax.plan import memory, models
from atlas_jax.plan import pipeline as pipeline_plan
from atlas_jax.plan.planner import PlanInputs, make_plan
from atlas_jax.schedule import Schedule
from atlas_jax.training import sharding as shd

from . import test_planner

# The odd shapes of test_planner (a swapped axis cannot pass), eight layers for four stages.
ODD = [*test_planner.ODD, "model.n_layers=8", "train.seq_len=12"]
MLA_MTP = [
  "model.n_kv_heads=6",
  "model.mla.kv_lora_rank=20",
  "model.mla.qk_rope_head_dim=6",
  "model.mla.qk_nope_head_dim=8",
  "model.mla.v_head_dim=12",
  "model.mla.q_lora_rank=30",
  "model.mtp.kind=sequential",
  "model.mtp.n_predict=1",
]


def config(*overrides):
  return load_config("configs/tiny.yaml", [*ODD, *overrides])


def pipe(p, U, r=1):
  return [f"mesh.stage={p}", f"train.pipeline_microbatches={U}", f"train.pipeline_repeats={r}"]


@pytest.mark.parametrize(
  "strategy, tensor, stage, model",
  [
    ("dp", 1, 2, []),
    ("zero1", 2, 2, []),
    ("zero2", 1, 4, []),
    ("zero3", 2, 2, []),
    ("zero3", 1, 4, MLA_MTP),  # MTP heads stay whole on every stage
    ("tensor", 1, 2, ["model.qk_norm=true"]),
  ],
)
def test_state_bytes_per_device_match_the_stage_sharded_train_state(strategy, tensor, stage, model):
  mesh = memory.mesh_for(strategy, 8, tensor, stage)
  cfg = config(
    *model,
    *(f"mesh.{axis}={size}" for axis, size in mesh.items()),
    f"train.sharding={'dp' if strategy == 'tensor' else strategy}",
    "train.batch_size=16",
    f"train.pipeline_microbatches={stage}",
  )
  real = measure.train_state_bytes(cfg, shd.make_mesh(cfg.mesh))
  plan = memory.state_bytes(cfg.model, strategy=strategy, devices=8, tensor=tensor, stage=stage)
  assert (plan.params, plan.grads, plan.opt_state) == (
    real["params"],
    real["grads"],
    real["opt_state"],
  )


@pytest.mark.parametrize(
  "name, strategy, tensor, extra",
  [
    # A dense first layer (whole on every stage), then 4 MoE layers split over the stages.
    ("moe-v2-lite", "zero3", 1, ["model.n_layers=5"]),
    # Every layer MoE (8 of them), the experts' width over tensor as well.
    ("moe-olmoe", "zero1", 2, []),
  ],
)
def test_moe_state_bytes_per_device_match_the_stage_and_expert_sharded_train_state(
  name, strategy, tensor, extra
):
  mesh = memory.mesh_for(strategy, 8, tensor, 2, 2)
  cfg = test_planner.config(
    name,
    *extra,
    *(f"mesh.{axis}={size}" for axis, size in mesh.items()),
    f"train.sharding={strategy}",
    "train.batch_size=16",
    "train.pipeline_microbatches=2",
  )
  real = measure.train_state_bytes(cfg, shd.make_mesh(cfg.mesh))
  plan = memory.state_bytes(
    cfg.model, strategy=strategy, devices=8, tensor=tensor, stage=2, expert=2
  )
  assert (plan.params, plan.grads, plan.opt_state) == (
    real["params"],
    real["grads"],
    real["opt_state"],
  )


def test_a_moe_plan_pipelines_its_moe_layers():
  """DeepSeek-V3 on 2048 GPUs, 16 stages x 8 expert ways: its 58 MoE layers do not split over 16
  stages (the 3 dense ones run before them), the 64 of a 67-layer variant do; Qwen2-MoE's dense
  layer after MoE ones cannot be pipelined at all."""
  v3 = models.get_reference("deepseek-v3").model
  with pytest.raises(ValueError, match=r"--pipeline=16 x --repeats=1 must divide the model's 58"):
    make_plan(v3, PlanInputs(devices=2048, batch=2048, pipeline=16, expert=8, seq_len=256))
  v3_64 = dataclasses.replace(v3, n_layers=67)
  inputs = PlanInputs(devices=2048, batch=4096, pipeline=16, microbatches=16, expert=8, seq_len=256)
  plan = make_plan(v3_64, inputs)
  zero3 = next(s for s in plan["training"]["strategies"] if s["strategy"] == "zero3")
  assert zero3["mesh"] == {"data": 1, "fsdp": 16, "expert": 8, "stage": 16, "tensor": 1}
  assert zero3["constraint"] is None and zero3["activations_peak"] > 0
  # float32 experts of 4 MoE layers per stage and of the MTP layer (whole on every stage), each
  # split over 8 expert x 16 fsdp ways.
  E, D, F = v3.moe.n_experts, v3.d_model, v3.moe.expert_ffn_dim
  assert zero3["expert_params"] == 4 * (4 + 1) * 3 * E * D * F // (8 * 16)
  assert plan["pipeline"]["iterations"] == 16 + 16 - 1
  qwen = test_planner.config("moe-qwen2").model
  with pytest.raises(ValueError, match=r"--pipeline=2: model.moe.dense_layers=\[2\] is not"):
    make_plan(qwen, PlanInputs(devices=8, batch=16, pipeline=2, microbatches=2))


# (overrides, devices): stages alone or beside data-parallel replicas, so that each residual's
# per-device share is what the planner models (its tensor-parallel activations are estimates).
ACTIVATION_CASES = {
  "gpipe_full": (["train.remat=full", *pipe(2, 4)], 2),
  "gpipe_4_stages_selective_bf16": (
    ["train.remat=selective", "train.precision=bf16", *pipe(4, 4)],
    4,
  ),
  "gpipe_none_bf16": (["train.remat=none", "train.precision=bf16", *pipe(2, 2)], 2),
  "gpipe_every_k_data2": (["train.remat=every_k", "mesh.data=2", *pipe(2, 4)], 4),
  "circular_full": (["train.remat=full", *pipe(2, 2, 2)], 2),
  "circular_none": (["train.remat=none", *pipe(2, 4, 2)], 2),
  "circular_none_bf16_flash": (
    ["train.remat=none", "train.precision=bf16", "attention.implementation=pallas", *pipe(2, 2, 2)],
    2,
  ),
  "mla_mtp_chunked_accum": (
    [*MLA_MTP, "train.remat=full", "train.loss_chunk=5", "train.grad_accum=2", *pipe(2, 2)],
    2,
  ),
  "parallel_mtp": (["model.mtp.kind=parallel", "model.mtp.n_predict=2", *pipe(2, 4)], 2),
}


# Under -m slow: full remat under GPipe (the circular and MLA cases keep it too) and no remat
# under the circular schedule (its bf16 flash case keeps it too).
SLOW_ACTIVATION_CASES = {"gpipe_full", "circular_none"}


@pytest.mark.parametrize(
  "case",
  [
    pytest.param(c, marks=pytest.mark.slow) if c in SLOW_ACTIVATION_CASES else c
    for c in ACTIVATION_CASES
  ],
)
def test_pipelined_activations_match_the_residuals_the_compiled_step_keeps(case):
  overrides, devices = ACTIVATION_CASES[case]
  # "xla" is counted as the reference computes it (test_planner's activation test says why).
  cfg = config(
    "attention.implementation=reference", "train.batch_size=16", "mesh.fsdp=1", *overrides
  )
  real = measure.saved_activation_bytes_per_device(
    cfg, mesh=shd.make_mesh(cfg.mesh, jax.devices()[:devices])
  )
  t, m = cfg.train, cfg.mesh
  schedule = Schedule(m.stage, t.pipeline_microbatches, t.pipeline_repeats)
  planned = memory.activation_bytes(
    cfg.model,
    policy=t.remat,
    batch=t.batch_size // t.grad_accum // m.data,
    seq_len=t.seq_len,
    compute_bytes=memory.PRECISIONS[t.precision],
    attention="xla" if cfg.attention.implementation == "reference" else "flash",
    loss_chunk=t.loss_chunk,
    schedule=schedule,
  )
  # To 0.5%, with the schedule's own indices and flags (a few int32 and bool scalars per
  # iteration), which the model leaves out.
  slack = 200 * schedule.iterations + 5e-3 * real
  assert abs(planned.saved - real) <= slack, (planned.saved, real)


@pytest.mark.parametrize(
  "overrides",
  [
    # The plain schedule under -m slow: the MTP and bf16 cases below are it with one change.
    pytest.param(["mesh.fsdp=4", *pipe(2, 2)], marks=pytest.mark.slow),
    ["mesh.fsdp=2", "mesh.tensor=2", *pipe(2, 4, 2), "train.sharding=zero3"],
    ["mesh.fsdp=2", *pipe(4, 4), "train.grad_accum=2", "train.batch_size=32"],
    ["mesh.fsdp=4", "model.mtp.kind=parallel", "model.mtp.n_predict=1", *pipe(2, 2)],
    ["mesh.fsdp=4", "train.precision=bf16", *pipe(2, 2)],
  ],
)
def test_ppermute_bytes_and_iterations_match_the_compiled_step(overrides):
  cfg = config("train.batch_size=16", *overrides)
  hlo = measure.compiled_train_step(cfg, mesh=shd.make_mesh(cfg.mesh))
  t, m = cfg.train, cfg.mesh
  sched = Schedule(m.stage, t.pipeline_microbatches, t.pipeline_repeats)
  c = memory.PRECISIONS[t.precision]
  planned = pipeline_plan.ppermute_bytes(
    cfg.model,
    rows=t.batch_size // t.grad_accum // (m.data * m.fsdp),
    seq_len=t.seq_len,
    compute_bytes=c,
    schedule=sched,
    grad_accum=t.grad_accum,
  )
  # One pipeline loop forward and one backward per accumulation step, U r + p - 1 iterations.
  assert measure.pipeline_loops(hlo) == [sched.iterations] * 2
  # XLA's CPU compiler widens bf16 collective-permutes to float32 (the program sends bf16).
  assert measure.collective_permute_bytes(hlo) == planned * 4 // c


def test_the_plan_reports_the_schedule_bubble_and_step_time():
  cfg = load_config("configs/llama3-70b.yaml").model
  inputs = PlanInputs(
    seq_len=4096, batch=32, devices=64, tensor=8, pipeline=4, microbatches=16, device="H100"
  )
  plan = make_plan(cfg, inputs)
  pp = plan["pipeline"]
  assert (pp["iterations"], pp["schedule"]) == (19, "GPipe")
  assert pp["bubble"] == pytest.approx(3 / 19)
  assert pp["step_seconds"] == pytest.approx(pp["step_seconds_without_bubble"] * 19 / 16)
  zero3 = next(s for s in plan["training"]["strategies"] if s["strategy"] == "zero3")
  assert zero3["mesh"] == {"data": 1, "fsdp": 2, "expert": 1, "stage": 4, "tensor": 8}
  # 32 rows over 2 replicas: 16 per shard, 16 micro-batches of 1 row, 4096 x 8192 bf16 each,
  # 19 iterations forward and back.
  assert pp["ppermute_bytes_per_step"] == 2 * 19 * 4096 * 8192 * 2
  circular = make_plan(cfg, PlanInputs(**{**inputs.__dict__, "repeats": 4}))["pipeline"]
  assert circular["iterations"] == 16 * 4 + 3
  assert circular["bubble"] == pytest.approx(3 / 67) and circular["bubble"] < pp["bubble"]
