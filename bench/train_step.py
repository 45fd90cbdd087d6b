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
from atlas_jax.model import layers, transformer
from atlas_jax.training.checkpoint import single_device_mesh
from atlas_jax.training.step import make_train_step, make_trainer

# What the PyTorch peer runs, whatever the preset says: one device, float32, nothing recomputed,
# the layers unrolled (a scanned stack slices each layer's weights and saved activations out of
# the stacked arrays and writes its gradients back, copies an unrolled stack does not make).
# `--set` after these overrides them.
PEER_DEFAULTS = (
  "mesh.fsdp=1",
  "train.precision=fp32",
  "train.remat=none",
  "train.scan_layers=false",
)


# What `--without` can take out of both steps, one stand-in each (`without`,
# `torch_llama.Block`).
PIECES = ("attention", "norm", "rope", "activation", "embedding")


def random_batches(cfg: Config, n: int) -> list[np.ndarray]:
  """n batches of i32[B, T + 1] uniform random tokens (inputs and shifted targets), seed 0."""
  rng = np.random.default_rng(0)
  B, T = cfg.train.batch_size, cfg.train.seq_len
  return [rng.integers(0, cfg.model.vocab_size, (B, T + 1)).astype(np.int32) for _ in range(n)]


def attention_stand_in(q, k, v, **_):
  """q + k + v, the kv heads repeated ([B, T, N, H], attention's output shape): what
  `bench/train.py --without attention` runs in place of the attention core, as
  `torch_llama.attention_stand_in` does for the peer."""
  G = q.shape[2] // k.shape[2]
  return q + jnp.repeat(k, G, axis=2) + jnp.repeat(v, G, axis=2)


def _embedding_stand_in(table_VD, tokens_BT, axis=0):
  """Row 0 of the table at every position: the embedding's gather (and its gradient's
  scatter-add) gone, a gradient into the table kept."""
  assert axis == 0
  return jnp.broadcast_to(table_VD[0], (*tokens_BT.shape, table_VD.shape[1]))


def _replaced(module, name: str, **members):
  """`module`'s attribute `name` (a module or namespace) with `members` swapped in."""
  return (module, name, types.SimpleNamespace(**{**vars(getattr(module, name)), **members}))


def _patches(piece: str) -> list[tuple]:
  """(module, attribute, stand-in) for each swap that takes `piece` out of the step; each
  stand-in keeps the piece's output shape and a gradient into what it read, and the peer's
  (`torch_llama.Block`) computes the same function."""
  if piece == "attention":  # q + k + v
    return [_replaced(attention_layer, "kernels", attention=attention_stand_in)]
  if piece == "norm":  # RMSNorm without the normalisation: scale * x
    return [(layers, "rms_norm", lambda x, scale, eps: scale.astype(x.dtype) * x)]
  if piece == "rope":  # q and k unrotated
    unrotated = lambda self, q_BTNH, k_BTKH, positions_BT, **_: (q_BTNH, k_BTKH)
    return [(attention_layer.Attention, "_rotate", unrotated)]
  if piece == "activation":  # the MLP's gate unactivated: gate * up
    return [(layers, "ACTIVATIONS", {**layers.ACTIVATIONS, "silu": lambda x: x})]
  if piece == "embedding":  # row 0 of the table at every position
    return [_replaced(transformer, "jnp", take=_embedding_stand_in)]
  raise ValueError(f"piece {piece!r}: expected one of {PIECES}")


@contextlib.contextmanager
def without(*pieces: str):
  """While tracing: the model runs a stand-in for each of `pieces` (`PIECES`)."""
  patches = [patch for piece in pieces for patch in _patches(piece)]
  originals = [(module, name, getattr(module, name)) for module, name, _ in patches]
  try:
    for module, name, stand_in in patches:
      setattr(module, name, stand_in)
    yield
  finally:
    for module, name, original in reversed(originals):
      setattr(module, name, original)


def build(cfg: Config, *, without_pieces: tuple[str, ...] = ()):
  """(the jitted step(state, batch) -> (state, metrics), the initial state), on one device.

  `without_pieces`: the step compiled here (jit would trace it at its first call) with a
  stand-in for each of those pieces (`without`)."""
  trainer = make_trainer(cfg, mesh=single_device_mesh())
  step, state = make_train_step(trainer), trainer.init(jax.random.key(0))
  if not without_pieces:
    return step, state
  B, T = cfg.train.batch_size, cfg.train.seq_len
  batch = {"tokens": jax.ShapeDtypeStruct((B, T + 1), jnp.int32)}
  with without(*without_pieces):
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
