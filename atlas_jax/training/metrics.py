"""Throughput and model FLOPs utilisation (MFU), plus the run's log sinks.

MFU = achieved model FLOPs / peak FLOPs. Model FLOPs per token follow the PaLM appendix: 6 * N for
the weight matmuls (forward 2N, backward 4N; N excludes the embedding lookup but includes the LM
head) plus attention: 6 * 2 * L * T * N_heads * H for the QK^T and PV matmuls over a T-token
context, halved when causal since half the score matrix is masked. The formula and the device
table are the planner's (`atlas_jax.plan.compute`, `atlas_jax.devices`).

What a run logs, to the terminal, `metrics.jsonl` and TensorBoard files (`tensorboard/`) in its
directory (`train.py`'s `step_record` builds each line): `loss` and `eval_loss`, always the
next-token cross-entropy; `loss_total` where the objective adds to it (MTP heads, z-loss, router
losses), with each MTP head's `loss_mtp_J`; `grad_norm`, `learning_rate`, `tokens_per_s`,
`peak_memory_gb` (the devices' peak bytes in use, or on a CPU the process's peak resident set:
`peak_memory`), and `mfu` only where the device's peak is known or given (`train.peak_tflops`;
never on a CPU). A mixture of experts adds its router losses and its
experts' load: `moe_load_max` (the busiest expert's tokens over the mean),
`moe_tokens_per_expert` and `moe_dropped` (the share of assignments a capacity factor dropped).
"""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

import jax
from flax import nnx

from atlas_jax.devices import DEVICES, match_device_kind

# Dense bf16 peak TFLOP/s per device, from the planner's device table (sources there).
PEAK_TFLOPS = {d.name: d.peak_bf16_flops / 1e12 for d in DEVICES.values()}


def matmul_params(params) -> int:
  """Parameters that take part in matmuls per token: all but the embedding table (a gather),
  every routed expert counted (`flops_per_token` keeps only the k of E a token runs).

  With tied embeddings the table is also the output head, so it stays in. Variables that are
  not parameters (the routers' selection biases) are left out.
  """
  is_variable = lambda x: isinstance(x, nnx.Variable)
  leaves = jax.tree.leaves(params, is_leaf=is_variable)
  total = sum(_size(x) for x in leaves if not is_variable(x) or isinstance(x, nnx.Param))
  return total if params.get("lm_head") is None else total - params["embed"][...].size


def param_count(params) -> int:
  """The model's parameters (a QLoRA base's quantized weights counted once each, their scales
  not at all) and other variables."""
  return sum(
    _size(x) for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  )


def _size(x) -> int:
  # By shape: a quantized weight's value (a qwix QArray of values and scales) has no `size`.
  return math.prod(x.shape)


def peak_flops_per_device(override_tflops: float | None = None) -> float | None:
  """Peak FLOP/s of one device: `override_tflops` (train.peak_tflops) when given, else the device
  table's figure for this device kind, else None (every CPU: no MFU rather than a made-up one)."""
  if override_tflops is not None:
    return override_tflops * 1e12
  device = jax.devices()[0]
  if device.platform == "cpu":
    return None
  known = match_device_kind(device.device_kind)
  return None if known is None else known.peak_bf16_flops


def mfu(
  tokens_per_s: float, flops_per_tok: float, *, n_devices: int, peak_tflops: float | None = None
) -> float | None:
  """Model FLOPs utilisation, or None when the device's peak is neither known nor given."""
  peak = peak_flops_per_device(peak_tflops)
  if peak is None:
    return None
  return tokens_per_s * flops_per_tok / (n_devices * peak)


def peak_memory() -> tuple[int, str] | None:
  """(bytes, what they measure) of this process's peak so far: on GPU and TPU the largest of its
  devices' `peak_bytes_in_use` (the allocator's high-water mark: arrays and XLA's temporaries);
  on a CPU, whose devices' memory is the process's own, the process's peak resident set
  (`getrusage`: every array and temporary, compiled programs, the C allocator's kept pages and
  Python itself); None where neither is known."""
  devices = jax.local_devices()
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
  peaks = [p for p in peaks if p is not None]
  if peaks:
    return max(peaks), "device peak_bytes_in_use"
  if devices[0].platform == "cpu":
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kibibytes, macOS bytes.
    return (rss if sys.platform == "darwin" else rss * 1024), "process peak RSS"
  return None


def peak_memory_bytes() -> int | None:
  peak = peak_memory()
  return None if peak is None else peak[0]


class Logger:
  """JSONL metrics plus TensorBoard event files, written by process 0 only."""

  def __init__(self, run_dir: str | Path, *, enabled: bool = True):
    self.enabled = enabled
    self._jsonl = self._tb = None
    if not enabled:
      return
    run_dir = Path(run_dir)
    self._jsonl = (run_dir / "metrics.jsonl").open("a")
    try:
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(str(run_dir / "tensorboard"))
    except ImportError:  # TensorBoard files are optional; the JSONL log is not
      self._tb = None

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for key, value in record.items():
        if key != "step" and isinstance(value, int | float) and value is not None:
          self._tb.add_scalar(key, value, record["step"])
      self._tb.flush()

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()
