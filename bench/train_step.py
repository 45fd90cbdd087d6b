"""Our train step as the training benchmarks build, feed and time it, on one device.

`bench/train.py` and `bench/gpu_training.py` time it beside the PyTorch peer
(`bench/torch_llama.py`) on the same random batches; `bench/gpu_training.py --profile` and its
test compile it for the op-class account.
"""

from __future__ import annotations

import contextlib
import types

import jax
import jax.numpy as jnp
import numpy as np
from timing import seconds_for

from atlas_jax.config import Config
from atlas_jax.model import attention as attention_layer
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


def attention_stand_in(q, k, v, **_):
  """q + k + v, the kv heads repeated ([B, T, N, H], attention's output shape): what
  `bench/train.py --without-attention` runs in place of the attention core, as
  `torch_llama.attention_stand_in` does for the peer."""
  G = q.shape[2] // k.shape[2]
  return q + jnp.repeat(k, G, axis=2) + jnp.repeat(v, G, axis=2)


@contextlib.contextmanager
def without_attention():
  """While tracing: the attention layers call `attention_stand_in` for their attention core."""
  kernels = attention_layer.kernels
  stand_in = {**vars(kernels), "attention": attention_stand_in}
  attention_layer.kernels = types.SimpleNamespace(**stand_in)
  try:
    yield
  finally:
    attention_layer.kernels = kernels


def build(cfg: Config, *, attention: bool = True):
  """(the jitted step(state, batch) -> (state, metrics), the initial state), on one device.

  `attention=False`: the step compiled here (jit would trace it at its first call) with
  `attention_stand_in` for every attention core."""
  trainer = make_trainer(cfg, mesh=single_device_mesh())
  step, state = make_train_step(trainer), trainer.init(jax.random.key(0))
  if attention:
    return step, state
  B, T = cfg.train.batch_size, cfg.train.seq_len
  batch = {"tokens": jax.ShapeDtypeStruct((B, T + 1), jnp.int32)}
  with without_attention():
    return step.lower(state, batch).compile(), state


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
