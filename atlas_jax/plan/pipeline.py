"""Pipeline parallelism's figures: the schedule's iterations and bubble, the step time the bubble
implies, and the activation bytes the stages pass each other with ppermute.

The schedule is the trainer's own (`atlas_jax.training.pipeline.Schedule`): with p stages, U
micro-batches and r repeats a step runs I = U r + p - 1 iterations of which each stage idles
p - 1, so its compute takes 1 / (1 - bubble) = (U r + p - 1) / (U r) of the unpipelined time.
Each iteration a stage sends its micro-batch's activations ([rows, T, D] in the compute dtype,
two of them when parallel MTP heads read the last block's input) to the next stage; the
backward pass sends their gradients back, the same bytes. `tests/plan` counts the ppermutes of
the compiled train step.
"""

from __future__ import annotations

from atlas_jax.config import ModelConfig
from atlas_jax.schedule import Schedule


def carried(cfg: ModelConfig) -> int:
  """Activations a micro-batch carries from stage to stage: the hidden state, and the last
  block's input for parallel MTP heads."""
  return 2 if cfg.mtp is not None and cfg.mtp.kind == "parallel" else 1


def ppermute_bytes(
  cfg: ModelConfig,
  *,
  rows: int,
  seq_len: int,
  compute_bytes: int,
  schedule: Schedule,
  grad_accum: int = 1,
) -> int:
  """Bytes one stage sends per step with ppermute, forward and backward (the busiest stage:
  GPipe's last stage sends nothing forward, its first nothing backward).

  Args:
    rows: rows one device holds of an accumulation micro-batch (a data-parallel shard's);
      each pipeline micro-batch is rows / U of them.
  """
  U = schedule.microbatches
  per_iteration = carried(cfg) * (rows // U) * seq_len * cfg.d_model * compute_bytes
  return 2 * grad_accum * schedule.iterations * per_iteration


def figures(
  cfg: ModelConfig,
  *,
  rows: int,
  seq_len: int,
  compute_bytes: int,
  schedule: Schedule,
  grad_accum: int,
  step_flops: float,
  devices: int,
  peak_flops: float,
  mfu: float,
) -> dict:
  """The plan's pipeline section: schedule, bubble, step time and ppermute traffic."""
  ideal = step_flops / (devices * peak_flops * mfu)
  return {
    "stages": schedule.stages,
    "microbatches": schedule.microbatches,
    "repeats": schedule.repeats,
    "schedule": "circular" if schedule.repeats > 1 else "GPipe",
    "iterations": schedule.iterations,
    "bubble": schedule.bubble,
    "step_seconds_without_bubble": ideal,
    "step_seconds": ideal / (1 - schedule.bubble),
    "ppermute_bytes_per_step": ppermute_bytes(
      cfg,
      rows=rows,
      seq_len=seq_len,
      compute_bytes=compute_bytes,
      schedule=schedule,
      grad_accum=grad_accum,
    ),
    "microbatch_rows": rows // schedule.microbatches,
  }
