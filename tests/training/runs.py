"""Helpers for tests that run train.py as separate processes: the command, its environment, the
losses it logged."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import COMPILE_FAST

ROOT = Path(__file__).parents[2]


def write_corpus(path: Path) -> Path:
  """A small JSONL corpus of short Python functions."""
  path.write_text(
    "".join(
      json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n"}) + "\n"
      for i in range(300)
    )
  )
  return path


def train_cmd(run_dir: Path, corpus: Path, *extra: str) -> list[str]:
  sets = [
    "model.n_layers=2",
    "model.d_model=32",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=64",
    "train.seq_len=32",
    "train.batch_size=8",
    "train.steps=12",
    "train.log_every=1",
    "train.eval_every=0",
    "train.checkpoint_every=3",
    "train.warmup_steps=2",
    f"data.source={corpus}",
    f"train.checkpoint_dir={run_dir}",
    *extra,
  ]
  cmd = [
    sys.executable,
    str(ROOT / "train.py"),
    "--config",
    str(ROOT / "configs" / "tiny.yaml"),
    "--sample-prompt",
    "",
    "--data-cache",
    str(run_dir.parent / "cache"),
  ]
  for s in sets:
    cmd += ["--set", s]
  return cmd


def env(devices: int) -> dict[str, str]:
  e = dict(os.environ)
  # Compiled as in the suite's own process (tests/conftest.py): faster to compile.
  e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {COMPILE_FAST}"
  e["JAX_PLATFORMS"] = "cpu"
  return e


def losses(run_dir: Path) -> dict[int, float]:
  """Loss per step; a step logged twice (re-run after a kill) keeps its last value."""
  out = {}
  for line in (run_dir / "metrics.jsonl").read_text().splitlines():
    r = json.loads(line)
    out[r["step"]] = r["loss"]
  return out


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def two_hosts(run_dir: Path, corpus: Path, *extra: str, timeout: float = 300) -> list[str]:
  """Runs train.py as two processes of 4 devices each (one run, `run_dir`); returns their
  output, the first process's first. Both must succeed."""
  port = free_port()
  procs = [
    subprocess.Popen(
      train_cmd(
        run_dir,
        corpus,
        *extra,
        f"mesh.coordinator_address=127.0.0.1:{port}",
        "mesh.num_processes=2",
        f"mesh.process_id={i}",
      ),
      env=env(4),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  outputs = [p.communicate(timeout=timeout)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), outputs
  assert "processes: 2" in outputs[0]
  return outputs
