"""Our train step as the training benchmarks build, feed and time it, on one device.

`bench/train.py` and `bench/gpu_training.py` time it beside the PyTorch peer
(`bench/torch_llama.py`) on the same random batches; `bench/gpu_training.py --profile` and its
test compile it for the op-class account.
"""

from __future__ import annotations

import jax
import numpy as np
from timing import seconds_for

from atlas_jax.config import Config
from atlas_jax.training.checkpoint import single_device_mesh
from atlas_jax.training.step import make_train_step, make_trainer

# What the PyTorch peer runs, whatever the preset says: one device, float32, nothing recomputed,
# the layers unrolled (a scanned stack slices each layer's weights and saved activations out of
# the stacked arrays and writes its gradients back, copies that took about a tenth of the small
# preset's step on 2 CPU cores; BENCHMARKS.md). `--set` after these overrides them.
PEER_DEFAULTS = (
  "mesh.fsdp=1",
  "train.precision=fp32",
  "train.remat=none",
  "train.scan_layers=false",
)


def random_batches(cfg: Config, n: int) -> list[np.ndarray]:
  """n batches of i32[B, T + 1] uniform random tokens (inputs and shifted targets), seed 0."""
  rng = np.random.default_rng(0)
  B, T = cfg.train.batch_size, cfg.train.seq_len
  return [rng.integers(0, cfg.model.vocab_size, (B, T + 1)).astype(np.int32) for _ in range(n)]


def build(cfg: Config):
  """(the jitted step(state, batch) -> (state, metrics), the initial state), on one device."""
  trainer = make_trainer(cfg, mesh=single_device_mesh())
  return make_train_step(trainer), trainer.init(jax.random.key(0))


def stepper(step, state):
  """one(tokens i32[B, T + 1]) -> metrics: `step` from `state`, the state carried between calls."""

  def one(tokens):
    nonlocal state
    state, metrics = step(state, {"tokens": tokens})
    return metrics

  return one


def run(step, state, batches, warmup: int) -> tuple[float, float, dict]:
  """(seconds of the first `warmup` steps, which compile, seconds of the rest, the last step's
  metrics), training from `state` on `batches`."""
  one = stepper(step, state)
  warmup_s, _ = seconds_for(one, batches[:warmup])
  seconds, metrics = seconds_for(one, batches[warmup:])
  return warmup_s, seconds, metrics
