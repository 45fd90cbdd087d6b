"""Published figures, computed from the real configs and checked against the real modules at full
size by `jax.eval_shape` (nothing allocated), with a note where the common write-up differs."""

import dataclasses

import pytest

from atlas_jax import measure
from atlas_jax.config import Config, TrainConfig
from atlas_jax.plan import memory, params
from atlas_jax.plan.models import REFERENCE_MODELS
from atlas_jax.plan.planner import PlanInputs, make_plan
from atlas_jax.training.checkpoint import single_device_mesh


def plan(name: str, **inputs):
  fields = dict(seq_len=4096, batch=1, devices=1, precision="fp16")
  fields.update(inputs)
  return make_plan(REFERENCE_MODELS[name].model, PlanInputs(**fields), name=name)


def test_llama2_70b_kv_cache_at_4096_tokens():
  """80 layers x 8 kv heads x 128 dims x (K and V) x 2 bytes = 327,680 B per token: 1.34 GB
  (1.25 GiB) for a 4096-token sequence in fp16.

  A popular write-up puts it near 9-10 GB with the MHA formula (64 heads): that is what the
  planner's MHA row gives, 10.7 GB, 8x too much for the released model, which uses GQA-8.
  """
  kv = plan("llama-2-70b")["kv_cache"]
  assert kv["bytes_per_token"] == 2 * 80 * 8 * 128 * 2 == 327_680
  assert kv["bytes_per_sequence"] == 1_342_177_280
  cfg = REFERENCE_MODELS["llama-2-70b"].model
  assert measure.cache_bytes(cfg, batch=1, length=4096, dtype="float16") == 1_342_177_280
  mha = next(r for r in kv["alternatives"] if r["kind"] == "MHA")
  assert mha["bytes_per_sequence"] == 10_737_418_240 == 8 * kv["bytes_per_sequence"]


def test_llama3_8b_gqa_caches_4x_less_than_mha():
  kv = plan("llama-3-8b")["kv_cache"]
  mha = next(r for r in kv["alternatives"] if r["kind"] == "MHA")
  assert kv["bytes_per_token"] == 131_072 and mha["bytes_per_token"] == 524_288
  assert mha["vs_model"] == 4.0  # 32 query heads / 8 kv heads
  cfg = REFERENCE_MODELS["llama-3-8b"].model
  real_gqa = measure.cache_bytes(cfg, batch=1, length=4096, dtype="bfloat16")
  real_mha = measure.cache_bytes(
    dataclasses.replace(cfg, n_kv_heads=32), batch=1, length=4096, dtype="bfloat16"
  )
  assert real_mha == 4 * real_gqa == mha["bytes_per_sequence"]


@pytest.mark.parametrize("name,layers", [("deepseek-v3", 61), ("deepseek-v2", 60)])
def test_deepseek_mla_reduction(name, layers):
  """MLA caches kv_lora_rank 512 + rope 64 = 576 numbers per token and layer; MHA over the same
  128 heads would cache 128 x (192 + 128) = 40,960: 71.1x. (The DeepSeek-V2 paper's 57x compares
  against MHA with 128-dim keys: 2 x 128 x 128 / 576.)"""
  kv = plan(name, precision="bf16")["kv_cache"]
  assert kv["bytes_per_token_per_layer"] == 576 * 2
  assert kv["bytes_per_token"] == layers * 576 * 2
  mha = next(r for r in kv["alternatives"] if r["kind"] == "MHA")
  assert mha["bytes_per_token"] == layers * 128 * (192 + 128) * 2
  assert mha["vs_model"] == pytest.approx(40960 / 576) == pytest.approx(71.11, abs=0.01)
  cfg = REFERENCE_MODELS[name].model
  assert (
    measure.cache_bytes(cfg, batch=1, length=4096, dtype="bfloat16") == kv["bytes_per_sequence"]
  )
  assert (
    measure.paged_pool_bytes(cfg, n_blocks=256, block_size=16, dtype="bfloat16")
    == (kv["paged_bytes_per_sequence"])
  )


def test_7b_mixed_precision_adam_is_16_bytes_per_parameter():
  """Llama-2-7B: float32 master weights (4) + float32 gradients (4) + Adam's two float32 moments
  (8) = 16 bytes per parameter, 108 GB on one device. The ZeRO paper's 16 splits as 2 + 2 + 12
  (fp16 weights and gradients, fp32 master copy and moments); the total is the same."""
  cfg = REFERENCE_MODELS["llama-2-7b"].model
  n = 6_738_415_616
  st = memory.state_bytes(cfg, strategy="dp", devices=1)
  assert (st.params, st.grads) == (4 * n, 4 * n)
  assert st.opt_state == 8 * n + 4  # + the int32 update count
  assert st.total == 16 * n + 4
  # The trainer's own state for this config, on one device, by eval_shape.
  real = measure.train_state_bytes(
    Config(model=cfg, train=TrainConfig(precision="bf16", seq_len=128)), single_device_mesh()
  )
  assert (real["params"], real["grads"], real["opt_state"]) == (st.params, st.grads, st.opt_state)


def test_zero3_is_about_one_over_n():
  cfg = REFERENCE_MODELS["llama-2-7b"].model
  dp = memory.state_bytes(cfg, strategy="dp", devices=64).total
  for n in (8, 64, 512):
    z3 = memory.state_bytes(cfg, strategy="zero3", devices=n).total
    # Only the tiny replicated leaves (step counters) keep it off exactly 1/N.
    assert z3 == pytest.approx(dp / n, rel=1e-6)
  # ZeRO-1 and -2 stop at 4 + 4 + 8/N and 4 + (4 + 8)/N bytes per parameter.
  n = 6_738_415_616
  assert memory.state_bytes(cfg, strategy="zero1", devices=8).total == pytest.approx(9 * n)
  assert memory.state_bytes(cfg, strategy="zero2", devices=8).total == pytest.approx(5.5 * n)


def test_chinchilla_and_time_to_train():
  p = plan("llama-2-7b", devices=8, device="A100", mfu=0.5, seq_len=4096, batch=8)
  c = p["compute"]
  assert c["chinchilla_tokens"] == 20 * 6_738_415_616
  # 6N + attention, N = the 6.74B minus the 131M embedding table.
  n_matmul = 6_738_415_616 - 32000 * 4096
  assert c["flops_per_token_6n"] == 6 * n_matmul
  assert c["attention_flops_per_token"] == 6 * 32 * 4096 * 32 * 128
  assert c["seconds"] == pytest.approx(c["tokens"] * c["flops_per_token"] / (8 * 312e12 * 0.5))


def test_decode_ceiling_is_bytes_over_bandwidth():
  p = plan("llama-2-70b", device="H100", precision="bf16", batch=1)
  d = p["decode"]["one_device_batch_1"]
  weights = p["decode"]["weight_bytes"]
  assert weights == 2 * (68_976_648_192 - 32000 * 8192)  # the embedding table is gathered
  assert d["bytes_per_step"] == weights + 1_342_177_280
  assert d["tokens_per_s"] == pytest.approx(3.35e12 / d["bytes_per_step"])
  assert d["memory_bound"]


# Published total and active parameters (billions, as released), with the digit they are given
# to. DeepSeek counts the activated parameters without the embedding table (the planner's
# `matmul_active`; DeepSeek-V2-Lite's 2.4B is 2.45B with it left out, 2.66B with it); GLM-4.5-Air's
# 12B is read the same way (12.8B; 13.4B with it), and gpt-oss-20b's 3.61B (4.19B with it; its
# 20.91B total is the planner's to the last digit); Mistral and Qwen count it (`active`).
PUBLISHED_MOE = {
  "deepseek-v2-lite": (15.7, 0.1, 2.4, 0.1, "matmul_active"),
  "deepseek-v2": (236, 1, 21, 1, "matmul_active"),
  "deepseek-v3": (671, 1, 37, 1, "matmul_active"),
  "mixtral-8x7b": (46.7, 0.1, 12.9, 0.1, "active"),
  "qwen3-30b-a3b": (30.5, 0.1, 3.3, 0.1, "active"),
  "glm-4.5-air": (106, 1, 12, 1, "matmul_active"),
  "gpt-oss-20b": (20.91, 0.01, 3.61, 0.01, "matmul_active"),
}


@pytest.mark.parametrize("name", list(PUBLISHED_MOE))
def test_mixture_of_experts_total_and_active_parameters(name):
  """The planner's counts within the published figures' last digit, and exactly the real
  modules' at full size (`jax.eval_shape`: no memory allocated)."""
  total, total_digit, active, active_digit, kind = PUBLISHED_MOE[name]
  cfg = REFERENCE_MODELS[name].model
  pc = params.counts(cfg)
  assert abs(pc.inference / 1e9 - total) <= total_digit, pc.inference  # DeepSeek-V3: no MTP
  assert abs(getattr(pc, kind) / 1e9 - active) <= active_digit, getattr(pc, kind)
  real = measure.param_counts(cfg)
  assert pc.total == real["total"] and pc.mtp == real.get("mtp", 0)
  # FLOPs per token follow the active experts: 6 x the active matmul parameters (no MTP here).
  p = plan(name, precision="bf16")
  assert p["compute"]["flops_per_token_6n"] == 6 * (pc.matmul_active + pc.mtp_active)
  assert p["params"]["active"] == pc.active < pc.total / 3


def test_deepseek_v3_expert_memory_per_device_under_the_expert_axis():
  """ZeRO-1 on 64 devices, 8-way expert parallel: each device keeps 1/8 of the 58 + 1 (MTP) MoE
  layers' 256 routed experts (32 each) in float32, and of their routers and biases; the rest of
  the parameters whole."""
  cfg = REFERENCE_MODELS["deepseek-v3"].model
  st = memory.state_bytes(cfg, strategy="zero1", devices=64, expert=8)
  pc = params.counts(cfg)
  assert st.mesh == {"data": 1, "fsdp": 8, "expert": 8, "stage": 1, "tensor": 1}
  assert st.experts == 4 * (pc.experts + pc.mtp_experts) // 8
  routers = 59 * 7168 * 256
  whole = pc.total - pc.experts - pc.mtp_experts - routers
  assert st.params == 4 * whole + st.experts + 4 * (routers + 59 * 256) // 8


def test_phi4_mini_parameters_and_kv_cache():
  """Phi-4-mini: 3,836,021,760 parameters (the released safetensors' count; tied embeddings), the
  real modules' at full size; 32 layers x 8 kv heads x 128 dims x (K and V) x 2 bytes per token.
  The preset `configs/phi4-mini.yaml` is the same model."""
  from pathlib import Path

  from atlas_jax.config import load_config

  cfg = REFERENCE_MODELS["phi-4-mini"].model
  assert (cfg.rotary_dim, cfg.rope_scaling.type) == (96, "longrope")
  pc = params.counts(cfg)
  assert pc.total == measure.param_counts(cfg)["total"] == 3_836_021_760
  kv = plan("phi-4-mini", precision="bf16")["kv_cache"]
  assert kv["bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131_072
  preset = load_config(Path(__file__).parents[2] / "configs" / "phi4-mini.yaml").model
  assert dataclasses.replace(preset, dtype="bfloat16", param_dtype="bfloat16") == cfg


# Released parameter counts of the language models (Gemma 3's 4B and 27B checkpoints add a
# vision tower of 0.4B the planner does not hold).
PUBLISHED_DENSE = {
  "gemma-3-1b": 999_885_952,
  "gemma-3-4b": 3_880_263_168,
  "gemma-3-27b": 27_009_346_304,
  "smollm3-3b": 3_075_098_624,
}


@pytest.mark.parametrize("name", list(PUBLISHED_DENSE))
def test_patterned_families_parameters_and_kv_cache(name):
  """Gemma 3 (post-norms, QK-norm, local and global layers) and SmolLM3 (NoPE layers): the
  planner's count is the real modules' at full size, and the released one; the cache holds every
  layer's K and V for each token (the server keeps the windowed layers' blocks too)."""
  cfg = REFERENCE_MODELS[name].model
  pc = params.counts(cfg)
  assert pc.total == measure.param_counts(cfg)["total"] == PUBLISHED_DENSE[name]
  kv = plan(name, precision="bf16")["kv_cache"]
  assert kv["bytes_per_token"] == 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2


def test_windowed_layers_bound_decode_reads_and_an_all_windowed_pool():
  """Gemma-3-1B at 32k tokens: a decode step reads 512 tokens' K/V on each of its 22 local
  layers and all 32,768 on the 4 global ones; the server keeps every block of the global layers
  and a window's of the local ones (their own pool). A model whose every layer slides holds
  only its window's blocks per sequence."""
  T = 32768
  cfg = REFERENCE_MODELS["gemma-3-1b"].model
  kv = plan("gemma-3-1b", precision="bf16", seq_len=T)["kv_cache"]
  per_layer = 2 * 1 * 256 * 2  # K and V, one kv head of 256 dims, bf16
  assert kv["bytes_per_token_per_layer"] == per_layer
  assert kv["decode_read_bytes_per_sequence"] == per_layer * (22 * 512 + 4 * T)
  blocks, Z = kv["blocks_per_sequence"], kv["block_size"]
  assert kv["window"] == 512 and kv["windowed_layers"] == 22
  assert kv["held_blocks_per_sequence"] == blocks
  assert kv["held_window_blocks_per_sequence"] == -(-511 // Z) + 1
  held = 4 * blocks + 22 * (-(-511 // Z) + 1)  # blocks summed over the layers
  assert kv["held_bytes_per_sequence"] == per_layer * Z * held
  serving = plan("gemma-3-1b", precision="bf16", seq_len=T)["serving"]
  assert serving["sequences_per_replica"] == serving["pool_bytes_per_device"] * 26 // (
    serving["kv_bytes_per_token_per_device"] * held * Z
  )
  windowed = dataclasses.replace(cfg, layer_types=None)  # every layer slides
  p = make_plan(windowed, PlanInputs(seq_len=T, batch=1, devices=1, precision="bf16"))
  Z = p["kv_cache"]["block_size"]
  assert p["kv_cache"]["window"] == 512
  assert p["kv_cache"]["held_blocks_per_sequence"] == -(-511 // Z) + 1
  assert p["kv_cache"]["decode_read_bytes_per_sequence"] == per_layer * 26 * 512
  # Llama 4's pattern: chunks of 8,192 on three layers of four, held and read at most a chunk's.
  chunked = dataclasses.replace(
    cfg,
    sliding_window=None,
    attention_chunk_size=8192,
    layer_types=("chunked_attention",) * 3 + ("full_attention",),
    n_layers=4,
    rope_local_theta=None,
  )
  kv = make_plan(chunked, PlanInputs(seq_len=T, batch=1, devices=1, precision="bf16"))["kv_cache"]
  blocks, Z = kv["blocks_per_sequence"], kv["block_size"]
  assert kv["window"] == 8192 and kv["windowed_layers"] == 3
  assert kv["held_window_blocks_per_sequence"] == -(-8191 // Z) + 1
  held = blocks + 3 * (-(-8191 // Z) + 1)
  assert kv["held_bytes_per_sequence"] == per_layer * Z * held
  assert kv["decode_read_bytes_per_sequence"] == per_layer * (3 * 8192 + T)
