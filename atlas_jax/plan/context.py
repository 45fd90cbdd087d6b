"""Context parallelism in the plan: per-device activation memory and collective bytes of a train
step whose sequences are split over `context` devices (`atlas_jax.model.context_parallel`).

Activations. Every layer but attention works token by token, so a device holds T / C of each
sequence's per-token residuals: `memory.activation_bytes` at seq_len T / C. Attention adds what
only it keeps: the K and V of the rest of the sequence (all-gathered, or the ring's blocks that
autodiff keeps for the backward pass: the same T - T / C positions), K / tensor heads of H dims
each in the compute dtype, per row and layer, under the policies that keep attention's inputs
(`none`, `selective`); the `xla` attention's scores and probabilities span all T keys (8 N bytes
per local query and key).

Collectives per device and step, per layer (one micro-batch of `batch` rows on this device): the
forward pass brings in K and V of the other T - T / C positions (all-gather, or C - 1 ring steps
of one block each), the backward pass sends their gradients back (the all-gather's transpose, a
reduce-scatter, or the reverse ring), and a policy that recomputes the block (`full`, `every_k`)
gathers again: 2 * (T - T / C) * (K / tensor) * H * c bytes each time.
"""

from __future__ import annotations

import dataclasses

from atlas_jax.config import ModelConfig
from atlas_jax.plan import memory


@dataclasses.dataclass(frozen=True)
class ContextPlan:
  """Per-device figures of one micro-batch under `context` devices."""

  context: int
  activations: memory.ActivationBytes  # the local tokens' residuals (seq_len / context)
  remote_kv: int  # other positions' K/V attention keeps for the backward pass
  collective_bytes: int  # K/V in and their gradients out, every layer, per step

  @property
  def peak(self) -> int:
    return self.activations.peak + self.remote_kv


def _kv_bytes_per_position(cfg: ModelConfig, compute_bytes: int, tensor: int) -> float:
  if cfg.mla is not None:
    raise ValueError("mesh.context must be 1 with model.mla (no context-parallel MLA)")
  K = cfg.n_kv_heads / tensor if cfg.n_kv_heads % tensor == 0 else cfg.n_kv_heads
  return 2 * K * cfg.head_dim * compute_bytes


def collective_bytes(
  cfg: ModelConfig,
  *,
  batch: int,
  seq_len: int,
  context: int,
  compute_bytes: int,
  policy: str = "none",
  tensor: int = 1,
) -> int:
  """Bytes one device receives (forward, and recomputation) and sends (backward) for attention
  under `context` devices in one step of `batch` rows on it (see the module docstring)."""
  if seq_len % (2 * context):
    raise ValueError(f"--seq-len={seq_len} must be divisible by 2 * context = {2 * context}")
  remote = seq_len - seq_len // context
  passes = 3 if policy in ("full", "every_k") else 2
  per_layer = batch * remote * _kv_bytes_per_position(cfg, compute_bytes, tensor)
  return int(round(passes * per_layer * cfg.n_layers))


def context_plan(
  cfg: ModelConfig,
  *,
  policy: str,
  batch: int,
  seq_len: int,
  context: int,
  compute_bytes: int,
  attention: str = "flash",
  tensor: int = 1,
  loss_chunk: int = 0,
  remat_every: int | None = None,
) -> ContextPlan:
  """Activation memory and collective bytes per device of a `batch` x `seq_len` micro-batch
  (this device's rows) whose sequences are split over `context` devices."""
  if context < 1 or seq_len % (2 * context) and context > 1:
    raise ValueError(f"--seq-len={seq_len} must be divisible by 2 * context = {2 * context}")
  local = seq_len // context
  acts = memory.activation_bytes(
    cfg,
    policy=policy,
    batch=batch,
    seq_len=local,
    compute_bytes=compute_bytes,
    attention=attention,
    remat_every=remat_every,
    tensor=tensor,
    loss_chunk=loss_chunk,
  )
  remote = seq_len - local
  keeps_inputs = policy in ("none", "selective")
  kv = _kv_bytes_per_position(cfg, compute_bytes, tensor) if context > 1 else 0.0
  remote_kv = batch * remote * kv * cfg.n_layers if keeps_inputs else 0.0
  if attention == "xla" and policy == "none":
    N = cfg.n_heads / tensor if cfg.n_heads % tensor == 0 else cfg.n_heads
    remote_kv += 8 * N * batch * local * remote * cfg.n_layers
  comm = (
    collective_bytes(
      cfg,
      batch=batch,
      seq_len=seq_len,
      context=context,
      compute_bytes=compute_bytes,
      policy=policy,
      tensor=tensor,
    )
    if context > 1
    else 0
  )
  return ContextPlan(context, acts, int(round(remote_kv)), comm)
