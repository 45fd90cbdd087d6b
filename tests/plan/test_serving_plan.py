"""The planner's serving figures against the engine's real arrays on 8 fake devices: weight and
pool bytes per device under tensor and data parallelism, kv heads repeated, MLA latents whole."""

import dataclasses
import re

import numpy as np
import pytest
from flax import nnx

from atlas_jax.config import MLAConfig, ModelConfig, MoEConfig, MTPConfig
from atlas_jax.decoding import SamplingParams
from atlas_jax.model import build
from atlas_jax.plan import compute, memory
from atlas_jax.plan.planner import PlanInputs, make_plan
from atlas_jax.serving.engine import Engine, EngineConfig

SHAPE = dict(vocab_size=48, d_model=32, n_layers=2, n_heads=8, ffn_dim=64, max_seq_len=128)
MODELS = {
  "gqa": ModelConfig(**SHAPE, n_kv_heads=2),
  "mla": ModelConfig(
    **SHAPE, n_kv_heads=8, mla=MLAConfig(16, 8, 8, 8, 12), mtp=MTPConfig("sequential", 1)
  ),
  # Routed experts split over the tensor axis by their FFN dimension; a dense first layer and a
  # shared expert like the dense MLP.
  "moe": ModelConfig(
    **SHAPE,
    n_kv_heads=2,
    moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=24, shared_ffn_dim=16, first_k_dense=1),
  ),
}


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("mesh", [(1, 1), (1, 4), (2, 4), (1, 8)], ids=lambda m: f"{m[0]}x{m[1]}")
def test_serving_bytes_per_device_are_the_engines(kind, mesh):
  cfg = MODELS[kind]
  dp, tp = mesh
  config = EngineConfig(
    runner="ragged", n_blocks=8, block_size=4, data_parallel_size=dp, tensor_parallel_size=tp
  )
  engine = Engine(build(cfg, rngs=nnx.Rngs(0)), config)
  runner = engine.runner
  assert memory.serving_weight_bytes(cfg, tensor=tp, dtype_bytes=4) == runner.weight_bytes
  per_token = memory.serving_kv_bytes_per_token(cfg, tensor=tp, dtype_bytes=4)
  assert per_token * 4 == runner.block_bytes()
  assert per_token * 4 * 8 == runner.pool_bytes
  bound = compute.serving_decode_bound(
    cfg,
    tensor=tp,
    data=dp,
    batch=6,
    context=100,
    dtype_bytes=4,
    bandwidth=1e12,
    peak_flops=1e15,
  )
  assert bound.weight_bytes == runner.weight_bytes
  assert bound.cache_bytes == 3 * 100 * per_token if dp == 2 else 6 * 100 * per_token
  assert (bound.all_reduce_bytes == 0) == (bound.all_gather_bytes == 0) == (tp == 1)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_8bit_pool_bytes_per_device_are_the_engines(kind, fmt):
  """--kv-cache-dtype: codes and their scales, counted as the engine allocates them (tensor 4:
  scales split with their kv heads; an MLA latent's held whole)."""
  cfg = MODELS[kind]
  config = EngineConfig(
    runner="ragged", n_blocks=8, block_size=4, tensor_parallel_size=4, kv_cache_dtype=fmt
  )
  runner = Engine(build(cfg, rngs=nnx.Rngs(0)), config).runner
  per_token = memory.serving_kv_bytes_per_token(cfg, tensor=4, dtype_bytes=4, kv_cache_dtype=fmt)
  assert per_token * 4 == runner.block_bytes()
  float_token = memory.serving_kv_bytes_per_token(cfg, tensor=4, dtype_bytes=4)
  assert per_token < float_token
  plan = make_plan(cfg, PlanInputs(seq_len=64, batch=8, devices=4, tensor=4, kv_cache_dtype=fmt))
  assert plan["serving"]["kv_bytes_per_token_per_device"] == per_token


def test_the_plan_has_a_serving_section():
  cfg = MODELS["gqa"]
  inputs = PlanInputs(seq_len=64, batch=8, devices=8, tensor=4, strategy="dp")
  plan = make_plan(cfg, inputs)
  sv = plan["serving"]
  assert (sv["tensor"], sv["data"], sv["kv_heads_served"]) == (4, 2, 4)
  assert sv["kv_bytes_per_token_per_device"] == 2 * 2 * 1 * 4 * 2  # one kv head a device, bf16
  one = make_plan(cfg, dataclasses.replace(inputs, tensor=1))
  assert one["serving"]["weight_bytes_per_device"] > sv["weight_bytes_per_device"]
  assert [b["batch"] for b in sv["bounds"]] == [2, 8]


def collectives(hlo: str, op: str) -> list[tuple[int, bool]]:
  """(elements, inside a while loop) of each message of each `op` (a tuple result: one per
  element) in a compiled module's text."""
  out = []
  for line in hlo.splitlines():
    if re.search(rf" {op}(-start)?\(", line):
      for dims in re.findall(r"\w+\[([\d,]*)\]", line.split(f" {op}")[0]):
        size = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        out.append((size, "/while/body/" in line))
  return out


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("mesh", [(1, 4), (2, 4)], ids=lambda m: f"{m[0]}x{m[1]}")
def test_the_collective_bytes_are_the_compiled_decode_steps(kind, mesh):
  """The planner's collective bytes per device are the compiled decode step's: all-reduces of
  two [B, D] messages per layer and one for the embedding, ring-reduced,
  and one all-gather of the [B, V] float32 logits over the tensor axis. Under tensor
  parallelism alone nothing else crosses devices (over a data axis too, the sampler's batch-wide
  choices and its top-k also meet the other replicas' rows: not counted by the planner)."""
  cfg = MODELS[kind]
  dp, tp = mesh
  config = EngineConfig(
    runner="ragged",
    n_blocks=16,
    block_size=4,
    data_parallel_size=dp,
    tensor_parallel_size=tp,
    min_batch_bucket=4,
  )
  # Layers unrolled (`unroll_layers`): every layer's collectives in the program's text, once.
  engine = Engine(build(cfg, rngs=nnx.Rngs(0), unroll_layers=True), config)
  runner = engine.runner
  engine.add_request("r", [1, 2, 3], SamplingParams(max_new_tokens=4))
  engine.step()  # the prompt: the request now decodes
  x, _ = runner.decode_record([engine.scheduler.row(engine.running[0], 1)], penalties=False)
  rows = x.tokens_RT.shape[0] // dp  # one replica's rows, as each device computes them
  hlo = (
    runner.programs.forward_sample.lower(runner.states, runner.pools, runner.on_devices(x))
    .compile()
    .as_text()
  )
  BD = rows * cfg.d_model
  if cfg.moe is None:  # two row-parallel outputs per layer, and the embedding
    reduced = [m for m in collectives(hlo, "all-reduce") if m[0] == BD]
    assert sorted(reduced) == (1 + 2 * cfg.n_layers) * [(BD, False)]
    sent = sum(n * 4 for n, _ in reduced)
  else:  # here one dense layer, one MoE layer with a shared expert: the MoE layer's routed down
    # projections reduced per slot, [B x k, D]
    if dp > 1:
      pytest.skip(
        "over a data axis the MoE layer's token sort spans the replicas (XLA gathers the "
        "routing and reduces the slots of every replica's rows): not counted by the planner"
      )
    k = cfg.moe.top_k
    reduced = [m for m in collectives(hlo, "all-reduce") if m[0] in (BD, k * BD)]
    assert sorted(reduced) == 5 * [(BD, False)] + [(k * BD, False)]
    sent = sum(n * 4 for n, _ in reduced)
  planned = compute.all_reduce_bytes(cfg, tensor=tp, rows=rows, dtype_bytes=4)
  assert planned == sent * 2 * (tp - 1) // tp
  logits = (rows * cfg.vocab_size, False)
  assert collectives(hlo, "all-gather").count(logits) == 1  # the float32 logits
  gathered = rows * cfg.vocab_size * 4 * (tp - 1) // tp
  assert compute.logits_gather_bytes(cfg, tensor=tp, rows=rows) == gathered
  if dp == 1:
    assert collectives(hlo, "all-reduce") == reduced
    assert collectives(hlo, "all-gather") == [logits]
    for op in ("all-to-all", "reduce-scatter", "collective-permute"):
      assert collectives(hlo, op) == [], op


def test_serving_across_hosts_counts_the_all_reduce_bytes_leaving_each_host():
  """Per-device figures do not depend on the hosts; a replica whose tensor axis spans h hosts
  sends 2 (h - 1) / h of each all-reduced message out of every host: here the embedding's and
  each layer's attention and MLP outputs, [rows, D] in bf16."""
  cfg = dataclasses.replace(MODELS["gqa"], n_heads=16)  # 2 dense layers, D = 32
  message = 3 * 32 * 2  # rows 3
  host_bytes = lambda tensor, per_host: compute.all_reduce_host_bytes(
    cfg, tensor=tensor, devices_per_host=per_host, rows=3, dtype_bytes=2
  )
  assert host_bytes(8, 8) == 0
  assert host_bytes(16, 8) == 5 * message  # 2 hosts: every message once
  assert host_bytes(16, 4) == 5 * message * 2 * 3 // 4
  inputs = PlanInputs(seq_len=64, batch=6, devices=16, tensor=8, strategy="dp")
  two_replicas = make_plan(cfg, inputs)["serving"]
  one_replica = make_plan(cfg, dataclasses.replace(inputs, tensor=16))["serving"]
  assert (two_replicas["hosts"], two_replicas["hosts_per_replica"]) == (2, 1)
  assert (one_replica["hosts"], one_replica["hosts_per_replica"]) == (2, 2)
  assert all(b["all_reduce_bytes_leaving_each_host"] == 0 for b in two_replicas["bounds"])
  assert [b["all_reduce_bytes_leaving_each_host"] for b in one_replica["bounds"]] == [
    5 * 1 * 32 * 2,  # batch 1
    5 * 6 * 32 * 2,  # batch 6: every row on the one replica
  ]
  with pytest.raises(ValueError, match="--devices-per-host=0"):
    PlanInputs(devices_per_host=0)
