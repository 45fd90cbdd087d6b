"""The op-class account of a train step: it adds up to XLA's cost analysis, its matmul FLOPs are
the 6N formula's, and a profiler trace's events join its instructions."""

import glob
import sys
from pathlib import Path

import jax
import pytest

from atlas_jax.kernels.blocked import default_block

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import gpu_training  # noqa: E402
import step_profile  # noqa: E402
import train_step  # noqa: E402


@pytest.fixture(scope="module")
def smoke_step():
  """The profile bench's --smoke step: llama3-1b's recipe (bf16, selective remat, chunked loss)
  at a toy shape, compiled."""
  cfg = gpu_training.preset_config("llama3-1b", smoke=True)
  step, state = train_step.build(cfg)
  batches = [{"tokens": b} for b in train_step.random_batches(cfg, 3)]
  compiled = step.lower(state, batches[0]).compile()
  return cfg, compiled, state, batches


def test_classes_add_up_to_xla_cost_analysis(smoke_step):
  _, compiled, _, _ = smoke_step
  account = step_profile.hlo_account(compiled.as_text())
  xla = compiled.cost_analysis()
  at_xla = account.total(per_step=False)
  # XLA sums its properties in float32: equal up to that rounding.
  assert at_xla.flops == pytest.approx(xla["flops"], rel=1e-6)
  assert at_xla.transcendentals == pytest.approx(xla["transcendentals"], rel=1e-6)
  assert not account.unpriced
  # The layer scan runs its body L times; XLA prices it once.
  assert account.total().flops > 1.5 * at_xla.flops


def test_matmul_flops_are_the_6n_formula(smoke_step):
  cfg, compiled, _, _ = smoke_step
  m, t = cfg.model, cfg.train
  tokens = t.batch_size * t.seq_len
  D, N, K, H, F, V, L = (
    m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.ffn_dim, m.vocab_size, m.n_layers
  )  # fmt: skip
  dense = V * D + L * (2 * D * N * H + 2 * D * K * H + 3 * D * F)  # tied head: V x D once
  account = step_profile.hlo_account(compiled.as_text())
  per_step = account.per_step
  # Forward 2N, backward 4N per token, and the chunked loss recomputes each chunk's logits in
  # its backward pass: 2 V D more. Selective remat keeps matmul outputs: nothing else repeats.
  assert t.loss_chunk and t.remat == "selective"
  assert per_step["matmul"].flops == 6 * dense * tokens + 2 * V * D * tokens
  # Attention's own matmuls (QK^T, PV forward; four more backward), under its named scope,
  # over the (query, key) pairs the query blocks score: each block its keys up to its last row.
  T, c = t.seq_len, default_block(t.seq_len)
  pairs = sum((end - start) * end for start in range(0, T, c) for end in [min(T, start + c)])
  # (The softmax's elementwise FLOPs, under the same scope, come on top.)
  per_pair = 12 * L * t.batch_size * N * H
  assert per_pair * pairs <= per_step["attention"].flops < per_pair * T * T
  assert per_step["matmul"].flops > 0.7 * account.total().flops
  assert per_step["loss"].flops > 0 and per_step["optimizer"].flops > 0


def test_trace_events_join_the_account(smoke_step, tmp_path):
  """The CPU backend's thunk events carry hlo_op names: the same join a GPU trace takes."""
  _, compiled, state, batches = smoke_step
  account = step_profile.hlo_account(compiled.as_text())
  state, metrics = compiled(state, batches[1])
  jax.block_until_ready(metrics)
  with jax.profiler.trace(str(tmp_path)):
    state, metrics = compiled(state, batches[2])
    jax.block_until_ready(metrics)
  (xspace,) = glob.glob(f"{tmp_path}/**/*.xplane.pb", recursive=True)
  times, unmatched, _ = step_profile.device_times(
    xspace, account, steps=1, plane_prefix="/host:CPU"
  )
  assert times.get("matmul", 0) > 0
  assert set(times) <= set(step_profile.CLASSES)
  table = step_profile.markdown_table(account, measured=times, unmatched_s=unmatched, step_s=1.0)
  assert table.splitlines()[0].startswith("| op class | FLOPs per step |")
  assert "| matmul |" in table and "| unattributed device time |" in table


def test_scopes_survive_autodiff_names():
  assert step_profile._in_scope("loss", "jit(step)/transpose(jvp(loss))/while/body/dot_general")
  assert step_profile._in_scope("loss", "jit(step)/loss/reduce_sum")
  assert not step_profile._in_scope("loss", "jit(step)/jvp()/loss_scale/mul")
