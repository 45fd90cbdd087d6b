"""Load on an OpenAI-compatible server over HTTP: streamed `/v1/completions`, timed per event.

Stdlib only (http.client in threads), so it drives our serve.py and vLLM's server alike and
imports nothing heavy. Two load shapes:
  fixed concurrency: N workers, each sending its next request when its last one finishes;
  Poisson arrivals: requests sent at exponentially spaced times (mean rate R per second),
    whatever is still running.
Each request is timed from the moment it is sent: TTFT is the arrival of its first event that
carries text, ITL the gaps between its later text events (one per token when the server sends
one event per token: `events_per_token` says whether it does).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

DONE = "[DONE]"


@dataclass
class Record:
  """One streamed request: when it was sent and when each text event arrived (perf_counter s)."""

  sent: float
  event_times: list[float] = field(default_factory=list)  # events whose choice carries text
  n_tokens: int = 0  # completion tokens (the usage chunk's, else the events counted)
  finished: float = 0.0
  error: str | None = None


def parse_sse_line(line: str) -> dict | str | None:
  """The payload of one server-sent-event line: a dict for `data: {json}`, DONE for
  `data: [DONE]`, None for anything else (blank separators, comments, other fields)."""
  line = line.rstrip("\r\n")
  if not line.startswith("data:"):
    return None
  data = line[5:].strip()
  if data == DONE:
    return DONE
  return json.loads(data)


def event_text(payload: dict) -> str:
  """The text a completion chunk carries ('' for a usage-only or empty chunk)."""
  return "".join(c.get("text") or "" for c in payload.get("choices") or ())


def read_stream(lines, clock=time.perf_counter) -> tuple[list[float], int | None]:
  """(arrival time of each event carrying text, usage completion_tokens or None) of an SSE
  stream given as an iterable of lines; stops at `data: [DONE]`."""
  times, usage = [], None
  for raw in lines:
    line = raw.decode() if isinstance(raw, bytes) else raw
    payload = parse_sse_line(line)
    if payload is DONE:
      break
    if payload is None:
      continue
    now = clock()
    if "error" in payload:
      raise RuntimeError(f"server error event: {payload['error']}")
    if event_text(payload):
      times.append(now)
    if payload.get("usage"):
      usage = payload["usage"].get("completion_tokens")
  return times, usage


def stream_completion(host: str, port: int, body: dict, timeout: float = 600.0) -> Record:
  """Sends one streamed completion and times its events; errors land in `Record.error`."""
  rec = Record(sent=time.perf_counter())
  conn = http.client.HTTPConnection(host, port, timeout=timeout)
  try:
    payload = json.dumps({**body, "stream": True}).encode()
    conn.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
      rec.error = f"HTTP {resp.status}: {resp.read(500).decode(errors='replace')}"
      return rec
    rec.event_times, usage = read_stream(iter(resp.readline, b""))
    rec.n_tokens = usage if usage is not None else len(rec.event_times)
  except (OSError, http.client.HTTPException, RuntimeError, ValueError) as e:
    rec.error = f"{type(e).__name__}: {e}"
  finally:
    rec.finished = time.perf_counter()
    conn.close()
  return rec


def run_concurrent(
  host: str, port: int, bodies: Sequence[dict], streams: int, stagger: float = 0.0
) -> list[Record]:
  """`streams` workers share the bodies in order, each sending its next when its last ends;
  worker k sends its first `k * stagger` seconds after worker 0 (0: all at once)."""
  records: list[Record | None] = [None] * len(bodies)
  nxt = iter(range(len(bodies)))
  lock = threading.Lock()

  def worker(k: int):
    time.sleep(k * stagger)
    while True:
      with lock:
        i = next(nxt, None)
      if i is None:
        return
      records[i] = stream_completion(host, port, bodies[i])

  threads = [threading.Thread(target=worker, args=(k,)) for k in range(min(streams, len(bodies)))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return records


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
  """Send times (s from the start) of n requests arriving as a Poisson process of `rate`/s."""
  rng = random.Random(seed)
  t, out = 0.0, []
  for _ in range(n):
    t += rng.expovariate(rate)
    out.append(t)
  return out


def run_poisson(
  host: str, port: int, bodies: Sequence[dict], rate: float, seed: int = 0
) -> list[Record]:
  """Each body sent at its Poisson arrival time, in a thread of its own."""
  records: list[Record | None] = [None] * len(bodies)

  def send(i):
    records[i] = stream_completion(host, port, bodies[i])

  threads = []
  start = time.perf_counter()
  for i, at in enumerate(poisson_arrivals(len(bodies), rate, seed)):
    time.sleep(max(0.0, start + at - time.perf_counter()))
    threads.append(threading.Thread(target=send, args=(i,)))
    threads[-1].start()
  for t in threads:
    t.join()
  return records


def percentile(xs: Sequence[float], q: float) -> float:
  """The q-th percentile with linear interpolation between ranks (numpy's default); nan if
  empty."""
  if not xs:
    return math.nan
  s = sorted(xs)
  pos = (len(s) - 1) * q / 100
  lo = math.floor(pos)
  hi = min(lo + 1, len(s) - 1)
  return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(records: Sequence[Record]) -> dict:
  """One pass's figures: output tok/s over the pass's wall time, TTFT and ITL percentiles (ms),
  text events per completion token and the fraction of requests sent bunched (`bunched`).

  Raises:
    RuntimeError: a request failed (its error is named); figures over fewer requests than were
      sent would not compare.
  """
  failed = [r.error for r in records if r.error]
  if failed:
    raise RuntimeError(f"{len(failed)} of {len(records)} requests failed, first: {failed[0]}")
  wall = max(r.finished for r in records) - min(r.sent for r in records)
  ttft = [(r.event_times[0] - r.sent) * 1e3 for r in records if r.event_times]
  itl = [(b - a) * 1e3 for r in records for a, b in zip(r.event_times, r.event_times[1:])]
  tokens = sum(r.n_tokens for r in records)
  events = sum(len(r.event_times) for r in records)
  out = dict(tok_s=tokens / wall, tokens=tokens, events_per_token=events / max(tokens, 1))
  out["bunched"] = bunched([r.sent for r in records])
  for q in (50, 90, 99):
    out[f"ttft_p{q}"] = percentile(ttft, q)
    out[f"itl_p{q}"] = percentile(itl, q)
  return out


def bunched(sent: Sequence[float], window: float = 0.005) -> float:
  """The fraction of requests sent within `window` seconds of the one sent before them.

  A closed loop's streams that finish in the same engine step send their next requests
  together, and a server that prefills them in one step keeps them together: their TTFT is then
  that of the whole group's prefill. Near 0 the streams have drifted apart (each arrival is
  prefilled alone); near 1 they run in lockstep. The same load can settle either way on the same
  server, so TTFT percentiles from closed loops are read beside this figure."""
  s = sorted(sent)
  return sum(b - a <= window for a, b in zip(s, s[1:])) / max(len(s), 1)


def completion_bodies(prompts: Sequence[Sequence[int]], max_tokens: int, model: str) -> list[dict]:
  """Greedy streamed completions of token-id prompts, each to exactly `max_tokens` tokens."""
  return [
    dict(
      model=model,
      prompt=list(p),
      max_tokens=max_tokens,
      temperature=0,
      ignore_eos=True,
      stream_options={"include_usage": True},
    )
    for p in prompts
  ]


def wait_ready(proc: subprocess.Popen, host: str, port: int, timeout: float) -> float:
  """Seconds until GET /health answers 200.

  Raises:
    RuntimeError: the server exited first, or `timeout` seconds passed.
  """
  start = time.monotonic()
  while time.monotonic() - start < timeout:
    if proc.poll() is not None:
      raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
    conn = http.client.HTTPConnection(host, port, timeout=2)
    try:
      conn.request("GET", "/health")
      if conn.getresponse().status == 200:
        return time.monotonic() - start
    except (OSError, http.client.HTTPException):
      pass
    finally:
      conn.close()
    time.sleep(0.5)
  raise RuntimeError(f"server on port {port} not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
  """Terminates a server started here (its whole process group), killing it if it lingers."""
  if proc.poll() is not None:
    return
  try:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
  except ProcessLookupError:
    pass
