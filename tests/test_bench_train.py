"""`bench/train.py --without-attention`: the stand-in replaces the attention core in both stacks,
only in the steps built for it, and computes the same function in both."""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from atlas_jax.config import load_config
from atlas_jax.model import attention as attention_layer

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import torch_llama  # noqa: E402
import train_step  # noqa: E402

SHAPE = ["train.batch_size=2", "train.seq_len=16"]


@pytest.fixture(scope="module")
def cfg():
  return load_config("configs/tiny.yaml", [*train_step.PEER_DEFAULTS, *SHAPE])


def first_loss(step, state, batch) -> float:
  return float(step(state, {"tokens": batch})[1]["loss"])


def test_only_the_step_built_without_attention_runs_the_stand_in(cfg):
  batch = train_step.random_batches(cfg, 1)[0]
  kernels = attention_layer.kernels
  real = first_loss(*train_step.build(cfg), batch)
  ablated = first_loss(*train_step.build(cfg, attention=False), batch)
  assert attention_layer.kernels is kernels  # put back after the build
  again = first_loss(*train_step.build(cfg), batch)
  assert again == real
  assert abs(ablated - real) > 1e-4


def test_the_peer_without_attention_runs_the_stand_in(cfg):
  tokens = torch.from_numpy(train_step.random_batches(cfg, 1)[0]).long()
  losses = []
  for attention in (True, False):
    torch.manual_seed(0)
    model = torch_llama.Llama(cfg.model, attention=attention)
    with torch.no_grad():
      losses.append(float(model(tokens[:, :-1], tokens[:, 1:])))
  assert abs(losses[0] - losses[1]) > 1e-4


def test_both_stand_ins_compute_the_same_function():
  B, T, N, K, H = 2, 8, 6, 2, 4
  q, k, v = (
    np.array(jax.random.normal(key, (B, T, n, H)))
    for key, n in zip(jax.random.split(jax.random.key(0), 3), (N, K, K))
  )
  ours = np.asarray(train_step.attention_stand_in(q, k, v, causal=True))
  to_bnth = lambda x: torch.from_numpy(x).transpose(1, 2)
  theirs = torch_llama.attention_stand_in(to_bnth(q), to_bnth(k), to_bnth(v))
  np.testing.assert_allclose(ours, theirs.transpose(1, 2).numpy(), rtol=1e-6)
  assert ours.shape == (B, T, N, H)
