"""FLOPs per token, time to train, the Chinchilla-optimal token count and the decode ceiling.

FLOPs follow the PaLM appendix (Chowdhery et al. 2022): a token costs 2 FLOPs per matmul
parameter forward and twice that backward, 6N in all (N excludes the embedding gather, includes
the output head), plus attention: QK^T and PV, 2 * L * N_heads * (H_qk + H_v) FLOPs per key
forward, over T/2 keys on average for a causal T-token sequence. Multi-token-prediction heads add
their parameters to N, one more use of the shared output head and one attention layer each.

Batch-1 decoding is memory bound: every step reads every weight once plus the sequence's cache,
so tokens/s <= bandwidth / (weight bytes + cache bytes). A larger batch shares the weight read.

Served over a (data, tensor) mesh (`serving_decode_bound`), each device reads its shard of the
weights and its replica's sequences' cache per step (an MLA latent is read whole on every tensor
device), at its own bandwidth, and the tensor devices all-reduce the row-parallel outputs (the
attention output and down projections of every layer, and the vocabulary-parallel embedding):
a ring all-reduce moves 2 (t - 1) / t of each message per device, over the interconnect. The
sampler then all-gathers the vocabulary-parallel head's float32 logits once (a ring all-gather:
(t - 1) / t of them per device).

Mixture-of-experts models: a token's FLOPs count only its k routed experts of E (`counts(cfg)`'s
active parameters), and a decode step reads only the experts its batch reaches.
"""

from __future__ import annotations

import dataclasses

from atlas_jax.config import ModelConfig
from atlas_jax.plan.memory import serving_kv_bytes_per_token, serving_weight_bytes
from atlas_jax.plan.params import counts

# Hoffmann et al. 2022 ("Training Compute-Optimal Large Language Models"): about 20 training
# tokens per parameter minimise loss for a given compute budget.
CHINCHILLA_TOKENS_PER_PARAM = 20


def _head_dims(cfg: ModelConfig) -> tuple[int, int]:
  """(query/key head dim, value head dim)."""
  if cfg.mla is None:
    return cfg.head_dim, cfg.head_dim
  return cfg.mla.qk_head_dim, cfg.mla.v_head_dim


def attention_flops_per_token(
  cfg: ModelConfig, context: int, *, causal: bool = True, n_layers: int | None = None
) -> float:
  """Forward attention FLOPs of one token of a `context`-token sequence (every layer).

  Causal: the average token of a sequence sees half of it (the PaLM convention).
  """
  qk, v = _head_dims(cfg)
  L = cfg.n_layers if n_layers is None else n_layers
  flops = 2.0 * L * cfg.n_heads * (qk + v) * context
  return flops / 2 if causal else flops


def train_flops_per_token(
  cfg: ModelConfig,
  seq_len: int,
  *,
  causal: bool = True,
  n_matmul_params: int | None = None,
) -> float:
  """Training FLOPs (forward + backward) per token: 6N + 3 x attention.

  N counts every parameter in a matmul, MTP heads included, and of the routed experts only the
  k of E a token runs; the heads also reuse the shared output head (V x D) and add one
  attention layer each. `n_matmul_params` overrides N with the real model's count of its
  parameters (`atlas_jax.training.metrics.matmul_params`), from which the routed experts a
  token does not run are taken out.
  """
  pc = counts(cfg)
  idle = pc.experts - pc.experts_active + pc.mtp_experts - pc.mtp_experts_active
  N = pc.matmul_active + pc.mtp_active if n_matmul_params is None else n_matmul_params - idle
  flops = 6.0 * N + 3 * attention_flops_per_token(cfg, seq_len, causal=causal)
  if cfg.mtp is not None:
    J = cfg.mtp.n_predict
    flops += 6.0 * J * cfg.vocab_size * cfg.d_model
    flops += 3 * attention_flops_per_token(cfg, seq_len, causal=causal, n_layers=J)
  return flops


def decode_flops_per_token(cfg: ModelConfig, context: int) -> float:
  """Forward FLOPs of one decoded token attending over `context` cached tokens (no MTP)."""
  return 2.0 * counts(cfg).matmul_active + attention_flops_per_token(cfg, context, causal=False)


def experts_touched(cfg: ModelConfig, batch: int) -> float:
  """Expected routed experts per MoE layer that `batch` tokens run, under uniform routing:
  E (1 - (1 - k/E)^batch). One token runs k; a large batch reaches all E."""
  if cfg.moe is None:
    return 0.0
  E, k = cfg.moe.n_experts, cfg.moe.top_k
  return E * (1 - (1 - k / E) ** batch)


def decode_weight_params(cfg: ModelConfig, batch: int) -> float:
  """Weights one decode step of `batch` sequences reads (in parameters): the trunk's matmul
  weights, and of the routed experts those the batch's tokens reach (`experts_touched`)."""
  pc = counts(cfg)
  if cfg.moe is None:
    return float(pc.matmul)
  return pc.matmul - pc.experts + pc.experts * experts_touched(cfg, batch) / cfg.moe.n_experts


def chinchilla_tokens(n_params: int) -> int:
  return CHINCHILLA_TOKENS_PER_PARAM * n_params


def train_seconds(
  tokens: float, flops_per_token: float, *, devices: int, peak_flops: float, mfu: float
) -> float:
  """Wall-clock seconds to train on `tokens` tokens at a model-FLOPs utilisation `mfu`."""
  if not 0 < mfu <= 1:
    raise ValueError(f"--mfu={mfu!r} must be in (0, 1]")
  return tokens * flops_per_token / (devices * peak_flops * mfu)


@dataclasses.dataclass(frozen=True)
class DecodeBound:
  batch: int
  bytes_per_step: int  # weights once + every sequence's cache
  memory_seconds: float  # bytes_per_step / bandwidth
  compute_seconds: float  # batch x FLOPs per token / peak FLOP/s
  tokens_per_s: float  # batch / max(memory_seconds, compute_seconds): an upper bound

  @property
  def memory_bound(self) -> bool:
    return self.memory_seconds >= self.compute_seconds


def decode_bound(
  *,
  batch: int,
  weight_bytes: int,
  cache_bytes_per_seq: int,
  flops_per_token: float,
  bandwidth: float,
  peak_flops: float,
) -> DecodeBound:
  """The ceiling on decode throughput for `batch` sequences (one step = one token each)."""
  step_bytes = weight_bytes + batch * cache_bytes_per_seq
  mem_s = step_bytes / bandwidth
  flop_s = batch * flops_per_token / peak_flops
  return DecodeBound(batch, step_bytes, mem_s, flop_s, batch / max(mem_s, flop_s))


def all_reduce_bytes(cfg: ModelConfig, *, tensor: int, rows: int, dtype_bytes: int) -> int:
  """Bytes each tensor device sends per decode step of `rows` sequences (per replica): a ring
  all-reduce of the [rows, D] output of every row-parallel matmul (two per dense layer) and of
  the vocabulary-parallel embedding. An MoE layer reduces its routed experts' down projections
  per slot, before the k slots are weighted and summed ([rows x k, D]: XLA places the reduction
  there), and its shared experts' as a dense MLP's. 0 on one device."""
  if tensor == 1:
    return 0
  return _reduced_bytes(cfg, rows, dtype_bytes) * 2 * (tensor - 1) // tensor


def _reduced_bytes(cfg: ModelConfig, rows: int, dtype_bytes: int) -> int:
  """Bytes a decode step of `rows` sequences all-reduces over the tensor axis (`all_reduce_bytes`'
  messages, each counted once)."""
  messages = 1 + cfg.n_layers  # the embedding, and every layer's attention output
  for sparse in cfg.sparse_layers():
    m = cfg.moe
    messages += (m.top_k + (1 if m.shared_ffn_dim else 0)) if sparse else 1
  return messages * rows * cfg.d_model * dtype_bytes


def hosts_spanned(tensor: int, devices_per_host: int) -> int:
  """The hosts one replica's `tensor` devices span (a replica's devices are consecutive)."""
  return -(-tensor // devices_per_host)


def all_reduce_host_bytes(
  cfg: ModelConfig, *, tensor: int, devices_per_host: int, rows: int, dtype_bytes: int
) -> int:
  """Bytes each host sends to the other hosts per decode step of `rows` sequences when a
  replica's tensor axis spans h hosts: a hierarchical all-reduce (each message reduced over the
  host's own links, then a ring over the h hosts, then broadcast back within each, as NCCL's
  tree and ring algorithms arrange it) sends 2 (h - 1) / h of every message out of each host.
  0 when the replica fits one host."""
  h = hosts_spanned(tensor, devices_per_host)
  return _reduced_bytes(cfg, rows, dtype_bytes) * 2 * (h - 1) // h


def logits_gather_bytes(cfg: ModelConfig, *, tensor: int, rows: int) -> int:
  """Bytes each tensor device receives per decode step of `rows` sequences when the sampler
  all-gathers the [rows, V] float32 logits of the vocabulary-parallel head. 0 on one device."""
  return rows * cfg.vocab_size * 4 * (tensor - 1) // tensor


@dataclasses.dataclass(frozen=True)
class ServingDecodeBound:
  """One decode step of `batch` sequences on a data x tensor mesh, per device."""

  tensor: int
  data: int
  batch: int  # sequences over every replica
  weight_bytes: int  # the device's weight shard, read once per step
  cache_bytes: int  # the device's share of its replica's sequences' cache
  all_reduce_bytes: int  # sent over the interconnect per step (the activations' all-reduces)
  all_gather_bytes: int  # received per step (the logits' all-gather)
  memory_seconds: float  # (weights + cache) / bandwidth
  compute_seconds: float  # the device's share of the FLOPs / peak FLOP/s
  network_seconds: float | None  # both collectives' bytes / link bandwidth (None: not known)
  tokens_per_s: float  # batch / step time: an upper bound for the whole mesh

  @property
  def bytes_per_step(self) -> int:
    return self.weight_bytes + self.cache_bytes


def serving_decode_bound(
  cfg: ModelConfig,
  *,
  tensor: int,
  data: int,
  batch: int,
  context: int,
  dtype_bytes: int,
  bandwidth: float,
  peak_flops: float,
  link_bandwidth: float | None = None,
) -> ServingDecodeBound:
  """The decode ceiling of `batch` sequences of `context` tokens served over data x tensor
  devices: step time = max(memory, compute) + collectives' time, per device."""
  rows = -(-batch // data)  # the busiest replica's sequences
  weights = serving_weight_bytes(cfg, tensor=tensor, dtype_bytes=dtype_bytes)
  cache = rows * context * serving_kv_bytes_per_token(cfg, tensor=tensor, dtype_bytes=dtype_bytes)
  reduced = all_reduce_bytes(cfg, tensor=tensor, rows=rows, dtype_bytes=dtype_bytes)
  gathered = logits_gather_bytes(cfg, tensor=tensor, rows=rows)
  mem_s = (weights + cache) / bandwidth
  flop_s = rows * decode_flops_per_token(cfg, context) / tensor / peak_flops
  net_s = None if link_bandwidth is None else (reduced + gathered) / link_bandwidth
  step = max(mem_s, flop_s) + (net_s or 0.0)
  return ServingDecodeBound(
    tensor, data, batch, weights, cache, reduced, gathered, mem_s, flop_s, net_s, batch / step
  )
