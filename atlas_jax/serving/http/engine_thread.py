"""The engine thread: drives an Engine for the HTTP handlers on the event loop.

The engine runs in one background thread that steps while there is work; request handlers on the
event loop submit requests (checked at once, a bad one a RequestError; queued in the engine's
inbox without waiting for the step in progress) and read their outputs from per-request asyncio
queues, filled from the engine thread with `call_soon_threadsafe`. The thread also times each
request for the Prometheus metrics (time to first token, between tokens, end to end).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from atlas_jax.decoding.sampling import SamplingParams
from atlas_jax.serving.engine import Engine, RequestError
from atlas_jax.serving.lora import AdapterError
from atlas_jax.serving.metrics import ServingMetrics


@dataclasses.dataclass
class _Stream:
  """A request in flight: where its outputs go, and its timings for the metrics."""

  queue: asyncio.Queue  # RequestOutputs, put from the engine thread
  loop: asyncio.AbstractEventLoop  # the loop `queue` belongs to
  arrival: float  # perf_counter seconds
  n_prompt: int
  first: float | None = None  # when its first token came out
  last: float | None = None  # ... and its latest
  n_out: int = 0


class EngineRunner:
  """Drives an Engine from a background thread for asyncio callers.

  The engine thread alone steps the engine, holding no lock the event loop waits on: a
  submission is checked in the caller's thread and put in the engine's inbox
  (`Engine.enqueue`), which the engine thread drains at the start of its next step, so an
  arrival returns to the event loop at once even while a long step runs. Gauges other than the
  request counts are a snapshot the engine thread takes after each step.
  """

  def __init__(self, engine: Engine, metrics: ServingMetrics | None = None):
    self.engine = engine
    self.metrics = metrics or ServingMetrics()
    self._wake = threading.Event()
    self._streams: dict[str, _Stream] = {}
    self._streams_lock = threading.Lock()  # held for dict updates only, never across a step
    self._stop = False
    self.error: BaseException | None = None
    self._gauges = self._read_gauges()
    self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
    self._thread.start()

  def submit(
    self, prompt: list[int], params: SamplingParams, *, stream: bool = False
  ) -> tuple[str, asyncio.Queue]:
    """Queues a request; its RequestOutputs arrive on the returned queue (None ends it)."""
    return self.submit_all([(prompt, [params])], stream=stream)[0]

  def submit_all(
    self,
    groups: Sequence[tuple[list[int], Sequence[SamplingParams]]],
    *,
    stream: bool = False,
    adapter: str | None = None,
  ) -> list[tuple[str, asyncio.Queue]]:
    """Queues each (prompt, n params) group: n completions of the prompt, computed once and
    sharing its blocks. All groups or none: a RequestError for any leaves nothing queued.
    `stream`: the client reads each token as it is drawn; `adapter`: the LoRA adapter they run
    under (`Engine.add_request`). Never waits for the step in progress."""
    loop = asyncio.get_running_loop()
    now = time.perf_counter()
    subs: list[tuple[str, asyncio.Queue]] = []
    streams: dict[str, _Stream] = {}
    batch = []
    for prompt, params in groups:
      rids = [uuid.uuid4().hex for _ in params]
      batch.append((rids, prompt, params))
      for rid in rids:
        streams[rid] = _Stream(asyncio.Queue(), loop, now, len(prompt))
        subs.append((rid, streams[rid].queue))
    # Registered first: once enqueued, the engine thread may step them before this returns.
    with self._streams_lock:
      self._streams.update(streams)
    try:
      self.engine.enqueue(batch, stream=stream, **({"adapter": adapter} if adapter else {}))
    except (RequestError, AdapterError):
      with self._streams_lock:
        for rid in streams:
          self._streams.pop(rid, None)
      raise
    self._wake.set()
    return subs

  def abort(self, rid: str) -> None:
    self.engine.abort(rid)
    self._wake.set()

  def shutdown(self) -> None:
    self._stop = True
    self._wake.set()
    self._thread.join(timeout=10)

  def gauges(self) -> dict[str, Any]:
    """The engine's gauges: the request counts now, the rest as the last step left them."""
    return {**self._gauges, "running": self.engine.n_running, "waiting": self.engine.n_waiting}

  def _read_gauges(self) -> dict[str, Any]:
    s = self.engine.kv_stats()
    return dict(
      running=self.engine.n_running,
      waiting=self.engine.n_waiting,
      kv_usage=self.engine.kv_usage(),
      preemptions=self.engine.n_preemptions,
      prefix_queries=s.prefix_query_tokens,
      prefix_hits=s.prefix_hit_tokens,
      drafted=self.engine.n_drafted,
      accepted=self.engine.n_accepted,
      acceptance_length=self.engine.mean_acceptance_length,
    )

  def _loop(self) -> None:
    while not self._stop:
      if not self.engine.has_unfinished():
        self._wake.wait(0.05)
        self._wake.clear()
        continue
      try:
        outputs = self.engine.step()
      except BaseException as e:  # keep serving: fail the in-flight requests, not the server
        self.error = e
        with self._streams_lock:
          rids = list(self._streams)
        for rid in rids:
          self.engine.abort(rid)
        outputs = self.engine.step()
        for out in outputs:
          out.error = f"engine error: {e}"
      self._gauges = self._read_gauges()
      now = time.perf_counter()
      for out in outputs:
        with self._streams_lock:
          stream = self._streams.get(out.request_id)
          if stream is not None and out.finished:
            del self._streams[out.request_id]
        if stream is None:
          continue
        if out.new_token_ids:
          if stream.first is None:
            stream.first = now
            self.metrics.ttft.observe(now - stream.arrival)
          else:
            self.metrics.itl.observe(now - stream.last)
          stream.last = now
          stream.n_out += len(out.new_token_ids)
        if out.finished:
          self.metrics.e2e.observe(now - stream.arrival)
          self.metrics.finished(out.finish_reason or "stop", stream.n_prompt, stream.n_out)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
