"""MFU's FLOP count against XLA's cost analysis; the packed grain pipeline's invariants."""

import resource
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax.data.pipeline import PackedSequences, eval_batches, train_dataset
from atlas_jax.model.transformer import Transformer
from atlas_jax.plan.compute import train_flops_per_token
from atlas_jax.training.metrics import matmul_params, peak_memory
from atlas_jax.training.step import loss_fn

from .common import tiny_config


def test_flops_per_token_matches_compiled_cost():
  cfg = tiny_config(
    "model.d_model=128",
    "model.ffn_dim=384",
    "model.max_seq_len=128",
    "train.seq_len=64",
    "model.vocab_size=256",
    "model.n_layers=2",
  )
  # Unrolled: XLA's cost analysis counts a loop body once, whatever the trip count.
  graphdef, params = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(0), unroll_layers=True))
  B, T = 4, 64
  batch = {"tokens": jnp.zeros((B, T + 1), jnp.int32)}
  grad = jax.jit(jax.grad(lambda p: loss_fn(graphdef, p, batch)[0]))
  cost = grad.lower(params).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  # Our count skips the masked half of causal attention; XLA computes the full score matrix.
  ours = (
    train_flops_per_token(cfg.model, T, causal=False, n_matmul_params=matmul_params(params)) * B * T
  )
  assert 0.9 < cost["flops"] / ours < 1.15, cost["flops"] / ours


def corpus():
  lengths = [5, 17, 1, 40, 9, 30, 3, 60]
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  doc_of = np.repeat(np.arange(len(lengths)), lengths)
  return np.arange(sum(lengths), dtype=np.int32), starts, doc_of


def test_packed_windows_carry_segments_and_positions():
  tokens, starts, doc_of = corpus()
  ds = PackedSequences(tokens, starts, seq_len=16)
  for i in range(len(ds)):
    item = ds[i]
    idx = np.arange(i * 16, i * 16 + 16)
    np.testing.assert_array_equal(item["tokens"], tokens[i * 16 : i * 16 + 17])
    # Segments change exactly where documents do.
    np.testing.assert_array_equal(np.diff(item["segment_ids"]) != 0, np.diff(doc_of[idx]) != 0)
    # Positions restart at each document start (or the window start for a continued document).
    restart = np.concatenate([[True], np.diff(doc_of[idx]) != 0])
    np.testing.assert_array_equal(item["positions"] == 0, restart)


def test_shuffle_is_deterministic_per_epoch_and_hosts_are_disjoint():
  tokens, starts, _ = corpus()
  n = len(PackedSequences(tokens, starts, 16))
  a = train_dataset(tokens, starts, seq_len=16, batch_size=2, seed=3)
  b = train_dataset(tokens, starts, seq_len=16, batch_size=2, seed=3)
  first = lambda ds, k: [int(ds[i]["tokens"][j, 0]) // 16 for i in range(k) for j in range(2)]
  assert first(a, n) == first(b, n)  # same seed, same order
  epoch0, epoch1 = first(a, n)[:n], first(a, 2 * n)[n : 2 * n]
  assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))
  assert epoch0 != epoch1  # a fresh order each epoch
  hosts = [
    train_dataset(
      tokens, starts, seq_len=16, batch_size=2, seed=3, process_index=h, process_count=2
    )
    for h in range(2)
  ]
  seen = [int(hosts[h][i]["tokens"][0, 0]) // 16 for h in range(2) for i in range(n // 2)]
  assert sorted(seen) == list(range(n))  # one epoch split across two hosts, nothing twice
  assert len(eval_batches(tokens, starts, seq_len=16, batch_size=2, n_batches=2)) == 2


def test_the_cpu_peak_is_the_process_peak_resident_set():
  """On a CPU the peak is getrusage's high-water mark: not below what the process holds resident
  now, a 256 MiB array written (so its pages are resident) among it."""
  held = np.ones(2**28 // 8, np.float64)  # 256 MiB, every page touched
  status = Path("/proc/self/status")
  if not status.is_file():
    pytest.skip("no /proc: the resident set cannot be read directly")
  fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
  resident = int(fields["VmRSS"].split()[0]) * 1024
  peak, what = peak_memory()
  later = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # a high-water mark: only grows
  assert what == "process peak RSS"
  assert held.nbytes <= resident and peak <= later
  # The kernel folds its per-thread page counts into the high-water mark in batches, so the mark
  # may trail the resident set read a moment before by a little (70 kB seen): 16 MiB allowed.
  assert peak >= resident - 16 * 2**20
