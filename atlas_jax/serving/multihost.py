"""Serving across hosts on JAX's multi-controller runtime: one front end, the same steps on every
process.

Every process runs `serve.py` with the same flags and its own `--process-id`. They join one
`jax.distributed` group, load the same weights, and build the same engine over one global mesh
(the data and tensor axes span every process's devices; `--data-parallel-size` replicas in
process order, so with one replica's devices per host each replica lives on its own host).
Process 0, the leader, runs the HTTP front end, the scheduler and the output processor; the
others, the followers, run no engine loop of their own: they replay the leader's device calls.

A jitted program over a mesh spanning processes runs only when every process calls it with the
same arguments, in the same order. So the leader's runner calls its programs through `Mirror`:
each call's host arguments (the step record, a burst's count, a copy's block ids) go to every
process first, as one message, and then every process runs the same program over its own
shards of the weights and the pools. The message travels as a collective over the processes
(`multihost_utils.broadcast_one_to_all`, gloo on CPUs, the interconnect elsewhere): a header of
fixed shape (its kind and its length), then the pickled call padded to a power of two of bytes,
so the broadcast compiles once per size bucket, never per step. Every output but the pools is
gathered to every process (`process_allgather`), so the leader reads the rows of every replica.

Losing a process: a collective with a dead peer may raise or may never return (gloo does
either, depending on where the peer died; NCCL waits), so every process beats a heartbeat into
the coordination service's key-value store, and the leader watches the followers' beats
(`Liveness`). A follower silent for `heartbeat_timeout` seconds, or a collective that fails,
stops the group: the leader logs which process was lost and exits with status 1 (JAX's own
recoverability is on, so the coordination service does not abort the leader first). A follower
that loses the leader stops at once: the coordination service runs in the leader, and jax's
client in the follower aborts when it goes (saying so), else its next heartbeat fails.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import sys
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from atlas_jax.config import ConfigError, EngineConfig
from atlas_jax.serving.batch import StepRecord, pow2

log = logging.getLogger("atlas_jax.serving")

# Message kinds (the header's first word).
# SETTLED follows a call that raised on the leader: the followers, whose call raised alike, go
# on; the engine's recovery (`faults`) then sends what it does.
# WARMUP: the shapes the leader compiles ahead, for the followers to compile too, in the
# background (each process compiles its own programs).
CALL, RESET, STOP, SETTLED, WARMUP = 1, 2, 3, 4, 5
# A payload's bytes round up to a power of two from here: one compiled broadcast per bucket.
MIN_PAYLOAD = 4096
# Programs that return only their pools, and the one that takes no pools.
POOLS_ONLY = ("copy_blocks",)
NO_POOLS = ("prompt_logprobs",)
PROGRAMS = (
  "forward_sample",
  "decode_burst",
  "speculative_round",
  "speculative_draft",
  "speculative_verify",
  "prompt_logprobs",
  "copy_blocks",
)


@dataclasses.dataclass(frozen=True)
class Distributed:
  """Where a process stands in a multi-host group (serve.py's flags of the same names; train.py
  takes them as `mesh.coordinator_address`, `mesh.num_processes`, `mesh.process_id`)."""

  coordinator_address: str | None = None  # HOST:PORT of process 0
  num_processes: int | None = None
  process_id: int | None = None
  heartbeat_timeout: float = 30.0  # seconds a process may stay silent before the group stops

  def __post_init__(self):
    given = [self.coordinator_address, self.num_processes, self.process_id]
    if all(x is None for x in given):
      return
    if any(x is None for x in given):
      raise ConfigError(
        "--coordinator-address, --num-processes and --process-id are given together or not "
        f"at all (given: {self.coordinator_address!r}, {self.num_processes!r}, "
        f"{self.process_id!r})"
      )
    host, sep, port = self.coordinator_address.rpartition(":")
    if not (host and sep and port.isdigit()):
      raise ConfigError(
        f"--coordinator-address={self.coordinator_address!r} is not allowed: expected HOST:PORT"
      )
    if self.num_processes < 1:
      raise ConfigError(f"--num-processes={self.num_processes} is not allowed: must be >= 1")
    if not 0 <= self.process_id < self.num_processes:
      raise ConfigError(
        f"--process-id={self.process_id} is not allowed: must be in [0, {self.num_processes})"
      )
    if not self.heartbeat_timeout > 0:
      raise ConfigError(
        f"--heartbeat-timeout={self.heartbeat_timeout} is not allowed: must be > 0 seconds"
      )

  @property
  def enabled(self) -> bool:
    return self.coordinator_address is not None

  @property
  def leader(self) -> bool:
    return not self.enabled or self.process_id == 0


def initialize(d: Distributed) -> Liveness | None:
  """Joins the group `d` describes and starts its heartbeats (`Liveness`); None for one
  process. Call before jax touches a device."""
  if not d.enabled:
    return None
  # CPU processes exchange collectives over gloo (GPU/TPU use their own interconnect).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # A lost task is ours to report (`Liveness`): without this the coordination service aborts
  # every process as soon as it notices, before any of them can say what happened.
  jax.config.update("jax_enable_recoverability", True)
  jax.distributed.initialize(
    d.coordinator_address,
    num_processes=d.num_processes,
    process_id=d.process_id,
    heartbeat_timeout_seconds=max(1, int(d.heartbeat_timeout)),
  )
  log.info(
    "process %d of %d: %d local devices, %d in all",
    d.process_id,
    d.num_processes,
    jax.local_device_count(),
    jax.device_count(),
  )
  return Liveness(d.heartbeat_timeout)


def processes() -> int:
  return jax.process_count()


def engine_config(config: EngineConfig, *, lora: bool) -> EngineConfig:
  """The engine config every process of a group runs: the accelerator runner (the CPU
  runner's start-up probes time each machine, and every process must compile the same
  programs), over a mesh of every process's devices.

  Raises:
    ConfigError naming the field: the CPU runner asked for, LoRA adapters (loaded and unloaded
    at run time on the leader's copy of the weights only), or a mesh short of the devices.
  """
  if config.runner == "cpu":
    raise ConfigError(
      "serve.engine.runner='cpu' is not allowed across processes: use 'auto' or 'ragged' (the "
      "CPU runner's choices are timed per machine, and every process must run the same programs)"
    )
  if lora:
    raise ConfigError("--enable-lora is not allowed across processes (--num-processes > 1)")
  data, tensor = config.data_parallel_size, config.tensor_parallel_size
  if data * tensor != jax.device_count():
    raise ConfigError(
      f"serve.engine.tensor_parallel_size={tensor} x serve.engine.data_parallel_size={data} "
      f"is not allowed across {jax.process_count()} processes: the mesh must take all "
      f"{jax.device_count()} devices ({jax.local_device_count()} per process)"
    )
  return dataclasses.replace(config, runner="ragged")


def _exit(message: str, *args) -> None:
  """Logs the error and ends this process at once (status 1): the group cannot go on, and an
  orderly exit would wait on the lost process."""
  log.error(message, *args)
  for handler in logging.getLogger().handlers + log.handlers:
    handler.flush()
  sys.stderr.flush()
  os._exit(1)


class Liveness:
  """Heartbeats in the coordination service's key-value store: each process writes its count
  every `timeout / 4` seconds; the leader reads the followers' and stops the group when one has
  not moved for `timeout` seconds; a follower that cannot write has lost the leader (the
  service runs in process 0)."""

  def __init__(self, timeout: float):
    from jax._src import distributed  # the group's client: jax has no public handle on it

    self.client = distributed.global_state.client
    self.timeout = timeout
    self.pid, self.n = jax.process_index(), jax.process_count()
    self.stopped = threading.Event()
    self._thread = threading.Thread(target=self._beat, name="atlas-liveness", daemon=True)
    self._thread.start()

  def _key(self, pid: int) -> str:
    return f"atlas_jax/alive/{pid}"

  def _beat(self) -> None:
    count, seen = 0, {}
    start = time.monotonic()
    while not self.stopped.wait(self.timeout / 4):
      count += 1
      try:
        self.client.key_value_set(self._key(self.pid), str(count), allow_overwrite=True)
      except Exception as e:
        if self.stopped.is_set():
          return
        _exit("process %d lost the leader (process 0, the coordinator): %s", self.pid, e)
      if self.pid != 0:
        continue
      now = time.monotonic()
      for pid in range(1, self.n):
        try:
          beat = self.client.key_value_try_get(self._key(pid))
        except Exception:  # not written yet
          beat = None
        if beat is not None and seen.get(pid, (None,))[0] != beat:
          seen[pid] = (beat, now)
        last = seen.get(pid, (None, start))[1]
        if now - last > self.timeout and not self.stopped.is_set():
          _exit(
            "process %d of %d was lost: no heartbeat for %.0f s (--heartbeat-timeout); "
            "stopping the group",
            pid,
            self.n,
            now - last,
          )

  def stop(self) -> None:
    self.stopped.set()


class Channel:
  """Messages from the leader to every process, as collectives: a fixed-shape header i32[2]
  (kind, payload bytes), then the payload as u8[a power of two]."""

  def __init__(self, on_failure):
    self.on_failure = on_failure  # called with the exception when a broadcast fails
    self.leader = jax.process_index() == 0

  def _broadcast(self, x: np.ndarray) -> np.ndarray:
    try:
      return np.asarray(multihost_utils.broadcast_one_to_all(x, is_source=self.leader))
    except Exception as e:
      self.on_failure(e)
      raise

  def send(self, kind: int, body=None) -> None:
    """The leader's side."""
    data = b"" if body is None else pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)
    self._broadcast(np.array([kind, len(data)], np.int32))
    if data:
      buf = np.zeros((pow2(len(data), MIN_PAYLOAD),), np.uint8)
      buf[: len(data)] = np.frombuffer(data, np.uint8)
      self._broadcast(buf)

  def receive(self):
    """A follower's side: (kind, body or None)."""
    kind, n = (int(v) for v in self._broadcast(np.zeros((2,), np.int32)))
    if n == 0:
      return kind, None
    buf = self._broadcast(np.zeros((pow2(n, MIN_PAYLOAD),), np.uint8))
    # The leader's own message, over the group's own collective: trusted as the leader is.
    return kind, pickle.loads(buf[:n].tobytes())


def _left(pid: int) -> str:
  return f"atlas_jax/left/{pid}"


def leave() -> None:
  """A follower's end, once the leader has stopped it: at once, skipping jax's own shutdown,
  whose disconnect call to the coordination service (in the leader, which may already be gone)
  would abort the process."""
  for handler in logging.getLogger().handlers + log.handlers:
    handler.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)


# Stand-ins for the runner's own arrays in a call's arguments: each process puts its own there.
_STATES, _POOLS, _TARGET = "<states>", "<pools>", "<target states>"


class Mirror:
  """A runner's programs run by every process of the group: the leader's calls are sent to the
  followers, which run them in the same order (`follow`).

  Installed on the runner (`runner.programs`, whose calls it takes over; `runner.on_devices`,
  as records are placed here, from the host copy every process holds; `runner.reset_pools`;
  `runner.warmup`).
  """

  def __init__(self, runner, liveness: Liveness | None, channel: Channel | None = None):
    self.runner = runner
    self.programs = runner.programs
    self.liveness = liveness
    self.channel = Channel(self._lost) if channel is None else channel
    self._lock = threading.Lock()  # a message and its run together: every process, one order
    mesh = runner.mesh
    self.rows = NamedSharding(mesh, runner.layout.spec("batch"))
    self.replicated = NamedSharding(mesh, PartitionSpec())
    self._reset, self._warmup = runner.reset_pools, runner.warmup
    runner.on_devices = lambda x: x
    runner.reset_pools = self.reset_pools
    runner.warmup = self.warmup
    runner.programs = _Programs(self)

  # -- both sides --------------------------------------------------------------------------------

  def _lost(self, error: BaseException) -> None:
    """A collective across the processes failed: a process is gone. The heartbeat watch names
    it and stops the group; past its timeout this process stops anyway."""
    log.error("a collective across the %d processes failed: %s", jax.process_count(), error)
    deadline = time.monotonic() + (0 if self.liveness is None else 2 * self.liveness.timeout)
    while time.monotonic() < deadline:
      time.sleep(0.1)
    _exit("stopping the group: a collective failed and no process was found missing")

  def _global(self, a: np.ndarray, sharding) -> jax.Array:
    # Built from this process's own host copy, shard by shard: no transfer between processes.
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

  def _place(self, a):
    """An argument as the program takes it: a record's arrays split over the data axis by rows
    (as `ModelRunner.on_devices` places them), any other array replicated."""
    if isinstance(a, StepRecord):
      return jax.tree.map(lambda v: self._global(np.asarray(v), self.rows), a)
    if isinstance(a, np.ndarray) and a.ndim:
      return self._global(a, self.replicated)
    return a

  def _resolve(self, a):
    r = self.runner
    if isinstance(a, str) and a in (_STATES, _POOLS, _TARGET):
      return {_STATES: r.states, _POOLS: r.pools, _TARGET: r.states[0]}[a]
    return self._place(a)

  def run(self, name: str, wire: tuple):
    """Runs program `name` on this process's weights and pools; the pools it returns replace
    the runner's; every other output gathered (numpy: every replica's rows)."""
    out = getattr(self.programs, name)(*map(self._resolve, wire))
    if name in POOLS_ONLY:
      self.runner.pools = out
      return out
    pools, outs = (None, tuple(out)) if name in NO_POOLS else (out[0], tuple(out[1:]))
    if pools is not None:
      self.runner.pools = pools
    try:
      outs = multihost_utils.process_allgather(outs, tiled=True)
    except Exception as e:
      self._lost(e)
      raise
    return outs if pools is None else (pools, *outs)

  # -- the leader's side -------------------------------------------------------------------------

  def _wire(self, args: tuple) -> tuple:
    """A call's arguments as the followers receive them: the runner's own arrays by name, every
    other array on the host."""
    r = self.runner

    def host(v):
      if isinstance(v, jax.Array):
        if not v.is_fully_addressable:
          raise ValueError(
            "a mirrored program's argument spans other processes; only host arrays and the "
            "runner's own states and pools can be sent"
          )
        return np.asarray(v)
      return v

    out = []
    for a in args:
      if a is r.states:
        out.append(_STATES)
      elif a is r.pools:
        out.append(_POOLS)
      elif a is r.states[0]:
        out.append(_TARGET)
      else:
        out.append(jax.tree.map(host, a))
    return tuple(out)

  def call(self, name: str, args: tuple):
    with self._lock:
      wire = self._wire(args)
      self.channel.send(CALL, (name, wire))
      try:
        return self.run(name, wire)
      except Exception:
        # The followers failed alike (the same program on the same record), unless the group
        # broke: a message that cannot be sent tells (`_lost`).
        self.channel.send(SETTLED)
        raise

  def lower(self, name: str, args: tuple):
    """Lowers a program here only (compiling needs no other process)."""
    return getattr(self.programs, name).lower(*map(self._place, args))

  def reset_pools(self) -> None:
    with self._lock:
      self.channel.send(RESET)
      self._reset()

  def warmup(self, shapes, progress=None, threads=None, *, first=None):
    """`ModelRunner.warmup` on the leader, the followers compiling the same shapes in the
    background meanwhile (the runs of the first `first` reach them as calls)."""
    shapes = list(shapes)
    with self._lock:
      self.channel.send(WARMUP, shapes)
    return self._warmup(shapes, progress, threads, first=first)

  def stop(self) -> None:
    """Ends the followers' loops (the leader's last message) and waits for them to leave: the
    coordination service lives in this process, and must outlast them."""
    with self._lock:
      self.channel.send(STOP)
    if self.liveness is None:
      return
    self.liveness.stop()
    client, wait_ms = self.liveness.client, int(self.liveness.timeout * 1000)
    for pid in range(1, jax.process_count()):
      try:
        client.blocking_key_value_get(_left(pid), wait_ms)
      except Exception as e:
        log.warning("process %d did not leave within %.0f s: %s", pid, self.liveness.timeout, e)

  # -- a follower's side -------------------------------------------------------------------------

  def follow(self) -> None:
    """Runs the leader's calls until it sends STOP."""
    log.info("process %d: following the leader's steps", jax.process_index())
    n = 0
    while True:
      kind, body = self.channel.receive()
      if kind == STOP:
        log.info("process %d: stopped by the leader after %d calls", jax.process_index(), n)
        if self.liveness is not None:
          self.liveness.stop()
          self.liveness.client.key_value_set(_left(jax.process_index()), "1")
        return
      if kind == RESET:
        self._reset()
      elif kind == WARMUP:
        self._warmup(body, first=0)  # all of them on its background thread
      elif kind == CALL:
        n += 1
        name, wire = body
        try:
          self.run(name, wire)
        except Exception as e:  # the leader's call failed alike: its fault handling decides
          log.warning("program %s failed here as on the leader: %s", name, e)
          kind, _ = self.channel.receive()
          if kind != SETTLED:
            _exit("process %d: program %s failed here alone: %s", jax.process_index(), name, e)


class _Program:
  """One program as the runner calls it: `__call__` runs it on every process, `lower` here."""

  def __init__(self, mirror: Mirror, name: str):
    self.mirror, self.name = mirror, name

  def __call__(self, *args):
    return self.mirror.call(self.name, args)

  def lower(self, *args):
    return self.mirror.lower(self.name, args)


class _Programs:
  """The runner's `steps.Programs`, each mirrored (None where the runner has none)."""

  def __init__(self, mirror: Mirror):
    for name in PROGRAMS:
      setattr(
        self, name, None if getattr(mirror.programs, name) is None else _Program(mirror, name)
      )


def start(engine, liveness: Liveness | None) -> Mirror | None:
  """The mirror of `engine`'s runner across the group (None for one process). Every process
  takes the leader's pool size: each sized its own from its devices' memory, and the pools'
  shapes must agree."""
  if liveness is None:
    return None
  runner = engine.runner
  # (blocks per replica, the windowed layers' own blocks of a hybrid pool or 0)
  mine = (engine.config.n_blocks, runner.n_window_blocks or 0)
  leaders = tuple(int(n) for n in multihost_utils.broadcast_one_to_all(np.array(mine, np.int32)))
  if leaders != mine:
    if leaders > mine:
      log.warning(
        "process %d sized %s blocks per replica, the leader %s: taking the leader's",
        jax.process_index(),
        mine,
        leaders,
      )
    runner.allocate(leaders[0], runner.limits, leaders[1] or None)
  return Mirror(runner, liveness)


__all__ = ["Distributed", "Liveness", "Mirror", "engine_config", "initialize", "leave", "start"]
