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

from atlas_jax.config import LORA_TARGETS, LoRAConfig, ModelConfig
from atlas_jax.devices import get_device
from atlas_jax.model.lora import resolve
from atlas_jax.plan import compute, memory
from atlas_jax.plan.kv import attention_kind, kv_bytes_per_token, mla_kv_bytes_per_token
from atlas_jax.plan.params import counts, lora_adapters

PRECISIONS = tuple(memory.PRECISIONS)


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
  attention: str = "flash"  # "flash" (GPU/TPU default) or "xla" (materialises probabilities)
  grad_accum: int = 1
  loss_chunk: int = 0  # > 0: the chunked cross-entropy (no [B, T, V] float32 logits kept)
  mfu: float = 0.4  # model FLOPs utilisation assumed for the time to train
  tokens: int | None = None  # training tokens; default Chinchilla-optimal
  block_size: int = 16  # paged KV cache block size (tokens)
  # LoRA (train.lora): adapters of this rank on these projections, the only trained parameters;
  # 0: every parameter trains.
  lora_rank: int = 0
  lora_targets: tuple[str, ...] = ("attn", "mlp")

  def __post_init__(self):
    for name in ("seq_len", "batch", "devices", "tensor", "expert", "grad_accum", "block_size"):
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
    memory.mesh_for(self.strategy, self.devices, self.tensor, self.expert)
    if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
      raise ValueError(f"--lora-rank={self.lora_rank!r} must be an integer >= 0 (0: no LoRA)")
    unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
    if unknown or not self.lora_targets:
      raise ValueError(
        f"--lora-targets={','.join(self.lora_targets)!r} is not allowed: each one of "
        f"{', '.join(LORA_TARGETS)}"
      )

    self.micro_batch(self.strategy, strict=True)

  def micro_batch(self, strategy: str, *, strict: bool = False) -> int:
    """Sequences one device runs per micro-batch under `strategy`.

    `strict`: the batch must split evenly (the trainer's requirement); else rounded up.
    """
    mesh = memory.mesh_for(strategy, self.devices, self.tensor, self._expert(strategy))
    replicas = mesh["data"] * mesh["fsdp"] * mesh["expert"]
    per_step = replicas * self.grad_accum
    if strict and self.batch % per_step:
      raise ValueError(
        f"--batch={self.batch} must be a multiple of {per_step} under --strategy={strategy} "
        f"({replicas} data-parallel replicas x --grad-accum={self.grad_accum})"
      )
    return -(-self.batch // per_step)

  def _expert(self, strategy: str) -> int:
    """Expert-parallel ways under `strategy` (the tensor strategy has none)."""
    return 1 if strategy == "tensor" else self.expert


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


def model_kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
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
  cfg: ModelConfig, inputs: PlanInputs, *, name: str = "model", notes: tuple[str, ...] = ()
) -> dict[str, Any]:
  """Every figure for `cfg` under `inputs`: a JSON-ready dict of bytes, tokens and FLOPs."""
  dev = get_device(inputs.device)
  c = memory.PRECISIONS[inputs.precision]
  T, B = inputs.seq_len, inputs.batch
  pc = counts(cfg)

  # KV cache (serving, in the compute dtype).
  per_token = model_kv_bytes_per_token(cfg, c)
  Z = inputs.block_size
  blocks = math.ceil(T / Z)
  alternatives = kv_alternatives(cfg, c)
  for row in alternatives:
    row["bytes_per_sequence"] = row["bytes_per_token"] * T
    row["vs_model"] = row["bytes_per_token"] / per_token
  kv = {
    "attention": attention_kind(cfg),
    "dtype_bytes": c,
    "bytes_per_token": per_token,
    "bytes_per_token_per_layer": per_token // cfg.n_layers,
    "bytes_per_sequence": per_token * T,
    "bytes_batch": per_token * T * B,
    "block_size": Z,
    "blocks_per_sequence": blocks,
    "paged_bytes_per_sequence": blocks * Z * per_token,
    "alternatives": alternatives,
  }

  # Training memory per device, every strategy at the selected remat policy.
  lora = None
  if inputs.lora_rank:
    adapters = resolve(cfg, LoRAConfig(rank=inputs.lora_rank, targets=inputs.lora_targets))
    lora = (adapters.rank, adapters.targets)
  trainable = pc.total if lora is None else sum(p.size for p in lora_adapters(cfg, *lora))
  strategies = []
  for strategy in memory.STRATEGIES:
    st = memory.state_bytes(
      cfg,
      strategy=strategy,
      devices=inputs.devices,
      tensor=inputs.tensor,
      expert=inputs._expert(strategy),
      lora=lora,
    )
    micro = inputs.micro_batch(strategy)
    act = memory.activation_bytes(
      cfg,
      policy=inputs.remat,
      batch=micro,
      seq_len=T,
      compute_bytes=c,
      attention=inputs.attention,
      remat_every=inputs.remat_every,
      loss_chunk=inputs.loss_chunk,
      tensor=st.mesh["tensor"],
    )
    total = st.total + act.peak
    strategies.append(
      {
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
        "activations_saved": act.saved,
        "activations_peak": act.peak,
        "total": total,
        "fits": total <= dev.hbm_bytes,
      }
    )
  selected = next(s for s in strategies if s["strategy"] == inputs.strategy)
  activations = []
  for policy in memory.REMAT_POLICIES:
    act = memory.activation_bytes(
      cfg,
      policy=policy,
      batch=selected["micro_batch"],
      seq_len=T,
      compute_bytes=c,
      attention=inputs.attention,
      remat_every=inputs.remat_every,
      loss_chunk=inputs.loss_chunk,
      tensor=selected["mesh"]["tensor"],
    )
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

  # Decode ceiling: one device, and the whole group with tensor parallelism. An MoE step reads
  # only the experts its batch reaches.
  weight_bytes = pc.matmul * c
  decode_flops = compute.decode_flops_per_token(cfg, T)
  decode = {"weight_bytes": weight_bytes, "cache_bytes_per_sequence": per_token * T}
  for key, n in (("one_device", 1), ("all_devices", inputs.devices)):
    for batch in sorted({1, B}):
      bound = compute.decode_bound(
        batch=batch,
        weight_bytes=round(compute.decode_weight_params(cfg, batch) * c),
        cache_bytes_per_seq=per_token * T,
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
    },
    "activations": activations,
    "compute": comp,
    "decode": decode,
  }
