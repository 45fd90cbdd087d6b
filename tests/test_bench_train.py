"""`bench/train.py --without PIECE`: each stand-in replaces its piece only in the step built for
it, and our step and the PyTorch peer compute the same loss with and without every piece."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flax import nnx

from atlas_jax.config import load_config
from atlas_jax.model import attention as attention_layer
from atlas_jax.model import build, layers, transformer

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import torch_llama  # noqa: E402
import train_step  # noqa: E402

SHAPE = ["train.batch_size=2", "train.seq_len=16"]


@pytest.fixture(scope="module")
def cfg():
  return load_config("configs/tiny.yaml", [*train_step.PEER_DEFAULTS, *SHAPE])


@pytest.fixture(scope="module")
def batch(cfg):
  return train_step.random_batches(cfg, 1)[0]


def losses(cfg, batch, pieces: tuple[str, ...]) -> tuple[float, float]:
  """(our step's loss, the peer's loss) on `batch` from the same weights, both without `pieces`."""
  step, state = train_step.build(cfg, without_pieces=pieces)
  model = build(cfg.model, rngs=nnx.Rngs(0))
  nnx.update(model, state.params)
  peer = torch_llama.Llama(cfg.model, frozenset(pieces)).load_params(model)
  tokens = torch.from_numpy(batch).long()
  with torch.no_grad():
    theirs = float(peer(tokens[:, :-1], tokens[:, 1:]))
  return float(step(state, {"tokens": batch})[1]["loss"]), theirs


@pytest.fixture(scope="module")
def full(cfg, batch):
  return losses(cfg, batch, ())


def test_the_peer_computes_our_loss(full):
  ours, theirs = full
  np.testing.assert_allclose(ours, theirs, rtol=1e-6)


@pytest.mark.parametrize(
  "pieces", [*((piece,) for piece in train_step.PIECES), train_step.PIECES], ids=str
)
def test_without_pieces_both_stacks_run_the_same_stand_ins(cfg, batch, full, pieces):
  held = lambda: [
    attention_layer.kernels,
    attention_layer.Attention._rotate,
    layers.rms_norm,
    layers.ACTIVATIONS,
    transformer.jnp,
  ]
  swapped = held()
  ours, theirs = losses(cfg, batch, pieces)
  np.testing.assert_allclose(ours, theirs, rtol=1e-6)
  assert abs(ours - full[0]) > 1e-4  # the stand-in ran
  assert held() == swapped  # every module put back after the build


def test_a_step_built_after_the_stand_ins_runs_every_piece(cfg, batch, full):
  losses(cfg, batch, train_step.PIECES)
  assert losses(cfg, batch, ()) == full


def test_an_unknown_piece_is_refused(cfg):
  with pytest.raises(ValueError, match="'softmax'.*attention"):
    train_step.build(cfg, without_pieces=("softmax",))
