"""The planner's serving figures against the engine's real arrays on 8 fake devices: weight and
pool bytes per device under tensor and data parallelism, kv heads repeated, MLA latents whole."""

import dataclasses

import pytest
from flax import nnx

from atlas_jax.config import MLAConfig, ModelConfig, MTPConfig
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
}


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("mesh", [(1, 1), (1, 4), (2, 4), (1, 8)], ids=lambda m: f"{m[0]}x{m[1]}")
def test_serving_bytes_per_device_are_the_engines(kind, mesh):
  cfg = MODELS[kind]
  dp, tp = mesh
  config = EngineConfig(n_blocks=8, block_size=4, data_parallel_size=dp, tensor_parallel_size=tp)
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
  assert (bound.all_reduce_bytes == 0) == (tp == 1)


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
