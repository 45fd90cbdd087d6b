"""serve.py's start-up on a real model's shape: seconds until /health answers, resident memory
against the weights and pool it holds, memory maps, and what a restart on the filled compilation
cache compiles.

The model is a random-weight Hugging Face folder of SmolLM-135M's shape (30 layers, d_model 576,
9 heads over 3 kv heads, FFN 1536, a 49,152-token vocabulary, tied embeddings; float32), written
once under runs/ with a word-level tokenizer (`serve_peer.random_folder`). Each start runs
`serve.py --port` as its own process on an empty (first) or filled (second) compilation cache,
polls /health, sends one completion, then waits for the background compiles to end (the log's
last "compiled step shape n/n") before reading /proc for its memory.

    python bench/startup.py                    # the CPU runner (serve.py's default on a CPU)
    python bench/startup.py --runner ragged    # the accelerator runner, its XLA paths on a CPU
    python bench/startup.py --peer-python .venv-vllm/bin/python   # and vLLM's OpenAI server

The peer, vLLM's OpenAI server on the same folder (`serve_peer.server_command`: 32 sequences, a
2,048-token context, its CPU KV cache of 1 GiB), is timed to /health once, its resident memory
summed over its processes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import serve_http
import serve_peer

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(
  vocab_size=49152,
  d_model=576,
  n_layers=30,
  n_heads=9,
  n_kv_heads=3,
  ffn_dim=1536,
  max_seq_len=2048,
  tie_embeddings=True,
  rope_theta=100000.0,
)


def make_folder(folder: Path) -> Path:
  if (folder / "config.json").exists():
    return folder
  from flax import nnx

  from atlas_jax.config import ModelConfig
  from atlas_jax.model import build

  model = build(ModelConfig(**SHAPE), rngs=nnx.Rngs(0))
  return serve_peer.random_folder(model, folder)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def proc_status(pid: int) -> dict:
  """Resident MB and memory maps of a process."""
  status = Path(f"/proc/{pid}/status").read_text()
  rss = int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) / 1024
  maps = len(Path(f"/proc/{pid}/maps").read_text().splitlines())
  return dict(rss_mb=rss, maps=maps)


def resident_by_kind(pid: int) -> dict:
  """Resident MB of a process by what its mappings hold (/proc/PID/smaps): "files" (shared
  libraries and other mapped files), "code" (anonymous executable mappings: the compiled
  programs' machine code) and "heap" (every other anonymous mapping: malloc's heap, arrays and
  the compiled programs' data)."""
  out = dict(files=0.0, code=0.0, heap=0.0)
  kind = None
  for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
    head = line.split()
    if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head[0]):
      perms, path = head[1], head[5] if len(head) > 5 else ""
      kind = "files" if path.startswith("/") else "code" if "x" in perms else "heap"
    elif head[0] == "Rss:":
      out[kind] += int(head[1]) / 1024
  return out


def cache_entries(folder: Path) -> int:
  return sum(1 for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".json"))


def start(folder: Path, cache: Path, runner: str, extra: list[str], timeout: float) -> dict:
  """One start: seconds to /health, one completion, the background compiles' end, memory."""
  port = free_port()
  log_path = Path(tempfile.mkstemp(suffix=".log")[1])
  cmd = [
    sys.executable,
    str(ROOT / "serve.py"),
    "--checkpoint",
    str(folder),
    "--port",
    str(port),
    "--compilation-cache-dir",
    str(cache),
    "--runner",
    runner,
    *extra,
  ]
  t0 = time.perf_counter()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
  try:
    ready = None
    while time.perf_counter() - t0 < timeout:
      if proc.poll() is not None:
        raise SystemExit(f"serve.py exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
      try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
          if r.status == 200:
            ready = time.perf_counter() - t0
            break
      except OSError:
        time.sleep(0.5)
    if ready is None:
      raise SystemExit(f"not ready in {timeout} s:\n{log_path.read_text()[-3000:]}")
    at_ready = proc_status(proc.pid)
    body = json.dumps({"model": folder.name, "prompt": "w5 w6 w7", "max_tokens": 8}).encode()
    req = urllib.request.Request(
      f"http://127.0.0.1:{port}/v1/completions",
      body,
      {"Content-Type": "application/json"},
    )
    t1 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
      answered = json.loads(r.read())["choices"][0]["text"]
    first = time.perf_counter() - t1
    total = None
    while time.perf_counter() - t0 < timeout:
      counts = re.findall(r"compiled step shape (\d+)/(\d+)", log_path.read_text())
      if counts and counts[-1][0] == counts[-1][1]:
        total = int(counts[-1][1])
        break
      time.sleep(1)
    compiled_all = time.perf_counter() - t0
    at_end = proc_status(proc.pid)
    kinds = resident_by_kind(proc.pid)
    text = log_path.read_text()
    held = re.search(r"per device: weights ([\d.]+) (GiB|MiB), pool ([\d.]+) (GiB|MiB)", text)
    mb = lambda v, unit: float(v) * (1024 if unit == "GiB" else 1)
    weights_pool = mb(held[1], held[2]) + mb(held[3], held[4])
    return dict(
      ready_s=ready,
      first_completion_s=first,
      all_compiled_s=compiled_all,
      shapes=total,
      rss_ready_mb=at_ready["rss_mb"],
      rss_end_mb=at_end["rss_mb"],
      maps_end=at_end["maps"],
      **{f"rss_end_{k}_mb": v for k, v in kinds.items()},
      weights_pool_mb=weights_pool,
      answered=bool(answered),
    )
  finally:
    proc.terminate()
    try:
      proc.wait(30)
    except subprocess.TimeoutExpired:
      proc.kill()


def group_rss_mb(pgid: int) -> float:
  """Resident MB of every process in a process group."""
  total = 0.0
  for stat in Path("/proc").glob("[0-9]*/stat"):
    try:
      fields = stat.read_text().rsplit(")", 1)[1].split()
      if int(fields[2]) == pgid:  # the process group, after the state and the parent
        total += proc_status(int(stat.parent.name))["rss_mb"]
    except (OSError, ValueError, IndexError, TypeError):
      continue
  return total


def peer_start(folder: Path, python: str, timeout: float) -> dict:
  """vLLM's OpenAI server on `folder`: seconds to /health, resident MB then."""
  port = free_port()
  cmd, extra = serve_peer.server_command("vllm", folder, port, 32, SHAPE["max_seq_len"], python)
  log = tempfile.TemporaryFile()
  env = {**os.environ, **extra}
  proc = subprocess.Popen(
    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=folder.parent, start_new_session=True
  )
  try:
    ready = serve_http.wait_ready(proc, "127.0.0.1", port, timeout)
    return dict(ready_s=ready, rss_mb=group_rss_mb(proc.pid))
  finally:
    serve_http.stop(proc)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--folder", default=str(ROOT / "runs" / "startup-135m"))
  p.add_argument("--runner", default="auto", help="serve.py --runner")
  p.add_argument("--timeout", type=float, default=1800)
  p.add_argument("--peer-python", help="vLLM's python (a virtualenv's), to start its server too")
  p.add_argument(
    "--serve-args", default="", help="more serve.py flags, one string (e.g. '--max-num-seqs 32')"
  )
  args = p.parse_args(argv)
  folder = make_folder(Path(args.folder))
  cache = Path(tempfile.mkdtemp(prefix="startup-cache-"))
  rows = []
  print(f"# load {os.getloadavg()[0]:.2f} before the starts")
  for which in ("empty cache", "filled cache"):
    before = cache_entries(cache)
    got = start(folder, cache, args.runner, args.serve_args.split(), args.timeout)
    got["new_cache_entries"] = cache_entries(cache) - before
    rows.append((which, got))
  print("| start | ready s | first completion s | all compiled s | shapes | new cache entries |")
  print("| resident MB at ready / end | weights + pool MB | end / (weights + pool) | maps |")
  print("| end: files / code / heap MB |")
  for which, g in rows:
    ratio = g["rss_end_mb"] / g["weights_pool_mb"]
    print(
      f"| {which} | {g['ready_s']:.1f} | {g['first_completion_s']:.2f} | "
      f"{g['all_compiled_s']:.1f} | {g['shapes']} | {g['new_cache_entries']} | "
      f"{g['rss_ready_mb']:.0f} / {g['rss_end_mb']:.0f} | {g['weights_pool_mb']:.0f} | "
      f"{ratio:.2f} | {g['maps_end']} | {g['rss_end_files_mb']:.0f} / {g['rss_end_code_mb']:.0f} / "
      f"{g['rss_end_heap_mb']:.0f} |"
    )
  if args.peer_python:
    peer = peer_start(folder, serve_peer.check_peer_python(args.peer_python), args.timeout)
    print(f"| vLLM's OpenAI server | {peer['ready_s']:.1f} | resident MB {peer['rss_mb']:.0f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
