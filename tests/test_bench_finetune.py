"""bench/finetune.py's memory columns: the compiled step's arguments are exactly the planner's
parameters and Adam state, the batch and two step counters, for full fine-tuning and LoRA."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import finetune as bench_finetune  # noqa: E402

from atlas_jax.config import load_config  # noqa: E402
from atlas_jax.plan.params import counts  # noqa: E402

TINY = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
SMALL = ["mesh.fsdp=1", "train.batch_size=2", "train.seq_len=32"]


@pytest.mark.parametrize("lora", ["null", "{rank: 8, targets: [attn, mlp]}"], ids=["full", "lora"])
def test_the_step_holds_what_the_planner_says(lora):
  cfg = load_config(TINY, [*SMALL, f"train.lora={lora}"])
  row = bench_finetune.memory_row(cfg)
  counters = 2 * 4  # TrainState.step and first_nonfinite, int32
  assert (
    row["arguments"] == row["planned_params"] + row["planned_opt_state"] + row["batch"] + counters
  )
  n = counts(cfg.model).total
  if cfg.train.lora is None:
    assert row["trainable"] == n
    assert row["bytes_per_param"] == pytest.approx(16, rel=1e-5)  # fp32 weights, grads, 2 moments
  else:
    assert row["trainable"] < n / 5
    assert row["bytes_per_param"] < 6
