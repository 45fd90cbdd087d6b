"""Shared helpers for training tests: a tiny config and deterministic batches."""

import numpy as np

from atlas_jax.config import load_config

TINY = [
  "model.vocab_size=64",
  "model.d_model=32",
  "model.n_layers=4",
  "model.n_heads=4",
  "model.n_kv_heads=2",
  "model.ffn_dim=64",
  "model.max_seq_len=64",
  "train.seq_len=16",
  "train.batch_size=8",
  "train.warmup_steps=1",
  "train.steps=10",
  "train.learning_rate=1e-2",
]


def tiny_config(*overrides: str):
  return load_config(None, [*TINY, *overrides])


def batches(n: int, *, batch: int = 8, seq_len: int = 16, vocab: int = 64, seed: int = 0):
  rng = np.random.default_rng(seed)
  return [
    {"tokens": rng.integers(0, vocab, (batch, seq_len + 1)).astype(np.int32)} for _ in range(n)
  ]
