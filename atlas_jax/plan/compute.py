"""FLOPs per token, time to train, the Chinchilla-optimal token count and the decode ceiling.

FLOPs follow the PaLM appendix (Chowdhery et al. 2022): a token costs 2 FLOPs per matmul
parameter forward and twice that backward, 6N in all (N excludes the embedding gather, includes
the output head), plus attention: QK^T and PV, 2 * L * N_heads * (H_qk + H_v) FLOPs per key
forward, over T/2 keys on average for a causal T-token sequence. Multi-token-prediction heads add
their parameters to N, one more use of the shared output head and one attention layer each.

Batch-1 decoding is memory bound: every step reads every weight once plus the sequence's cache,
so tokens/s <= bandwidth / (weight bytes + cache bytes). A larger batch shares the weight read.
"""

from __future__ import annotations

import dataclasses

from atlas_jax.config import ModelConfig
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

  N counts every parameter in a matmul, MTP heads included; the heads also reuse the shared
  output head (V x D) and add one attention layer each. `n_matmul_params` overrides N with the
  real model's count (`atlas_jax.training.metrics.matmul_params`).
  """
  pc = counts(cfg)
  N = pc.matmul + pc.mtp if n_matmul_params is None else n_matmul_params
  flops = 6.0 * N + 3 * attention_flops_per_token(cfg, seq_len, causal=causal)
  if cfg.mtp is not None:
    J = cfg.mtp.n_predict
    flops += 6.0 * J * cfg.vocab_size * cfg.d_model
    flops += 3 * attention_flops_per_token(cfg, seq_len, causal=causal, n_layers=J)
  return flops


def decode_flops_per_token(cfg: ModelConfig, context: int) -> float:
  """Forward FLOPs of one decoded token attending over `context` cached tokens (no MTP)."""
  return 2.0 * counts(cfg).matmul + attention_flops_per_token(cfg, context, causal=False)


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
