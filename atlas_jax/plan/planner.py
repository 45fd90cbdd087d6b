"""The planner: every memory and compute figure of a model config, as plain numbers.

    from atlas_jax.plan.planner import PlanInputs, make_plan
    plan = make_plan(model_cfg, PlanInputs(seq_len=4096, batch=8, devices=8, device="H100"))
    plan["kv_cache"]["bytes_per_sequence"]        # bytes; every figure is bytes, tokens or FLOPs

Pure arithmetic on the config (`atlas_jax.plan.params`, `memory`, `compute`, `kv`); nothing
is built or allocated. `tests/plan` checks each figure against the real modules.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from atlas_jax.config import LORA_TARGETS, LoRAConfig, ModelConfig, pipelined_layers
from atlas_jax.devices import get_device
from atlas_jax.model.lora import resolve
from atlas_jax.plan import compute, memory
from atlas_jax.plan import pipeline as pipeline_plan
from atlas_jax.plan.kv import (
  KV_CACHE_DTYPES,
  attention_kind,
  cached_vector_bytes,
  kv_bytes_per_token,
  mla_kv_bytes_per_token,
)
from atlas_jax.plan.params import counts, lora_adapters
from atlas_jax.schedule import Schedule

PRECISIONS = tuple(memory.PRECISIONS)
FP8_WEIGHTS = ("keep", "dequantize")  # serve.py --fp8-weights
# The share of each device's memory a serving plan gives weights and pool (vLLM's default
# gpu_memory_utilization; the largest step's activations are not counted here).
SERVING_MEMORY_UTILIZATION = 0.9


@dataclasses.dataclass(frozen=True)
class PlanInputs:
  """What to plan for. Validated on construction; errors name the flag and the allowed values."""

  seq_len: int = 4096  # tokens per sequence (training) / context (serving)
  batch: int = 8  # global batch (training, split over data-parallel devices); sequences served
  devices: int = 8
  strategy: str = "zero3"  # the strategy the summary and activations use
  tensor: int = 1  # tensor-parallel ways combined with dp / zero1-3
  expert: int = 1  # expert-parallel ways (MoE models), out of the data-parallel devices
  remat: str = "full"
  remat_every: int | None = None
  precision: str = "bf16"  # compute dtype: activations, KV cache and served weights
  device: str = "H100"
  memory_bytes: int | None = None  # memory per device in place of the device's own (--memory)
  attention: str = "flash"  # "flash" (GPU/TPU default) or "xla" (materialises probabilities)
  grad_accum: int = 1
  pipeline: int = 1  # pipeline stages (mesh.stage); the other axes share devices / pipeline
  microbatches: int = 1  # pipeline micro-batches per accumulation step
  repeats: int = 1  # layer groups per stage (circular schedule when > 1)
  loss_chunk: int = 0  # > 0: the chunked cross-entropy (no [B, T, V] float32 logits kept)
  mfu: float = 0.4  # model FLOPs utilisation assumed for the time to train
  tokens: int | None = None  # training tokens; default Chinchilla-optimal
  block_size: int = 16  # paged KV cache block size (tokens)
  kv_cache_dtype: str = "auto"  # serving's pool: the compute dtype, or 8-bit codes and scales
  devices_per_host: int = 8  # serving across hosts: a replica's tensor axis spans hosts of these
  # LoRA (train.lora): adapters of this rank on these projections, the only trained parameters;
  # 0: every parameter trains.
  lora_rank: int = 0
  lora_targets: tuple[str, ...] = ("attn", "mlp")
  # QLoRA (train.base_quantization): the frozen base's projections held quantized (int8, int4
  # in groups of `base_quantization_group_size` inputs, fp8); None: float32.
  base_quantization: str | None = None
  base_quantization_group_size: int = 128
  # An FP8 folder's projections as serve.py --fp8-weights holds them: "keep" (e4m3 codes and
  # float32 scales) or "dequantize" (the serving dtype); other sources ignore it.
  fp8_weights: str = "keep"

  def __post_init__(self):
    names = ("seq_len", "batch", "devices", "tensor", "expert", "grad_accum", "block_size")
    for name in (*names, "pipeline", "microbatches", "repeats", "devices_per_host"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"--{name.replace('_', '-')}={value!r} must be an integer >= 1")
    if self.strategy not in memory.STRATEGIES:
      raise ValueError(
        f"--strategy={self.strategy!r} is not allowed; allowed: {', '.join(memory.STRATEGIES)}"
      )
    if self.remat not in memory.REMAT_POLICIES:
      raise ValueError(
        f"--remat={self.remat!r} is not allowed; allowed: {', '.join(memory.REMAT_POLICIES)}"
      )
    if self.kv_cache_dtype not in KV_CACHE_DTYPES:
      raise ValueError(
        f"--kv-cache-dtype={self.kv_cache_dtype!r} is not allowed; allowed: "
        f"{', '.join(KV_CACHE_DTYPES)}"
      )
    if self.fp8_weights not in FP8_WEIGHTS:
      raise ValueError(
        f"--fp8-weights={self.fp8_weights!r} is not allowed; allowed: {', '.join(FP8_WEIGHTS)}"
      )
    if self.precision not in PRECISIONS:
      raise ValueError(
        f"--precision={self.precision!r} is not allowed; allowed: {', '.join(PRECISIONS)}"
      )
    if self.attention not in memory.ATTENTION_IMPLS:
      raise ValueError(
        f"--attention={self.attention!r} is not allowed; allowed: "
        f"{', '.join(memory.ATTENTION_IMPLS)}"
      )
    if (
      not isinstance(self.loss_chunk, int)
      or isinstance(self.loss_chunk, bool)
      or (self.loss_chunk < 0)
    ):
      raise ValueError(f"--loss-chunk={self.loss_chunk!r} must be an integer >= 0")
    get_device(self.device)  # raises naming the known devices
    if not 0 < self.mfu <= 1:
      raise ValueError(f"--mfu={self.mfu!r} must be in (0, 1]")
    if self.tokens is not None and self.tokens < 1:
      raise ValueError(f"--tokens={self.tokens!r} must be >= 1")
    if self.devices % self.tensor:
      raise ValueError(f"--tensor={self.tensor} must divide --devices={self.devices}")
    if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
      raise ValueError(f"--lora-rank={self.lora_rank!r} must be an integer >= 0 (0: no LoRA)")
    unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
    if unknown or not self.lora_targets:
      raise ValueError(
        f"--lora-targets={','.join(self.lora_targets)!r} is not allowed: each one of "
        f"{', '.join(LORA_TARGETS)}"
      )
    if self.base_quantization is not None:
      if self.base_quantization not in memory.QUANT_BITS:
        raise ValueError(
          f"--base-quantization={self.base_quantization!r} is not allowed; allowed: "
          f"{', '.join(memory.QUANT_BITS)}"
        )
      if not self.lora_rank:
        raise ValueError(
          f"--base-quantization={self.base_quantization} needs --lora-rank > 0 (a quantized "
          "base is frozen: only adapters train over it)"
        )
    if self.pipeline == 1:
      for name in ("microbatches", "repeats"):
        if getattr(self, name) != 1:
          raise ValueError(
            f"--{name}={getattr(self, name)} needs --pipeline > 1 (pipeline stages); without "
            "stages use --grad-accum for micro-batches"
          )
    if self.repeats > 1 and self.microbatches < self.pipeline:
      raise ValueError(
        f"--microbatches={self.microbatches} must be >= --pipeline={self.pipeline} with "
        f"--repeats={self.repeats} > 1 (the circular schedule)"
      )
    # raises if not
    memory.mesh_for(self.strategy, self.devices, self.tensor, self.pipeline, self.expert)

  def micro_batch(self, strategy: str) -> int:
    """Sequences one data-parallel shard runs per accumulation step under `strategy` (rounded
    up where the batch does not split: `batch_constraint` says so)."""
    return -(-self.batch // self._per_step(strategy)[0])

  def _per_step(self, strategy: str) -> tuple[int, int]:
    mesh = memory.mesh_for(
      strategy, self.devices, self.tensor, self.pipeline, self._expert(strategy)
    )
    replicas = mesh["data"] * mesh["fsdp"] * mesh["expert"]
    return replicas * self.grad_accum, replicas

  def _expert(self, strategy: str) -> int:
    """Expert-parallel ways under `strategy` (the tensor strategy has none)."""
    return 1 if strategy == "tensor" else self.expert

  def batch_constraint(self, strategy: str) -> str | None:
    """Why the batch does not split as the trainer splits it under `strategy`; None if it does.
    The state per device holds whatever the batch; the activations need the split."""
    per_step, replicas = self._per_step(strategy)
    need = per_step
    if self.pipeline > 1:
      need *= math.lcm(self.microbatches, self.pipeline)
    if self.batch % need == 0:
      return None
    pipe = (
      f" x lcm(--microbatches={self.microbatches}, --pipeline={self.pipeline})"
      if self.pipeline > 1
      else ""
    )
    return (
      f"--batch={self.batch} must be a multiple of {need} under --strategy={strategy} "
      f"({replicas} data-parallel replicas x --grad-accum={self.grad_accum}{pipe})"
    )

  @property
  def schedule(self) -> Schedule:
    return Schedule(self.pipeline, self.microbatches, self.repeats)


def kv_alternatives(cfg: ModelConfig, dtype_bytes: int) -> list[dict[str, Any]]:
  """Bytes per token the same model would cache with MHA, GQA, MQA and MLA attention.

  Dense heads cache a key of H_qk and a value of H_v per kv head and layer (for an MLA model,
  the N heads it decompresses). The GQA row uses the model's own kv heads when it has GQA, else 8
  (Llama-2/3's choice) or the nearest divisor of N. A dense model's MLA row uses DeepSeek-V2's
  proportions: a latent of 4H plus a rope key of H/2 per layer (Section 2.1.2 of its paper).
  """
  L, N = cfg.n_layers, cfg.n_heads
  if cfg.mla is None:
    qk = v = cfg.head_dim
    latent = (4 * cfg.head_dim, cfg.head_dim // 2)
  else:
    qk, v = cfg.mla.qk_head_dim, cfg.mla.v_head_dim
    latent = (cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim)
  if cfg.mla is None and 1 < cfg.n_kv_heads < N:
    gqa = cfg.n_kv_heads
  else:
    gqa = min((k for k in range(2, N) if N % k == 0), key=lambda k: (abs(k - 8), k), default=N)

  def dense(k: int) -> int:
    return L * k * (qk + v) * dtype_bytes

  rows = [
    {"kind": "MHA", "kv_heads": N, "bytes_per_token": dense(N)},
    {"kind": "GQA", "kv_heads": gqa, "bytes_per_token": dense(gqa)},
    {"kind": "MQA", "kv_heads": 1, "bytes_per_token": dense(1)},
    {
      "kind": "MLA",
      "kv_lora_rank": latent[0],
      "rope_dim": latent[1],
      "bytes_per_token": mla_kv_bytes_per_token(L, latent[0], latent[1], dtype_bytes),
    },
  ]
  return rows


def model_kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, kv_cache_dtype="auto") -> int:
  if kv_cache_dtype != "auto":  # 8-bit codes and a scale per vector
    if cfg.mla is not None:
      width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
      return cfg.n_layers * cached_vector_bytes(width, dtype_bytes, kv_cache_dtype)
    vector = cached_vector_bytes(cfg.head_dim, dtype_bytes, kv_cache_dtype)
    return 2 * cfg.n_layers * cfg.n_kv_heads * vector
  if cfg.mla is not None:
    m = cfg.mla
    return mla_kv_bytes_per_token(cfg.n_layers, m.kv_lora_rank, m.qk_rope_head_dim, dtype_bytes)
  return kv_bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype_bytes)


def _model_summary(cfg: ModelConfig) -> dict[str, Any]:
  out = {
    "attention": attention_kind(cfg),
    "n_layers": cfg.n_layers,
    "d_model": cfg.d_model,
    "n_heads": cfg.n_heads,
    "n_kv_heads": cfg.n_heads if cfg.mla is not None else cfg.n_kv_heads,
    "head_dim": cfg.head_dim,
    "ffn_dim": cfg.ffn_dim,
    "vocab_size": cfg.vocab_size,
  }
  if cfg.mla is not None:
    out.update(
      kv_lora_rank=cfg.mla.kv_lora_rank,
      qk_rope_head_dim=cfg.mla.qk_rope_head_dim,
      qk_nope_head_dim=cfg.mla.qk_nope_head_dim,
      v_head_dim=cfg.mla.v_head_dim,
      q_lora_rank=cfg.mla.q_lora_rank,
    )
  if cfg.mtp is not None:
    out.update(mtp_kind=cfg.mtp.kind, mtp_heads=cfg.mtp.n_predict)
  if cfg.moe is not None:
    m = cfg.moe
    out.update(
      n_experts=m.n_experts,
      top_k=m.top_k,
      expert_ffn_dim=m.expert_ffn_dim,
      shared_ffn_dim=m.shared_ffn_dim,
      moe_layers=sum(cfg.sparse_layers()),
      router=f"{m.scoring} {m.topk_method}",
    )
  return out


def make_plan(
  cfg: ModelConfig,
  inputs: PlanInputs,
  *,
  name: str = "model",
  notes: tuple[str, ...] = (),
  fp8: memory.FP8Folder | None = None,
) -> dict[str, Any]:
  """Every figure for `cfg` under `inputs`: a JSON-ready dict of bytes, tokens and FLOPs. `fp8`:
  the model is an FP8 folder's, served with `inputs.fp8_weights`."""
  dev = get_device(inputs.device)
  if inputs.memory_bytes is not None:
    dev = dataclasses.replace(dev, name=f"{dev.name}, {inputs.memory_bytes / 1e9:g} GB")
    dev = dataclasses.replace(dev, hbm_bytes=inputs.memory_bytes)
  c = memory.PRECISIONS[inputs.precision]
  T, B = inputs.seq_len, inputs.batch
  pc = counts(cfg)

  # KV cache (serving: in the compute dtype, or 8-bit codes with their scales).
  per_token = model_kv_bytes_per_token(cfg, c, inputs.kv_cache_dtype)
  Z = inputs.block_size
  blocks = math.ceil(T / Z)
  alternatives = kv_alternatives(cfg, c)
  for row in alternatives:
    row["bytes_per_sequence"] = row["bytes_per_token"] * T
    row["vs_model"] = row["bytes_per_token"] / per_token
  # Sliding-window and chunked layers: a decode step reads at most a window's (a chunk's) K/V
  # on them, and the server holds only that many positions' blocks per sequence for them
  # (`AttentionKind.reach`; `Scheduler.forget_outside_window`; a pool of their own where other
  # layers attend to everything, `HybridPool`).
  kinds, index = cfg.attention_kinds()
  windows = [kinds[i].reach for i in index]
  read_tokens = sum(T if w is None else min(T, w) for w in windows)  # summed over the layers
  read_bytes = per_token // cfg.n_layers * read_tokens
  windowed = [w for w in windows if w is not None]
  bound = max(windowed) if windowed else None
  window_blocks = blocks if bound is None else min(blocks, -(-(bound - 1) // Z) + 1)
  held_blocks = window_blocks if len(windowed) == cfg.n_layers else blocks
  # Blocks held per sequence summed over the layers.
  held_layer_blocks = (cfg.n_layers - len(windowed)) * blocks + len(windowed) * window_blocks
  kv = {
    "attention": attention_kind(cfg),
    "dtype_bytes": c,
    "kv_cache_dtype": inputs.kv_cache_dtype,
    "bytes_per_token": per_token,
    "bytes_per_token_per_layer": per_token // cfg.n_layers,
    "bytes_per_sequence": per_token * T,
    "bytes_batch": per_token * T * B,
    "block_size": Z,
    "blocks_per_sequence": blocks,
    "paged_bytes_per_sequence": blocks * Z * per_token,
    # the windowed and chunked layers' (largest) window or chunk, None without any
    "window": bound,
    "windowed_layers": len(windowed),  # sliding-window and chunked layers
    # the most blocks a sequence holds in any layer: every block where a layer attends to
    # everything, else the window's (the chunk's)
    "held_blocks_per_sequence": held_blocks,
    "held_window_blocks_per_sequence": window_blocks if windowed else None,
    "held_bytes_per_sequence": held_layer_blocks * Z * per_token // cfg.n_layers,
    # each layer's window or chunk (or all) of the T tokens
    "decode_read_bytes_per_sequence": read_bytes,
    "alternatives": alternatives,
  }

  if inputs.pipeline > 1:
    try:  # the layers the stages split: all of them, or an MoE model's MoE layers
      staged = pipelined_layers(cfg, stages=inputs.pipeline)
    except ValueError as e:
      raise ValueError(f"--pipeline={inputs.pipeline}: {e}") from None
    if staged % (inputs.pipeline * inputs.repeats):
      what = f"n_layers={cfg.n_layers}" if staged == cfg.n_layers else f"{staged} MoE layers"
      raise ValueError(
        f"--pipeline={inputs.pipeline} x --repeats={inputs.repeats} must divide the model's {what}"
      )

  def activations_of(policy: str, micro: int, tensor: int) -> memory.ActivationBytes:
    common = dict(
      policy=policy,
      batch=micro,
      seq_len=T,
      compute_bytes=c,
      attention=inputs.attention,
      remat_every=inputs.remat_every,
      loss_chunk=inputs.loss_chunk,
      tensor=tensor,
    )
    quantized = None
    if inputs.base_quantization is not None:
      quantized = (inputs.base_quantization, inputs.base_quantization_group_size)
    return memory.activation_bytes(
      cfg, **common, schedule=inputs.schedule, base_quantization=quantized
    )

  # Training memory per device, every strategy at the selected remat policy. The state does not
  # depend on the batch; the activations need the batch to split as the trainer splits it.
  lora = None
  if inputs.lora_rank:
    adapters = resolve(cfg, LoRAConfig(rank=inputs.lora_rank, targets=inputs.lora_targets))
    lora = (adapters.rank, adapters.targets)
  trainable = pc.total if lora is None else sum(p.size for p in lora_adapters(cfg, *lora))
  quantized = None
  if inputs.base_quantization is not None:
    quantized = (inputs.base_quantization, inputs.base_quantization_group_size)
  strategies = []
  for strategy in memory.STRATEGIES:
    st = memory.state_bytes(
      cfg,
      strategy=strategy,
      devices=inputs.devices,
      tensor=inputs.tensor,
      stage=inputs.pipeline,
      expert=inputs._expert(strategy),
      lora=lora,
      base_quantization=quantized,
    )
    micro, constraint = inputs.micro_batch(strategy), inputs.batch_constraint(strategy)
    row = {
      "strategy": strategy,
      "mesh": st.mesh,
      "micro_batch": micro,
      "params": st.params,
      "grads": st.grads,
      "opt_state": st.opt_state,
      "expert_params": st.experts,
      "state": st.total,
      # Training state per model parameter on this device (16 unsharded without LoRA).
      "bytes_per_param": st.total / pc.total,
      "activations_saved": None,
      "activations_peak": None,
      "total": None,
      "fits": None,
      "constraint": constraint,
    }
    if constraint is None:
      act = activations_of(inputs.remat, micro, st.mesh["tensor"])
      total = st.total + act.peak
      row.update(
        activations_saved=act.saved,
        activations_peak=act.peak,
        total=total,
        fits=total <= dev.hbm_bytes,
      )
    strategies.append(row)
  selected = next(s for s in strategies if s["strategy"] == inputs.strategy)
  activations = []
  for policy in memory.REMAT_POLICIES:
    if selected["constraint"] is not None:
      break
    act = activations_of(policy, selected["micro_batch"], selected["mesh"]["tensor"])
    activations.append(
      {
        "policy": policy,
        "saved": act.saved,
        "recompute": act.recompute,
        "peak": act.peak,
        "per_layer_none": act.per_layer_none,
        "outside_blocks": act.outside_blocks,
      }
    )

  # Compute: FLOPs per token, time to train, Chinchilla.
  flops_tok = compute.train_flops_per_token(cfg, T)
  chinchilla = compute.chinchilla_tokens(pc.inference)  # Chinchilla counted dense models
  tokens = chinchilla if inputs.tokens is None else inputs.tokens
  seconds = compute.train_seconds(
    tokens, flops_tok, devices=inputs.devices, peak_flops=dev.peak_bf16_flops, mfu=inputs.mfu
  )
  comp = {
    "flops_per_token": flops_tok,
    "flops_per_token_6n": 6.0 * (pc.matmul_active + pc.mtp_active),
    "attention_flops_per_token": 3 * compute.attention_flops_per_token(cfg, T),
    "tokens": tokens,
    "chinchilla_tokens": chinchilla,
    "train_flops": flops_tok * tokens,
    "peak_flops_per_device": dev.peak_bf16_flops,
    "mfu": inputs.mfu,
    "seconds": seconds,
    "days": seconds / 86400,
  }

  # Pipeline: the schedule, its bubble and the step time it implies, the ppermute traffic.
  pipe = None
  if inputs.pipeline > 1:
    pipe = pipeline_plan.figures(
      cfg,
      rows=selected["micro_batch"],
      seq_len=T,
      compute_bytes=c,
      schedule=inputs.schedule,
      grad_accum=inputs.grad_accum,
      step_flops=flops_tok * T * B,
      devices=inputs.devices,
      peak_flops=dev.peak_bf16_flops,
      mfu=inputs.mfu,
    )
    pipe["constraint"] = selected["constraint"]
    comp["seconds_with_bubble"] = seconds / (1 - inputs.schedule.bubble)

  # Decode ceiling: one device, and the whole group with tensor parallelism. An MoE step reads
  # only the experts its batch reaches.
  weight_bytes = pc.matmul * c
  decode_flops = compute.decode_flops_per_token(cfg, T)
  decode = {"weight_bytes": weight_bytes, "cache_bytes_per_sequence": read_bytes}
  for key, n in (("one_device", 1), ("all_devices", inputs.devices)):
    for batch in sorted({1, B}):
      bound = compute.decode_bound(
        batch=batch,
        weight_bytes=round(compute.decode_weight_params(cfg, batch) * c),
        cache_bytes_per_seq=read_bytes,
        flops_per_token=decode_flops,
        bandwidth=n * dev.hbm_bytes_per_s,
        peak_flops=n * dev.peak_bf16_flops,
      )
      decode[f"{key}_batch_{batch}"] = {
        "devices": n,
        "batch": batch,
        "bytes_per_step": bound.bytes_per_step,
        "seconds_per_step": max(bound.memory_seconds, bound.compute_seconds),
        "tokens_per_s": bound.tokens_per_s,
        "memory_bound": bound.memory_bound,
      }

  # Serving over data x tensor devices: per-device memory and the decode ceiling.
  tp, dp = inputs.tensor, inputs.devices // inputs.tensor
  kept = fp8 if inputs.fp8_weights == "keep" else None
  weights_dev = memory.serving_weight_bytes(cfg, tensor=tp, dtype_bytes=c, fp8=kept)
  kv_dev = memory.serving_kv_bytes_per_token(
    cfg, tensor=tp, dtype_bytes=c, kv_cache_dtype=inputs.kv_cache_dtype
  )
  pool_dev = max(0, int(SERVING_MEMORY_UTILIZATION * dev.hbm_bytes) - weights_dev)
  serving = {
    "tensor": tp,
    "data": dp,
    "kv_heads_served": None if cfg.mla is not None else memory.served_config(cfg, tp).n_kv_heads,
    "fp8_weights": None if fp8 is None else inputs.fp8_weights,
    "weight_bytes_per_device": weights_dev,
    "attention_weight_bytes_per_device": memory.serving_weight_bytes(
      cfg, tensor=tp, dtype_bytes=c, attention_only=True, fp8=kept
    ),
    "kv_bytes_per_token_per_device": kv_dev,
    "memory_utilization": SERVING_MEMORY_UTILIZATION,
    "pool_bytes_per_device": pool_dev,
    "pool_tokens_per_replica": pool_dev // kv_dev,
    "sequences_per_replica": pool_dev * cfg.n_layers // (kv_dev * held_layer_blocks * Z),
    # Across hosts (serve.py --num-processes): the per-device figures stay; a replica whose
    # tensor axis spans hosts sends part of every all-reduce over the hosts' network.
    "devices_per_host": inputs.devices_per_host,
    "hosts": compute.hosts_spanned(inputs.devices, inputs.devices_per_host),
    "hosts_per_replica": compute.hosts_spanned(tp, inputs.devices_per_host),
    "bounds": [],
  }
  for batch in sorted({dp, max(B, dp)}):  # one sequence per replica, and the batch
    bound = compute.serving_decode_bound(
      cfg,
      tensor=tp,
      data=dp,
      batch=batch,
      context=T,
      dtype_bytes=c,
      bandwidth=dev.hbm_bytes_per_s,
      peak_flops=dev.peak_bf16_flops,
      link_bandwidth=dev.link_bytes_per_s,
    )
    serving["bounds"].append(
      {
        "batch": batch,
        "bytes_per_step_per_device": bound.bytes_per_step,
        "all_reduce_bytes_per_device": bound.all_reduce_bytes,
        "all_gather_bytes_per_device": bound.all_gather_bytes,
        "all_reduce_bytes_leaving_each_host": compute.all_reduce_host_bytes(
          cfg,
          tensor=tp,
          devices_per_host=inputs.devices_per_host,
          rows=-(-batch // dp),
          dtype_bytes=c,
        ),
        "seconds_per_step": batch / bound.tokens_per_s,
        "network_seconds": bound.network_seconds,
        "tokens_per_s": bound.tokens_per_s,
      }
    )

  if cfg.moe is not None:
    notes = (
      *notes,
      "mixture-of-experts layers: activation bytes are an estimate (k experts' SwiGLU in the "
      "dense formula), not checked against the train step; decode reads the experts a batch "
      "reaches under uniform routing",
    )
  return {
    "name": name,
    "notes": list(notes),
    "model": _model_summary(cfg),
    "inputs": dataclasses.asdict(inputs),
    "device": {
      "name": dev.name,
      "peak_bf16_flops": dev.peak_bf16_flops,
      "hbm_bytes": dev.hbm_bytes,
      "hbm_bytes_per_s": dev.hbm_bytes_per_s,
    },
    "params": {
      "total": pc.total,
      "embed": pc.embed,
      "lm_head": 0 if pc.tied else pc.lm_head,
      "blocks": pc.blocks,
      "per_layer": pc.per_layer,
      "mtp": pc.mtp,
      "matmul": pc.matmul,
      "matmul_active": pc.matmul_active,
      "experts": pc.experts,
      "active": pc.active,
      "inference": pc.inference,
      "inference_bytes": pc.inference * c,
    },
    "kv_cache": kv,
    "training": {
      "selected": inputs.strategy,
      "strategies": strategies,
      "trainable_params": trainable,
      "lora_rank": inputs.lora_rank,
      "base_quantization": inputs.base_quantization,
    },
    "activations": activations,
    "pipeline": pipe,
    "compute": comp,
    "decode": decode,
    "serving": serving,
  }
