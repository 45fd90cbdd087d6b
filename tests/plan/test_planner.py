"""The planner's figures against the real modules: parameter counts against the initialised model,
KV bytes against the allocated cache arrays, per-device state against the trainer's shardings on
8 fake CPU devices, activation bytes against the train step's saved residuals, FLOPs against XLA.

All real-module figures come from `atlas_jax.measure` (shapes only, nothing allocated).
"""

import dataclasses

import jax
import pytest
from flax import nnx

from atlas_jax import measure
from atlas_jax.config import Config, load_config
from atlas_jax.model.lora import resolve
from atlas_jax.plan import compute, memory, params
from atlas_jax.plan.planner import PlanInputs, make_plan, model_kv_bytes_per_token
from atlas_jax.training import sharding as shd

# A Llama-family shape whose dimensions are all different, so a swapped axis cannot pass.
ODD = [
  "model.vocab_size=101",
  "model.d_model=48",
  "model.n_heads=6",
  "model.n_kv_heads=2",
  "model.head_dim=10",
  "model.ffn_dim=70",
  "model.n_layers=4",
  "model.max_seq_len=64",
  "train.seq_len=13",
]
ODD_MLA = [
  "model.vocab_size=101",
  "model.d_model=48",
  "model.n_heads=6",
  "model.n_kv_heads=6",
  "model.ffn_dim=70",
  "model.n_layers=4",
  "model.max_seq_len=64",
  "train.seq_len=13",
  "model.mla.kv_lora_rank=20",
  "model.mla.qk_rope_head_dim=6",
  "model.mla.qk_nope_head_dim=8",
  "model.mla.v_head_dim=12",
  "model.mla.q_lora_rank=30",
]

MODELS = {
  "tiny": ("tiny", []),
  "small": ("small", []),
  "llama3-8b": ("llama3-8b", []),
  "llama3-70b": ("llama3-70b", []),
  "deepseek-tiny": ("deepseek-tiny", []),
  "odd-tied-bias": ("tiny", [*ODD, "model.tie_embeddings=true", "model.qkv_bias=true"]),
  "odd-qk-norm-mqa": ("tiny", [*ODD, "model.qk_norm=true", "model.n_kv_heads=1"]),
  "mla-no-q-lora": ("deepseek-tiny", [*ODD_MLA, "model.mla.q_lora_rank=null", "model.mtp=null"]),
  "mla-parallel-mtp": (
    "deepseek-tiny",
    [*ODD_MLA, "model.mtp.kind=parallel", "model.mtp.n_predict=2"],
  ),
  # Mixture of experts: DeepSeek-V2-Lite's layout; V3's router bias, an MoE MTP head and a dense
  # prefix; Qwen2-MoE's gated shared expert and a dense layer mid-stack; OLMoE's all-heads norm.
  "moe-v2-lite": ("deepseek-v2-lite-tiny", []),
  "moe-v3-mtp": (
    "deepseek-v2-lite-tiny",
    [
      "model.moe.scoring=sigmoid",
      "model.moe.topk_method=noaux_tc",
      "model.moe.n_group=2",
      "model.moe.topk_group=1",
      "model.mtp={kind: sequential, n_predict: 1}",
    ],
  ),
  "moe-qwen2": (
    "tiny",
    [
      *ODD,
      "model.qkv_bias=true",
      "model.moe={n_experts: 6, top_k: 2, expert_ffn_dim: 14, shared_ffn_dim: 22,"
      " shared_expert_gate: true, dense_layers: [2]}",
    ],
  ),
  "moe-olmoe": (
    "tiny",
    [
      *ODD,
      "model.qk_norm=true",
      "model.qk_norm_scope=all_heads",
      "model.moe={n_experts: 4, top_k: 1, expert_ffn_dim: 14}",
    ],
  ),
}


def config(name: str, *extra: str) -> Config:
  preset, overrides = MODELS[name]
  return load_config(f"configs/{preset}.yaml", [*overrides, *extra])


@pytest.mark.parametrize("name", list(MODELS))
def test_parameter_counts_match_the_initialised_model(name):
  cfg = config(name).model
  real = measure.param_counts(cfg)
  planned = params.counts(cfg)
  assert planned.total == real["total"]
  assert planned.blocks == real["blocks"] + real.get("dense_blocks", 0)
  assert planned.embed == real["embed"]
  assert (0 if planned.tied else planned.lm_head) == real.get("lm_head", 0)
  assert planned.mtp == real.get("mtp", 0)
  # Routed experts: every [.., E, ...] expert weight of the real model, a token using k / E.
  flat = jax.tree_util.tree_leaves_with_path(
    nnx.state(measure.abstract_model(cfg), nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)
  )
  routed = sum(
    v.size
    for path, v in flat
    if "experts" in shd.logical_axes_of(v) and str(path[-1].key) in ("w_gate", "w_up", "w_down")
  )
  assert planned.experts + planned.mtp_experts == routed
  if cfg.moe is not None:
    k, E = cfg.moe.top_k, cfg.moe.n_experts
    assert planned.active == planned.inference - planned.experts + planned.experts * k // E
  # Every parameter's shape, not just the sum.
  shapes = sorted(p.shape for p in params.inventory(cfg) if p.trainable)
  real_params = nnx.state(measure.abstract_model(cfg), nnx.Param)
  assert shapes == sorted(tuple(x.shape) for x in jax.tree.leaves(real_params))


@pytest.mark.parametrize("name", list(MODELS))
def test_logical_axes_are_the_ones_the_model_declares(name):
  """The planner shards what the trainer shards: same shapes and logical axes per parameter."""
  cfg = config(name).model
  planned = sorted((p.shape, p.axes) for p in params.inventory(cfg))
  state = nnx.state(measure.abstract_model(cfg))  # the router biases too
  leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  real = sorted((tuple(v.shape), shd.logical_axes_of(v)) for v in leaves)
  assert planned == real


def test_published_parameter_counts():
  # Meta's released checkpoints: Llama-3(.1)-8B 8,030,261,248 and -70B 70,553,706,496 parameters.
  assert params.counts(config("llama3-8b").model).total == 8_030_261_248
  assert params.counts(config("llama3-70b").model).total == 70_553_706_496


@pytest.mark.parametrize("name", ["tiny", "odd-qk-norm-mqa", "deepseek-tiny", "mla-no-q-lora"])
@pytest.mark.parametrize("dtype,dtype_bytes", [("bfloat16", 2), ("float32", 4)])
def test_kv_bytes_match_the_allocated_caches(name, dtype, dtype_bytes):
  cfg = config(name).model
  per_token = model_kv_bytes_per_token(cfg, dtype_bytes)
  # The model's own contiguous cache (KVCache, or LatentCache for MLA).
  assert measure.cache_bytes(cfg, batch=3, length=40, dtype=dtype) == per_token * 3 * 40
  # A paged pool (KVPool / LatentPool) of P blocks of Z slots.
  assert measure.paged_pool_bytes(cfg, n_blocks=7, block_size=16, dtype=dtype) == per_token * 7 * 16
  # The plan's paged figure is a pool of exactly the blocks one sequence needs.
  plan = make_plan(
    cfg,
    PlanInputs(
      seq_len=40,
      batch=3,
      devices=1,
      precision="bf16" if dtype_bytes == 2 else "fp32",
      block_size=16,
    ),
  )
  kv = plan["kv_cache"]
  assert kv["blocks_per_sequence"] == 3
  assert kv["paged_bytes_per_sequence"] == measure.paged_pool_bytes(
    cfg, n_blocks=3, block_size=16, dtype=dtype
  )
  assert kv["bytes_batch"] == measure.cache_bytes(cfg, batch=3, length=40, dtype=dtype)


def test_kv_alternatives_are_the_caches_those_attentions_allocate():
  cfg = config("tiny").model
  assert 1 < cfg.n_kv_heads < cfg.n_heads  # GQA: all three alternatives differ
  rows = {
    r["kind"]: r
    for r in make_plan(cfg, PlanInputs(seq_len=64, batch=1, devices=1))["kv_cache"]["alternatives"]
  }
  for kind, kv_heads in (("MHA", cfg.n_heads), ("GQA", cfg.n_kv_heads), ("MQA", 1)):
    other = dataclasses.replace(cfg, n_kv_heads=kv_heads)
    assert rows[kind]["kv_heads"] == kv_heads
    assert rows[kind]["bytes_per_sequence"] == measure.cache_bytes(
      other, batch=1, length=64, dtype="bfloat16"
    )


STRATEGY_CASES = [
  ("tiny", "dp", 1),
  ("tiny", "zero1", 1),
  ("tiny", "zero2", 1),
  ("tiny", "zero3", 1),
  ("tiny", "tensor", 1),  # 8 query heads split 8 ways; 4 kv heads and the 259 vocab replicated
  ("tiny", "zero3", 2),
  ("odd-tied-bias", "zero3", 2),  # D=48 splits 4 ways; the 101-token vocab never splits
  ("odd-qk-norm-mqa", "tensor", 1),
  ("odd-qk-norm-mqa", "zero2", 4),
  # MLA's low-rank axes take the fsdp split where there is no embed axis; MTP heads are sharded
  # like blocks.
  ("deepseek-tiny", "zero3", 1),
  ("deepseek-tiny", "zero3", 2),
  ("mla-no-q-lora", "zero2", 1),
  ("mla-parallel-mtp", "tensor", 1),
]
# Expert parallelism: the experts split over `expert`, with ZeRO and tensor parallelism.
EXPERT_CASES = [
  ("moe-v2-lite", "dp", 1, 8),
  ("moe-v3-mtp", "zero3", 2, 2),  # the router bias: saved, no gradient, no Adam moments
  ("moe-qwen2", "zero1", 1, 2),  # 6 experts do not split 4 ways: replicated, as the trainer does
  ("moe-olmoe", "zero2", 2, 4),
]


def _trainer_config(name: str, strategy: str, tensor: int, expert: int = 1) -> Config:
  mesh = memory.mesh_for(strategy, 8, tensor, expert=expert)
  sharding = "dp" if strategy == "tensor" else strategy
  return config(
    name,
    f"mesh.data={mesh['data']}",
    f"mesh.fsdp={mesh['fsdp']}",
    f"mesh.expert={mesh['expert']}",
    f"mesh.tensor={mesh['tensor']}",
    f"train.sharding={sharding}",
    "train.precision=bf16",
  )


@pytest.mark.parametrize(
  "name,strategy,tensor,expert", [(*c, 1) for c in STRATEGY_CASES] + EXPERT_CASES
)
def test_state_bytes_per_device_match_the_sharded_train_state(name, strategy, tensor, expert):
  cfg = _trainer_config(name, strategy, tensor, expert)
  real = measure.train_state_bytes(cfg, shd.make_mesh(cfg.mesh))
  plan = memory.state_bytes(cfg.model, strategy=strategy, devices=8, tensor=tensor, expert=expert)
  assert (plan.params, plan.grads, plan.opt_state) == (
    real["params"],
    real["grads"],
    real["opt_state"],
  )


@pytest.mark.parametrize(
  "name,strategy,tensor", [("tiny", "zero3", 2), ("deepseek-tiny", "zero2", 1)]
)
def test_lora_state_bytes_match_the_sharded_train_state(name, strategy, tensor):
  """With LoRA the planner counts the base weights as parameters only, and the adapters (split
  as the weights they adapt) with gradients and Adam moments, as the trainer holds them."""
  mesh = memory.mesh_for(strategy, 8, tensor)
  cfg = config(
    name,
    f"mesh.fsdp={mesh['fsdp']}",
    f"mesh.tensor={tensor}",
    f"train.sharding={strategy}",
    "train.lora={rank: 4, targets: [attn, mlp]}",
  )
  real = measure.train_state_bytes(cfg, shd.make_mesh(cfg.mesh))
  adapters = resolve(cfg.model, cfg.train.lora)
  lora = (adapters.rank, adapters.targets)
  plan = memory.state_bytes(cfg.model, strategy=strategy, devices=8, tensor=tensor, lora=lora)
  assert (plan.params, plan.grads, plan.opt_state) == (
    real["params"],
    real["grads"],
    real["opt_state"],
  )
  full = memory.state_bytes(cfg.model, strategy=strategy, devices=8, tensor=tensor)
  assert plan.grads < full.grads / 4 and plan.params > full.params


@pytest.mark.parametrize(
  "name,strategy,tensor,fmt",
  [("tiny", "zero3", 2, "int4"), ("tiny", "dp", 1, "int8"), ("deepseek-tiny", "zero2", 1, "fp8")],
)
def test_qlora_state_bytes_match_the_sharded_train_state(name, strategy, tensor, fmt):
  """QLoRA (train.base_quantization): the planner counts the base's projections at their
  quantized bytes (int4 two to a byte) plus their float32 scales, as the trainer's arrays hold
  them sharded, and the adapters' gradients and moments alone."""
  mesh = memory.mesh_for(strategy, 8, tensor)
  cfg = config(
    name,
    f"mesh.fsdp={mesh['fsdp']}",
    f"mesh.data={mesh['data']}",
    f"mesh.tensor={tensor}",
    f"train.sharding={strategy}",
    "train.lora={rank: 4, targets: [attn, mlp]}",
    f"train.base_quantization={fmt}",
    "train.base_quantization_group_size=32",
  )
  real = measure.train_state_bytes(cfg, shd.make_mesh(cfg.mesh))
  adapters = resolve(cfg.model, cfg.train.lora)
  lora = (adapters.rank, adapters.targets)
  plan = memory.state_bytes(
    cfg.model,
    strategy=strategy,
    devices=8,
    tensor=tensor,
    lora=lora,
    base_quantization=(fmt, 32),
  )
  assert (plan.params, plan.grads, plan.opt_state) == (
    real["params"],
    real["grads"],
    real["opt_state"],
  )
  lora_only = memory.state_bytes(cfg.model, strategy=strategy, devices=8, tensor=tensor, lora=lora)
  assert plan.params < lora_only.params and plan.grads == lora_only.grads


def test_state_bytes_of_a_8b_model_on_8_devices_by_eval_shape():
  """Llama-3-8B under ZeRO-3 and under ZeRO-2 x 2-way tensor parallelism: never allocated."""
  for strategy, tensor in (("zero3", 1), ("zero2", 2)):
    mesh = memory.mesh_for(strategy, 8, tensor)
    cfg = config(
      "llama3-8b",
      f"mesh.fsdp={mesh['fsdp']}",
      f"mesh.tensor={tensor}",
      f"train.sharding={strategy}",
    )
    real = measure.train_state_bytes(cfg, shd.make_mesh(cfg.mesh))
    plan = memory.state_bytes(cfg.model, strategy=strategy, devices=8, tensor=tensor)
    assert (plan.params, plan.grads, plan.opt_state) == (
      real["params"],
      real["grads"],
      real["opt_state"],
    )


ACTIVATION_CASES = [
  ("odd-tied-bias", "fp32", "xla"),
  ("odd-tied-bias", "bf16", "pallas"),
  ("odd-qk-norm-mqa", "bf16", "xla"),
  ("mla-no-q-lora", "bf16", "pallas"),
  ("mla-parallel-mtp", "fp32", "xla"),
  ("deepseek-tiny", "bf16", "xla"),
]


@pytest.mark.parametrize("policy", memory.REMAT_POLICIES)
@pytest.mark.parametrize("name,precision,impl", ACTIVATION_CASES)
def test_activation_bytes_match_the_saved_residuals(name, precision, impl, policy, loss_chunk=0):
  cfg = config(
    name,
    "train.seq_len=24",
    f"train.precision={precision}",
    # "xla" is counted as the reference computes it, every [T, S] score kept; the CPU's
    # blocked causal path keeps fewer scores and a head-major copy of q, k and v.
    f"attention.implementation={'reference' if impl == 'xla' else impl}",
    f"train.remat={policy}",
    f"train.loss_chunk={loss_chunk}",
  )
  real = measure.saved_activation_bytes(cfg, batch=3)
  planned = memory.activation_bytes(
    cfg.model,
    policy=policy,
    batch=3,
    seq_len=24,
    compute_bytes=memory.PRECISIONS[precision],
    attention="xla" if impl == "xla" else "flash",
    loss_chunk=loss_chunk,
  )
  # Exact up to a few scalars and constants (under 100 bytes).
  assert abs(planned.saved - real) <= max(100, 1e-3 * real), (planned.saved, real)


@pytest.mark.parametrize("fmt,policy", [("int8", "none"), ("int4", "none"), ("int4", "every_k")])
def test_qlora_activations_keep_no_compute_copy_of_the_quantized_weights(fmt, policy):
  """bf16 compute without remat: a LoRA step keeps each projection's bf16 copy for its backward
  pass, a QLoRA step only the copy of its scales. The planner's difference between the two is
  the real step's saved residuals' (the adapters' own residuals, which it does not count, cancel
  out)."""
  sets = ("train.seq_len=24", "train.precision=bf16", f"train.remat={policy}")
  sets += ("train.lora={rank: 4}", "attention.implementation=reference")
  lora = config("tiny", *sets)
  qlora = config(
    "tiny", *sets, f"train.base_quantization={fmt}", "train.base_quantization_group_size=64"
  )
  real = measure.saved_activation_bytes(lora, batch=3) - measure.saved_activation_bytes(
    qlora, batch=3
  )
  plan = lambda **kw: (
    memory.activation_bytes(
      lora.model, policy=policy, batch=3, seq_len=24, compute_bytes=2, attention="xla", **kw
    ).saved
  )
  assert (real > 0) == (policy == "none")  # every_k recomputes the copies: none is kept
  assert plan() - plan(base_quantization=(fmt, 64)) == real


@pytest.mark.parametrize(
  "name,precision,policy",
  [
    ("odd-tied-bias", "fp32", "full"),  # tied: the chunked loss reads the table untransposed
    ("odd-qk-norm-mqa", "bf16", "selective"),  # bf16: no compute-dtype copy of the head kept
    ("deepseek-tiny", "bf16", "full"),  # the MTP head's loss is chunked too
  ],
)
def test_chunked_loss_activation_bytes_match_the_saved_residuals(name, precision, policy):
  test_activation_bytes_match_the_saved_residuals(name, precision, "xla", policy, loss_chunk=5)


def test_remat_orders_memory_and_every_k_grows_like_sqrt_layers():
  cfg = config("tiny", "train.seq_len=64").model
  act = {
    p: memory.activation_bytes(cfg, policy=p, batch=2, seq_len=64, compute_bytes=2).saved
    for p in memory.REMAT_POLICIES
  }
  assert act["none"] > act["selective"] > act["full"] > act["every_k"]
  deep = dataclasses.replace(cfg, n_layers=64)
  full = memory.activation_bytes(deep, policy="full", batch=2, seq_len=64, compute_bytes=2)
  every = memory.activation_bytes(deep, policy="every_k", batch=2, seq_len=64, compute_bytes=2)
  # k = 8: 8 group inputs kept instead of 64, and 8 blocks rebuilt at a time instead of 1.
  assert every.recompute == 8 * full.recompute


def test_flops_per_token_against_xla_cost_analysis():
  cfg = config(
    "tiny", "train.seq_len=64", "model.max_seq_len=128", "attention.implementation=reference"
  )
  B, T = 2, 64
  xla = measure.train_step_flops(cfg, batch=B)
  # The reference computes the whole T x T score matrix: compare with the non-causal count.
  ours = compute.train_flops_per_token(cfg.model, T, causal=False) * B * T
  assert 0.9 < xla / ours < 1.15, xla / ours


@pytest.mark.parametrize("name", ["tiny", "odd-tied-bias"])
def test_matmul_parameters_are_the_trainers_count(name):
  """The N of 6N is what train.py's MFU uses (the embedding gather out, a tied head in)."""
  from atlas_jax.training.metrics import matmul_params

  cfg = config(name).model
  abstract = nnx.state(measure.abstract_model(cfg), nnx.Param)
  real = jax.tree.map(lambda x: jax.numpy.zeros(x.shape, x.dtype), abstract)  # cheap to make
  assert params.counts(cfg).matmul == matmul_params(real)
