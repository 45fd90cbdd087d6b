"""train.py with pipeline stages, as separate processes: stage 2 x fsdp 2 x tensor 2 follows the
fsdp 8 loss curve, and so do two processes whose stages are on different hosts."""

import json
import subprocess

import pytest

from .runs import env, losses, train_cmd, two_hosts, write_corpus

# Four layers, so that two stages can each hold two groups (circular); eval at the last step.
COMMON = [
  "model.n_layers=4",
  "train.steps=6",
  "train.checkpoint_every=0",
  "train.eval_every=6",
  "train.eval_batches=1",
  "data.eval_fraction=0.2",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return write_corpus(tmp_path_factory.mktemp("data") / "corpus.jsonl")


@pytest.fixture(scope="module")
def fsdp8(tmp_path_factory, corpus):
  """The reference run: ZeRO-3 over 8 devices, no stages."""
  run_dir = tmp_path_factory.mktemp("fsdp8") / "run"
  cmd = train_cmd(run_dir, corpus, *COMMON, "mesh.fsdp=8", "train.sharding=zero3")
  subprocess.run(cmd, env=env(8), check=True, capture_output=True)
  return run_dir


def last_record(run_dir):
  return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def assert_same_curve(got_dir, want_dir):
  want, got = losses(want_dir), losses(got_dir)
  assert sorted(got) == sorted(want) == list(range(1, 7))
  for step in want:
    assert got[step] == pytest.approx(want[step], rel=1e-5), step
  assert last_record(got_dir)["eval_loss"] == pytest.approx(
    last_record(want_dir)["eval_loss"], rel=1e-5
  )


@pytest.mark.parametrize(
  "pipeline",
  [
    pytest.param(["train.pipeline_microbatches=4"], marks=pytest.mark.slow),
    pytest.param(
      ["train.pipeline_microbatches=2", "train.pipeline_repeats=2", "train.sharding=zero3"],
      marks=pytest.mark.slow,
    ),
  ],
  ids=["gpipe", "circular_zero3"],
)
def test_stage2_fsdp2_tensor2_follows_fsdp8(tmp_path, corpus, fsdp8, pipeline):
  mesh = ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2"]
  run_dir = tmp_path / "run"
  out = subprocess.run(
    train_cmd(run_dir, corpus, *COMMON, *mesh, *pipeline),
    env=env(8),
    check=True,
    capture_output=True,
    text=True,
  )
  assert "'stage': 2" in out.stdout and "pipeline: 2 stages" in out.stdout
  assert_same_curve(run_dir, fsdp8)


@pytest.mark.slow
def test_stages_on_two_hosts_follow_one_host(tmp_path, corpus, fsdp8):
  """stage 2 x tensor 4 over two processes of 4 devices: each process is one stage, so every
  ppermute and the stage gathers cross processes."""
  run_dir = tmp_path / "two"
  stages = ["mesh.stage=2", "mesh.fsdp=1", "mesh.tensor=4", "train.pipeline_microbatches=2"]
  two_hosts(run_dir, corpus, *COMMON, *stages)
  assert_same_curve(run_dir, fsdp8)


@pytest.mark.slow  # resume across meshes is tested bitwise in test_pipeline.py
def test_a_circular_run_resumes_unpipelined_on_the_same_curve(tmp_path, corpus, fsdp8):
  """Three steps on stage 2 x fsdp 2 x tensor 2 (circular, its layers stored stage by stage),
  then the same run directory resumed on fsdp 8 without stages: the fsdp 8 run's curve."""
  run_dir = tmp_path / "run"
  circular = [
    "mesh.stage=2",
    "mesh.fsdp=2",
    "mesh.tensor=2",
    "train.pipeline_microbatches=2",
    "train.pipeline_repeats=2",
  ]
  first = train_cmd(run_dir, corpus, *COMMON, *circular, "train.steps=3")
  subprocess.run(first, env=env(8), check=True, capture_output=True)
  rest = train_cmd(run_dir, corpus, *COMMON, "mesh.fsdp=8", "train.sharding=zero3")
  out = subprocess.run(rest, env=env(8), check=True, capture_output=True, text=True)
  assert "resumed from" in out.stdout and "at step 3" in out.stdout
  assert_same_curve(run_dir, fsdp8)
