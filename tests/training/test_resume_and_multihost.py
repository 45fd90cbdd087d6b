"""Runs of train.py as separate processes: SIGKILL + restart and SIGINT/SIGTERM + restart resume
exactly; two hosts agree with one."""

import json
import signal
import subprocess
import time

import pytest

from .runs import env, losses, train_cmd, two_hosts, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return write_corpus(tmp_path_factory.mktemp("data") / "corpus.jsonl")


@pytest.mark.slow  # a resume after SIGINT runs in the fast suite
def test_sigkill_then_restart_resumes_exactly(tmp_path, corpus):
  full = tmp_path / "full"
  subprocess.run(train_cmd(full, corpus), env=env(1), check=True, capture_output=True)

  killed = tmp_path / "killed"
  proc = subprocess.Popen(
    train_cmd(killed, corpus), env=env(1), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
  )
  deadline = time.time() + 240
  while not (killed / "6").is_dir() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  assert proc.poll() is None, "the run finished before it could be killed"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not (killed / "12").exists()
  subprocess.run(train_cmd(killed, corpus), env=env(1), check=True, capture_output=True)
  want, got = losses(full), losses(killed)
  assert sorted(got) == list(range(1, 13))
  assert got == want  # bit for bit: same state, same batches, same program


@pytest.mark.slow
@pytest.mark.parametrize(
  "signum", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)]
)
def test_an_interrupted_run_saves_and_the_rerun_continues_exactly(tmp_path, corpus, signum):
  """No periodic checkpoints: the one the rerun resumes from is the interrupted step's."""
  # Long enough that the signal lands mid-run, with no periodic checkpoints.
  no_periodic = ("train.steps=60", "train.checkpoint_every=0")
  full = tmp_path / "full"
  subprocess.run(train_cmd(full, corpus, *no_periodic), env=env(1), check=True, capture_output=True)

  stopped = tmp_path / "stopped"
  proc = subprocess.Popen(
    train_cmd(stopped, corpus, *no_periodic),
    env=env(1),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
  )
  metrics = stopped / "metrics.jsonl"
  deadline = time.time() + 240
  while proc.poll() is None and time.time() < deadline:
    if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
      break
    time.sleep(0.02)
  assert proc.poll() is None, "the run finished before it could be interrupted"
  proc.send_signal(signum)
  err = proc.communicate(timeout=240)[1]
  assert proc.returncode == 128 + signum, err
  assert "Traceback" not in err and "rerun the same command to resume" in err
  (saved,) = [int(p.name) for p in stopped.iterdir() if p.name.isdigit()]
  assert 3 <= saved < 60 and f"interrupted at step {saved}" in err
  subprocess.run(
    train_cmd(stopped, corpus, *no_periodic), env=env(1), check=True, capture_output=True
  )
  want, got = losses(full), losses(stopped)
  assert sorted(got) == list(range(1, 61))
  assert got == want


def test_two_processes_agree_with_one(tmp_path, corpus):
  one = tmp_path / "one"
  common = [
    "train.steps=4",
    "mesh.fsdp=8",
    "train.sharding=zero3",
    "train.checkpoint_every=0",
    "train.eval_every=4",
    "train.eval_batches=1",
    "data.eval_fraction=0.2",
  ]
  subprocess.run(train_cmd(one, corpus, *common), env=env(8), check=True, capture_output=True)

  two_hosts(tmp_path / "two", corpus, *common, timeout=240)
  want, got = losses(one), losses(tmp_path / "two")
  assert sorted(got) == [1, 2, 3, 4]
  for step in want:
    assert got[step] == pytest.approx(want[step], rel=1e-5)
  # Every process takes part in the sharded eval step (one host alone would hang).
  eval_of = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()][-1]
  assert eval_of(tmp_path / "two")["eval_loss"] == pytest.approx(
    eval_of(one)["eval_loss"], rel=1e-5
  )
