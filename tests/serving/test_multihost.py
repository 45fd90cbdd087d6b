"""serve.py across processes: two processes of 4 CPU devices each on localhost (gloo
collectives) serve one tiny Llama over one mesh of 8 devices; the leader's HTTP answers equal
one device's, and a follower killed mid-request stops the group with a message, not a hang."""

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jax
import numpy as np
import pytest

from atlas_jax.config import ConfigError
from atlas_jax.serving import multihost
from atlas_jax.serving.engine import Engine, EngineConfig
from tests.conftest import COMPILE_FAST
from tests.training.runs import free_port

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from . import test_mesh as mesh_test  # noqa: E402
from .hf_folders import build_folder  # noqa: E402
from .test_hf_serving import serve, served  # noqa: E402

ROOT = Path(__file__).parents[2]
PROMPTS = ["def foo(x):\n    return", "Hello, how are", "The quick brown"]
FLAGS = ["--block-size", "8", "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]
FLAGS += ["--max-model-len", "64", "--num-blocks", "32", "--warmup", "none"]
# One decode token a step: every call is the one step program (bursts: the slow test).
ONE_STEP = ["--decode-burst", "1"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  """A Llama folder (random weights) whose 8 query and 4 kv heads split over tensor 8."""
  from ..test_hf import build_hf

  root = tmp_path_factory.mktemp("multihost")
  info = build_folder("llama", root)
  config = json.loads((root / "config.json").read_text())
  build_hf(
    "Llama",
    root,
    std=0.3,
    vocab_size=config["vocab_size"],
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    bos_token_id=config["bos_token_id"],
    eos_token_id=info["eos"],
  )
  return root


def start_group(folder, port: int, *flags: str) -> list[subprocess.Popen]:
  """serve.py as two processes of 4 devices; process 0 serves HTTP on `port`."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=4 {COMPILE_FAST}"
  env["JAX_PLATFORMS"] = "cpu"
  coordinator = f"127.0.0.1:{free_port()}"
  return [
    subprocess.Popen(
      [sys.executable, str(ROOT / "serve.py"), "--checkpoint", str(folder), "--port", str(port)]
      + FLAGS
      + ["--coordinator-address", coordinator, "--num-processes", "2", "--process-id", str(i)]
      + list(flags),
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]


def wait_healthy(url: str, procs, timeout: float = 120) -> None:
  end = time.monotonic() + timeout
  while time.monotonic() < end:
    if any(p.poll() is not None for p in procs):
      outs = [p.communicate()[0] for p in procs]
      pytest.fail(f"a process ended before serving:\n{outs[0]}\n---\n{outs[1]}")
    try:
      if httpx.get(f"{url}/health", timeout=1).status_code == 200:
        return
    except httpx.HTTPError:
      pass
    time.sleep(0.2)
  pytest.fail("the leader did not serve in time")


def stop(procs) -> list[str]:
  """Ctrl-C to the leader, which stops the followers; the outputs of both."""
  if procs[0].poll() is None:
    procs[0].send_signal(signal.SIGINT)
  try:
    return [p.communicate(timeout=60)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


def completions(url: str) -> list[tuple[str, dict]]:
  """Greedy completions of PROMPTS over HTTP: (text, usage) each."""
  out = []
  for prompt in PROMPTS:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out.append((r.json()["choices"][0]["text"], r.json()["usage"]))
  return out


@pytest.fixture(scope="module")
def one_device(folder):
  """The reference: the same completions from one process on one device."""
  with served(folder, *FLAGS, *ONE_STEP, "--runner", "ragged") as url:
    return completions(url)


def test_two_processes_serve_as_one_device_and_stop_when_one_is_lost(folder, one_device):
  """Tensor 8 over both processes: one device's greedy tokens; then a follower killed while a
  request streams ends the leader with status 1, naming the process, within the timeout."""
  port = free_port()
  url = f"http://127.0.0.1:{port}"
  procs = start_group(
    folder, port, "--tensor-parallel-size", "8", "--heartbeat-timeout", "3", *ONE_STEP
  )
  try:
    wait_healthy(url, procs)
    assert completions(url) == one_device
    body = {"prompt": PROMPTS[0], "max_tokens": 50, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
      for line in r.iter_lines():
        if line.startswith("data: {"):  # the first token is out: the request is running
          procs[1].kill()
          break
    leader = procs[0].communicate(timeout=60)[0]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert procs[0].returncode == 1, leader
  assert "process 1 of 2 was lost" in leader


@pytest.mark.slow
def test_data_parallel_replicas_on_their_own_hosts(folder, one_device):
  """Data 2 x tensor 4: each process's devices hold one replica; the warm-up's runs and decode
  bursts mirrored too; one device's greedy tokens; Ctrl-C to the leader stops both processes
  cleanly."""
  port = free_port()
  mesh = ["--tensor-parallel-size", "4", "--data-parallel-size", "2"]
  procs = start_group(folder, port, *mesh, "--warmup", "default")
  try:
    wait_healthy(f"http://127.0.0.1:{port}", procs, timeout=300)
    got = completions(f"http://127.0.0.1:{port}")
  finally:
    outs = stop(procs)
  assert got == one_device, outs[0]
  assert [p.returncode for p in procs] == [0, 0], outs
  assert "stopped by the leader" in outs[1]


class Recorded(multihost.Channel):
  """The leader's messages kept in order (through pickle, as they travel) for a follower in the
  same process to receive."""

  def __init__(self):
    self.messages = []

  def send(self, kind, body=None):
    self.messages.append((kind, pickle.loads(pickle.dumps(body))))

  def receive(self):
    return self.messages.pop(0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gqa", "hybrid"])
def test_a_follower_replaying_the_leaders_calls_holds_the_same_pools(kind):
  """In one process: a leader engine over data 2 x tensor 2 whose calls go through the mirror
  (records and outputs on the host, every other program argument by name) draws what the
  engine draws without it, and a second engine replaying its messages (the warm-up's runs,
  steps and bursts) ends with the same pools (a hybrid model's two pools too)."""
  config = dataclasses.replace(mesh_test.CONFIG, tensor_parallel_size=2, data_parallel_size=2)
  model = mesh_test.model_of(kind)
  want, _ = mesh_test.serve(model, config)

  leader = Engine(model, config, eos_id=3)
  follower = Engine(model, config, eos_id=3)
  channel = Recorded()
  sent = multihost.Mirror(leader.runner, None, channel=channel)
  leader.warmup(first=2)
  assert leader.generate(*mesh_test.workload()) == want
  sent.stop()
  kinds = [kind for kind, _ in channel.messages]
  assert kinds[0] == multihost.WARMUP and kinds[-1] == multihost.STOP
  assert kinds.count(multihost.CALL) > 10
  names = {body[0] for kind, body in channel.messages if kind == multihost.CALL}
  assert {"forward_sample", "decode_burst"} <= names

  multihost.Mirror(follower.runner, None, channel=channel).follow()
  assert channel.messages == []
  assert follower.runner.wait_compiled(60)  # the leader's warm-up shapes, compiled here too
  for a, b in zip(jax.tree.leaves(leader.pools), jax.tree.leaves(follower.pools)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_multihost_flags_are_checked():
  with pytest.raises(ConfigError, match="given together"):
    multihost.Distributed("127.0.0.1:1234", 2, None)
  with pytest.raises(ConfigError, match="--coordinator-address='host' .*HOST:PORT"):
    multihost.Distributed("host", 2, 0)
  with pytest.raises(ConfigError, match=r"--process-id=2 .*\[0, 2\)"):
    multihost.Distributed("127.0.0.1:1234", 2, 2)
  with pytest.raises(ConfigError, match="--num-processes=0"):
    multihost.Distributed("127.0.0.1:1234", 0, 0)
  assert multihost.Distributed().leader and not multihost.Distributed().enabled
  config = EngineConfig(tensor_parallel_size=8)
  assert multihost.engine_config(config, lora=False).runner == "ragged"
  with pytest.raises(ConfigError, match="runner='cpu' is not allowed across processes"):
    multihost.engine_config(dataclasses.replace(config, runner="cpu"), lora=False)
  with pytest.raises(ConfigError, match="--enable-lora"):
    multihost.engine_config(config, lora=True)
  with pytest.raises(ConfigError, match="tensor_parallel_size=4 .* must take all 8 devices"):
    multihost.engine_config(EngineConfig(tensor_parallel_size=4), lora=False)


def test_serve_names_a_bad_multihost_flag(folder, capsys):
  argv = ["--checkpoint", str(folder), "--prompt", "x", "--coordinator-address", "127.0.0.1:1"]
  assert serve.main([*argv, "--num-processes", "2"]) == 2
  assert "given together" in capsys.readouterr().err
  assert serve.main([*argv, "--num-processes", "2", "--process-id", "3"]) == 2
  assert "--process-id=3 is not allowed" in capsys.readouterr().err
  # train.py's field names, through --set
  sets = ["--set", "mesh.num_processes=2", "--set", "mesh.process_id=3"]
  assert serve.main([*argv, *sets]) == 2
  assert "--process-id=3 is not allowed" in capsys.readouterr().err
  assert serve.main([*argv, "--set", "mesh.process_id=one"]) == 2
  assert "--set mesh.process_id=one is not allowed" in capsys.readouterr().err
