"""The serving engine: a thin loop over its parts, as vLLM v1's engine core is.

    requests (`requests.Intake`: validated at intake)
      -> scheduler (`scheduler.Scheduler`: admission, continuous batching, chunked prefill,
         preemption; a block allocator with prefix cache per data-parallel replica)
      -> a step plan (rows, tokens, blocks to copy: a mixed step, a burst, a speculative round)
      -> model runner (`runner.ModelRunner`: the device mesh, the placed weights, the pools and
         the jitted programs, run from one `batch.StepRecord`; XLA's CPU backend has its own,
         `serving.cpu.CPUModelRunner`, chosen once by `serve.engine.runner`)
      -> sampler / speculative verifier (one drafter interface) / grammar mask, on the device
      -> output processor (`outputs.OutputProcessor`: detokenisation, stops, logprobs)
      -> the scheduler advances each request from the step's results (`update_from_output`,
         `update_from_draws`) and settles the blocks of what was kept.

Fault isolation (`faults`) wraps the runner's calls: a request whose rows make a step raise
fails alone, and a step that loses the donated pools rebuilds them.

Each `step()` is one of the scheduler's plans. A mixed step is one model call: every row's prompt
chunk and every decoding row's token on one ragged token axis (`runner.ModelRunner.execute`), its
tokens rounded up to a power of two so that a few compiled shapes serve every step; every layer
writes all the step's keys and values before any token attends, so a request admitted this step
whose prefix blocks another row is computing reads them after they are written. (The CPU runner
cuts prompts into 16-token rows and may run the decode rows as a second call:
`serving.cpu.CPUModelRunner.execute`.) When every
running request is decoding and nothing waits that could be admitted, a step is a burst instead:
`decode_burst` iterations in one jitted call, each sampled token fed back on the device. The host
reads the I tokens of every row once, cuts each at its first stop (eos, stop token, max_tokens, stop
string) and gives back the blocks it did not need, so outputs are exactly those of single steps
while the host's per-step work is paid once per I tokens. The next burst is dispatched (chained, fed
by the last one's draws on the device) before the host reads the one in flight, so the host settles
step n while the device runs step n + 1; a request that arrives meanwhile and could be admitted
stops the chain, so it waits for the burst in flight and no more, and is prefilled in the step
after. Offline (`Engine.generate`, serve.py's batch mode: every request added before the first
step, `offline`), no arrival can wait, so bursts run `offline_burst` iterations (32), the host's
work paid once per 32 tokens. A burst's count is an input of its program, not its shape: one
compiled burst per shape runs any count up to the longest, and each burst is cut to the most
draws a row still needs. While a streamed request runs (`add_request(..., stream=True)`, as the
server's `stream: true`) no burst runs: each step hands back its next token as soon as it is
drawn, as vLLM streams; `stream_bursts` keeps bursting then (I tokens per step, the host's work
amortised), with the same tokens.

Attention work follows the real lengths: every call's block table has as many columns as its
longest row holds blocks, rounded up to a power of two, not the context's maximum.

`add_requests` queues n completions of one prompt (OpenAI's `n`): only the first computes the
prompt; when its prompt is done, every other completion forks its blocks, drops the last prompt
token and recomputes just that one, in a device copy of the shared partial block
(copy-on-write). So n completions cost one prefill.

A guided request (`SamplingParams.guided`, a compiled grammar) holds a matcher: each step that
samples for it passes its allowed tokens (packed bits i32[W], from the matcher's state) into the
jitted step, which masks the logits; the drawn token advances the matcher, and the request stops
("stop") once only eos could follow. No burst runs while a guided request is running, since its
mask depends on each drawn token (speculative rounds do: see below). Preemption keeps the output
tokens, so the matcher stays valid.

With a draft (`Engine(..., draft=...)`: a smaller model, "mtp", the model's own
multi-token-prediction heads, or "ngram" / `NGramDrafter`, prompt lookup;
`atlas_jax.decoding.drafters`), a step in which every running
request decodes and the batch is at most `speculative_max_batch` (`guided_speculative_max_batch`
with a guided row) is a speculative round instead: the drafter proposes
`num_speculative_tokens` tokens per row, the target scores them in one pass, and each row keeps
its accepted drafts and the token after them; blocks are reserved for all k + 1 positions and
those past the kept tokens are given back. The drafter follows every window the target computes
(prefill chunks and bursts too), into its own pool under the target's block tables, so it never
needs to catch up. Outputs follow the target's law exactly; greedy outputs equal plain greedy
decoding. Rows with penalties do not speculate. A batch with guided rows runs the round as two
programs: between them the host advances each guided row's matcher along its drafts, collecting
the mask at every position, and rolls it back; the target's distributions are masked there, so
a draft the grammar refuses is rejected and the token drawn in its place is allowed. The first
draft of a guided row is drawn under its current mask; later ones are not, so a guided row
accepts fewer drafts where the grammar departs from what the draft would write. Larger batches
burst instead: there the target's pass is no longer bound by reading its weights, and
speculation's extra draft and rejected-token work stops paying.

A request in its first `min_tokens` tokens has its eos and stop ids masked the same way (and no
burst or speculative round runs while one does); stop strings are looked for only after them. A
request with `prompt_logprobs` gets the log-probabilities of its prompt tokens, from one more pass
of the model over the whole prompt when its first token is drawn.

On a device mesh (`mesh=`, or `tensor_parallel_size` / `data_parallel_size` in the config):
weights are split by their logical axes over the tensor axis, the pools' pages over the data
axis (each replica with its own allocator and prefix cache, arrivals going to the least-loaded
one) and a KV pool's kv heads over the tensor axis; attention over the pools runs per shard. The
pool is sized from device memory unless `n_blocks` is given (`atlas_jax.serving.sizing`), and
the batch from the pool unless `max_num_seqs` is; the start-up log says what each came to.

`warmup()` compiles the step shapes a server meets (`warmup_shapes`, the runner's `shapes`: a step
per token bucket and block-table width, a burst and a speculative round per batch bucket and
width), so that requests do not pay for compilation, all at once or the first of each kind now
and the rest on a background thread (`first=`); it names the variants it leaves to first use.
Each finished request is logged on one line (logger
`atlas_jax.serving`, INFO): its id, prompt and output tokens, time to first token, total time and
finish reason.

Sampling keys are `fold_in(key(seed), i)` for the i-th generated token, as in `generate`, so
outputs do not depend on arrival order, batch composition, preemption, or the mesh.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from atlas_jax.cache.allocator import AllocatorStats, BlockAllocator
from atlas_jax.config import WARMUP_LEVELS, ConfigError, EngineConfig
from atlas_jax.decoding.drafters import NGramDrafter, make_drafter
from atlas_jax.decoding.sampling import SamplingParams, eos_ids
from atlas_jax.model.transformer import Transformer, windowed_layers, with_longrope_frequencies
from atlas_jax.serving import faults, sizing
from atlas_jax.serving import mesh as placement
from atlas_jax.serving.batch import Row, pow2
from atlas_jax.serving.faults import PoolLost
from atlas_jax.serving.lora import Adapter, AdapterError, ServedAdapters
from atlas_jax.serving.outputs import OutputProcessor, finished
from atlas_jax.serving.requests import Intake, Request, RequestError, RequestId, RequestOutput
from atlas_jax.serving.runner import Drawn, ModelRunner
from atlas_jax.serving.scheduler import BurstPlan, MixedPlan, RoundPlan, Scheduler, burst_capacity

log = logging.getLogger("atlas_jax.serving")
DEFAULT_SPECULATIVE_TOKENS = 4


def _gib(n: int) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{n / 2**20:.2f} MiB"


def _mesh_for(config: EngineConfig, mesh: Mesh | None) -> Mesh | None:
  """The serving mesh: the one given, or the config's data x context x tensor devices; None
  for one."""
  want = (
    config.data_parallel_size,
    config.tensor_parallel_size,
    config.prefill_context_parallel_size,
  )
  if mesh is not None:
    got = (*placement.mesh_sizes(mesh), placement.context_size(mesh))
    if want != (1, 1, 1) and want != got:
      raise ConfigError(
        f"serve.engine.data_parallel_size={want[0]}, tensor_parallel_size={want[1]}, "
        f"prefill_context_parallel_size={want[2]} is not allowed with "
        f"mesh={dict(mesh.shape)}: give one or make them agree"
      )
  elif want != (1, 1, 1):
    mesh = placement.serving_mesh(want[0], want[1], context=want[2])
  return None if mesh is None or mesh.size == 1 else mesh


class Engine:
  """Continuous batching over a paged KV cache, on one device or a (data, tensor) mesh.

  Not thread-safe by itself except for `abort`, which may be called from any thread; drive
  `add_request` and `step` from one thread (see `atlas_jax.serving.server`).

  Args:
    model: a Transformer (any family: its pool holds K/V, or MLA latents).
    config: pool and scheduling limits (`serve.engine`); fields left None are sized.
    eos_id: the model's end-of-sequence token, or a list of them (Llama-3-Instruct ends on two):
      stop tokens unless a request sets ignore_eos.
    detokenize: token ids -> text; enables stop strings and the `text` of outputs. A request with
      `skip_special_tokens=False` calls it with that keyword.
    draft: a smaller model with the same vocabulary, for speculative decoding; "mtp", the
      model's own multi-token-prediction heads; or "ngram" / a `drafters.NGramDrafter`, prompt
      lookup in each request's own tokens.
    mesh: a (data, tensor) device mesh (`atlas_jax.serving.mesh.serving_mesh`); default: the
      config's `data_parallel_size` x `tensor_parallel_size` devices.

  Raises:
    ConfigError (a ValueError) naming the field and value: heads the tensor size does not
    divide, more devices than exist, a context past the model's, a pool smaller than a context;
    ValueError for a draft that cannot draft for the model.
  """

  def __init__(
    self,
    model: Transformer,
    config: EngineConfig | None = None,
    *,
    eos_id: int | Sequence[int] | None = None,
    detokenize: Callable[[Sequence[int]], str] | None = None,
    draft: Transformer | str | NGramDrafter | None = None,
    mesh: Mesh | None = None,
    adapters: ServedAdapters | None = None,
  ):
    config = EngineConfig() if config is None else config
    cfg = model.cfg
    if adapters is not None:
      config = _lora_config(config, model, draft, mesh)
    max_model_len = config.max_model_len or cfg.max_seq_len
    # One LongRoPE frequency set for every call: a call batches many sequences (vLLM's rule).
    model, longrope = with_longrope_frequencies(model, max_model_len)
    if longrope is not None:
      log.info("LongRoPE: the %s frequencies (max_model_len %d)", longrope, max_model_len)
    k = config.num_speculative_tokens
    if k is None:
      mtp = draft == "mtp" and model.mtp is not None
      k = model.mtp.n_draft_heads if mtp else DEFAULT_SPECULATIVE_TOKENS
      if mtp:
        log.info("num_speculative_tokens %d: the model's MTP depth", k)
    drafter = None if draft is None else make_drafter(model, draft, k, max_len=max_model_len)
    if max_model_len > cfg.max_seq_len:
      raise ConfigError(
        f"serve.engine.max_model_len={max_model_len} is not allowed: the model's context is "
        f"{cfg.max_seq_len} tokens"
      )
    mesh = _mesh_for(config, mesh)
    dp, tp = (1, 1) if mesh is None else placement.mesh_sizes(mesh)
    runner_class = _runner_class(config)
    if runner_class is not ModelRunner:
      _check_cpu_mesh(config, mesh, dp, tp)
    placement.check_heads(cfg, tp)
    model = placement.repeat_kv_heads(model, tp)
    served_draft = None
    if isinstance(draft, Transformer):
      served_draft = draft
      if placement.heads_split(draft.cfg, tp):
        served_draft = placement.repeat_kv_heads(draft, tp, "the draft")
    self.model_config = model.cfg
    self.max_model_len = max_model_len
    self.eos_ids = frozenset(eos_ids(eos_id))
    self.detokenize = detokenize
    self.draft = draft
    self.mesh = mesh
    # M, the most block-table columns: the context, plus what a burst or a speculative round may
    # write past its end (draws after a request's last token, which are cut).
    Z = config.block_size
    ahead = max(burst_capacity(config), k + 1)
    max_blocks = -(-(max_model_len + ahead) // Z)
    specialised = {}
    if runner_class is not ModelRunner:
      specialised = dict(cpu=config.cpu, layout_rows=pow2(min(config.max_num_seqs or 32, 256)))
    self.runner = runner_class(
      model,
      draft=served_draft,
      drafter=drafter,
      mesh=mesh,
      block_size=Z,
      max_blocks=max_blocks,
      min_batch_bucket=config.min_batch_bucket,
      kv_cache_dtype=config.kv_cache_dtype,
      **specialised,
      **({} if adapters is None else dict(lora=True)),
    )
    self.adapters = adapters
    self._adapter_lock = threading.Lock()
    # This process's first device of the mesh: a mesh across hosts holds others' too.
    here = [] if mesh is None else mesh.local_devices
    device = here[0] if here else jax.devices()[0]
    self.pool_size = sizing.size_pool(
      config,
      block_bytes=self.runner.block_bytes(),
      weight_bytes=self.runner.weight_bytes,
      memory=sizing.device_memory(device),
      activations=lambda: self.runner.largest_step_bytes(config),
      max_model_len=max_model_len,
      platform=device.platform,
    )
    n_blocks, n_window_blocks = self.pool_size.n_blocks, None
    window, hybrid = window_bound(cfg, drafter), hybrid_window(cfg, drafter, config)
    window = window if hybrid is None else hybrid
    # A windowed request holds the blocks of its window, of the chunk or burst it computes next,
    # and a partial block on either side.
    ahead = max(config.prefill_chunk, burst_capacity(config))
    window_blocks = None if window is None else -(-(window - 1 + ahead) // Z) + 2
    if hybrid is not None:
      windowed = sum(windowed_layers(cfg))
      n_blocks, n_window_blocks = sizing.split_window_pool(
        n_blocks,
        n_layers=cfg.n_layers,
        n_windowed=windowed,
        request_blocks=window_blocks,
        max_num_seqs=config.max_num_seqs,
        block_size=Z,
        max_model_len=max_model_len,
      )
      log.info(
        "pool: %d of %d layers attend within a %d-token window: their blocks are a pool of "
        "their own, %d per replica, beside %d for the other layers",
        windowed,
        cfg.n_layers,
        window,
        n_window_blocks,
        n_blocks,
      )
    self.config = dataclasses.replace(
      sizing.resolve(config, n_blocks, max_model_len, k),
      data_parallel_size=dp,
      tensor_parallel_size=tp,
      prefill_context_parallel_size=placement.context_size(mesh),
    )
    self.runner.allocate(n_blocks, self.config, n_window_blocks)
    self.scheduler = Scheduler(
      self.config,
      dp,
      speculates=drafter is not None,
      window=window,
      n_window_blocks=n_window_blocks,
    )
    self.intake = Intake(
      cfg.vocab_size,
      max_model_len,
      n_blocks,
      Z,
      self.eos_ids,
      detokenize,
      window_blocks,
      n_window_blocks,
    )
    self.outputs = OutputProcessor(self._prompt_logprobs)
    self._inflight: Drawn | None = None  # a dispatched burst the host has not read yet
    self._aborts: list[RequestId] = []
    self._abort_lock = threading.Lock()
    self._inbox: list[list[Request]] = []  # `enqueue`d groups, added at the next step's start
    self._inbox_lock = threading.Lock()
    self._arrivals = 0
    self.n_steps = 0
    self.n_computed_tokens = 0  # tokens run through the model (prefill, recompute and decode)
    self.n_bursts = 0  # steps that ran a burst of decode iterations
    self.n_chained = 0  # bursts dispatched before the host read the previous one
    self.n_spec_rounds = 0  # steps that were speculative rounds
    self.n_spec_row_rounds = 0  # of those, summed over their rows (target passes per row)
    self.n_drafted = 0  # draft tokens proposed to the target
    self.n_accepted = 0  # of those, accepted
    self.n_spec_emitted = 0  # tokens emitted by speculative rounds (accepted + one per row round)
    self._log_start(seqs_given=config.max_num_seqs is not None)

  # -- the parts, as callers and tests reach them ------------------------------------------------

  @property
  def programs(self):
    return self.runner.programs

  @programs.setter
  def programs(self, value) -> None:
    self.runner.programs = value

  @property
  def pools(self):
    return self.runner.pools

  @property
  def allocators(self) -> list[BlockAllocator]:
    """One per data-parallel replica."""
    return self.scheduler.allocators

  @property
  def allocator(self) -> BlockAllocator:
    """The block allocator (one replica; with several, see `allocators` and `kv_stats`)."""
    if len(self.allocators) != 1:
      raise AttributeError(
        f"Engine.allocator: {len(self.allocators)} data-parallel replicas each have one: use "
        "Engine.allocators, or Engine.kv_stats() for their sum"
      )
    return self.allocators[0]

  @property
  def running(self) -> list[Request]:
    return self.scheduler.running

  @property
  def n_preemptions(self) -> int:
    return self.scheduler.n_preemptions

  @property
  def mean_acceptance_length(self) -> float:
    """Tokens a row emits per speculative round (accepted drafts + 1; cut at stops)."""
    return self.n_spec_emitted / max(self.n_spec_row_rounds, 1)

  @property
  def n_running(self) -> int:
    return len(self.scheduler.running)

  @property
  def n_waiting(self) -> int:
    """Requests not yet admitted: the scheduler's queue and the inbox (`enqueue`)."""
    with self._inbox_lock:
      inbox = sum(map(len, self._inbox))
    return self.scheduler.n_waiting + inbox

  def kv_stats(self) -> AllocatorStats:
    """Every replica's allocator statistics, summed."""
    return self.scheduler.stats()

  def kv_usage(self) -> float:
    """Fraction of the pools' blocks referenced by live requests."""
    return self.scheduler.usage()

  def has_unfinished(self) -> bool:
    return bool(
      self.scheduler.has_work() or self._aborts or self._inbox or self._inflight is not None
    )

  # -- start-up ----------------------------------------------------------------------------------

  def _log_start(self, *, seqs_given: bool) -> None:
    """The start-up lines: the mesh, weights and pool per device, the pool, the largest batch."""
    c, s, r = self.config, self.pool_size, self.runner
    tokens = c.n_blocks * c.block_size
    note = "" if seqs_given else " (what the pool holds at a typical length)"
    if c.preallocate:
      note = " (pre-allocated: each request reserves a whole context)"
    memory = ""
    if s.memory is not None:
      memory = (
        f" of {_gib(s.memory)} (in use before the pool {_gib(s.used)}, largest step's "
        f"activations {_gib(s.activations)})"
      )
    log.info(
      "mesh: %d data-parallel replica(s) x %d tensor-parallel device(s)%s; per device: weights "
      "%s, pool %s%s",
      r.n_replicas,
      r.tensor,
      ""
      if c.prefill_context_parallel_size == 1
      else f" x {c.prefill_context_parallel_size} splitting each step's tokens",
      _gib(r.weight_bytes),
      _gib(r.pool_bytes),
      memory,
    )
    log.info(
      "pool: %d blocks of %d tokens per replica (%d tokens, %d bytes a block per device; %s); "
      "largest batch %d sequences per replica%s",
      c.n_blocks,
      c.block_size,
      tokens,
      s.block_bytes,
      s.how,
      c.max_num_seqs,
      note,
    )

  def warmup_shapes(self, level: str | None = None) -> tuple[list, list[str]]:
    """(the step shapes `warmup` compiles at `level` (`runner.Shape`s), what it leaves to first
    use). Level (default: `config.warmup`): "none"; "default": every shape the runner's calls
    take (`ModelRunner.shapes`); "all": on the CPU runner also prefills over a context already in
    the pool (a prompt's chunks past `prefill_chunk`, a prompt after a cached prefix).

    Penalties, logit bias, guided masks, min_tokens, prompt logprobs and the block copies of
    n > 1 completions are left to first use at every level: each is one more variant of a shape.
    """
    level = self.config.warmup if level is None else level
    if level not in WARMUP_LEVELS:
      raise ConfigError(
        f"warmup level {level!r} is not allowed: must be one of {', '.join(WARMUP_LEVELS)}"
      )
    capacity = burst_capacity(self.config) if self.config.decode_burst >= 2 else 1
    return self.runner.shapes(self.config, level, capacity=capacity)

  def warmup(
    self,
    progress: Callable[[int, int, str], None] | None = None,
    level: str | None = None,
    threads: int | None = None,
    *,
    first: int | None = None,
  ):
    """Compiles (and runs once, on padding rows that write nothing) every shape of
    `warmup_shapes(level)`, so no request of those shapes waits for XLA.

    Args:
      progress: called as each shape's compile ends with (count, total, "step b=8 T=64 M=4").
      level: "none", "default" or "all" (default: `config.warmup`).
      threads: compiles at once (default: one per core on a CPU, else one).
      first: compile only this many before returning, the rest on a background thread
        (returned; `runner.wait_compiled` waits for it). None: all of them now.
    """
    shapes = self.warmup_shapes(level)[0]
    return self.runner.warmup(shapes, progress, threads, first=first)

  # -- requests ----------------------------------------------------------------------------------

  def _make(
    self, request_id: RequestId, prompt, params, stream: bool, adapter: str | None = None
  ) -> Request:
    if request_id in self.scheduler.requests:
      raise RequestError(f"request {request_id!r} already exists")
    if not isinstance(stream, bool):
      raise RequestError(f"stream={stream!r} is not allowed: must be true or false", "stream")
    slot, salt = self._adapter_of(adapter)
    req = self.intake.make(request_id, prompt, params, self._arrivals)
    req.stream, req.adapter, req.cache_salt = stream, slot, salt
    self._arrivals += 1
    return req

  def add_request(
    self,
    request_id: RequestId,
    prompt: Sequence[int],
    params: SamplingParams | None = None,
    *,
    stream: bool = False,
    adapter: str | None = None,
  ) -> None:
    """Queues a request.

    Args:
      stream: its client reads each token as it is drawn: while it runs, no decode burst runs
        (unless `stream_bursts`), so each step hands back its next token. The tokens are the
        same either way.
      adapter: the name of the loaded LoRA adapter it runs under (`load_adapter`); None: the
        base model.

    Raises:
      RequestError: empty prompt, token ids that are not integers in the vocabulary, prompt +
        max_new_tokens past the context, or more blocks than the whole pool holds; or a
        duplicate id.
    """
    self.scheduler.add(self._make(request_id, prompt, params, stream, adapter))

  def add_requests(
    self,
    request_ids: Sequence[RequestId],
    prompt: Sequence[int],
    params: Sequence[SamplingParams],
    *,
    stream: bool = False,
    adapter: str | None = None,
  ) -> None:
    """Queues n completions of one prompt that share its computation and its blocks.

    Each completion samples with its own params (seeds differ, say) and produces exactly what
    `add_request` would; the prompt is computed once and its blocks are shared copy-on-write.
    All or nothing: if any request is invalid, none is queued. `stream` and `adapter` as
    `add_request`'s.

    Raises:
      RequestError: as `add_request`, for any of them; or ids and params of different lengths.
    """
    self._check_group(request_ids, params, stream)
    reqs = [self._make(rid, prompt, p, stream, adapter) for rid, p in zip(request_ids, params)]
    self.scheduler.add_group(reqs)

  @staticmethod
  def _check_group(request_ids, params, stream) -> None:
    if len(request_ids) != len(params) or not request_ids:
      raise RequestError(
        f"add_requests: {len(request_ids)} request ids for {len(params)} SamplingParams"
      )
    if len(set(request_ids)) != len(request_ids):
      raise RequestError(f"add_requests: duplicate request ids in {list(request_ids)!r}")
    if not isinstance(stream, bool):
      raise RequestError(f"stream={stream!r} is not allowed: must be true or false", "stream")

  def enqueue(
    self,
    groups: Sequence[tuple[Sequence[RequestId], Sequence[int], Sequence[SamplingParams]]],
    *,
    stream: bool = False,
    adapter: str | None = None,
  ) -> None:
    """`add_requests` for each (request ids, prompt, params) group, from any thread: checked
    here, in the caller's thread, and added by the thread that steps at the start of its next
    step, so the caller never waits for a step in progress. All or nothing, as `add_requests`.

    Raises:
      RequestError: as `add_requests`, for any group (prefixed "prompt k: " when there are
        several); or an id already queued or running.
    """
    made = []
    self._adapter_of(adapter)  # an unknown name refused before any other check
    with self._inbox_lock:
      queued = {req.id for group in self._inbox for req in group}
    for k, (request_ids, prompt, params) in enumerate(groups):
      try:
        self._check_group(request_ids, params, stream)
        for rid in request_ids:
          if rid in queued or rid in self.scheduler.requests:
            raise RequestError(f"request {rid!r} already exists")
          queued.add(rid)
        # Its arrival index (the scheduler's order) is given when the stepping thread adds it.
        group = [self.intake.make(rid, prompt, p, -1) for rid, p in zip(request_ids, params)]
      except RequestError as e:
        if len(groups) > 1:
          raise RequestError(f"prompt {k}: {e}", e.field) from None
        raise
      for req in group:
        req.stream = stream
      made.append(group)
    with self._inbox_lock:
      # Resolved with the inbox held, as `unload_adapter` checks it: an adapter is either
      # still loaded and seen in use there, or refused here.
      slot, salt = self._adapter_of(adapter)
      for group in made:
        for req in group:
          req.adapter, req.cache_salt = slot, salt
      self._inbox += made

  def _take_inbox(self) -> None:
    with self._inbox_lock:
      groups, self._inbox = self._inbox, []
    for group in groups:
      for req in group:
        req.arrival = self._arrivals
        self._arrivals += 1
      self.scheduler.add_group(group)

  # -- LoRA adapters -----------------------------------------------------------------------------

  def _adapter_of(self, adapter: str | None) -> tuple[int, bytes]:
    """(its slot, its prefix-cache salt) for a request under adapter `adapter` (None: the base)."""
    if adapter is None:
      return 0, b""
    if self.adapters is None:
      raise RequestError(
        f"adapter={adapter!r} is not allowed: this engine serves no LoRA adapters", "model"
      )
    served = self.adapters.get(adapter)
    return served.slot, served.cache_salt

  def load_adapter(self, name: str, path) -> Adapter:
    """Loads the PEFT adapter folder `path` as `name` into a free slot (any thread): the held
    adapter arrays keep their shapes, so nothing compiles; the next step uses it.

    Raises:
      AdapterError: no adapters served, the name taken, no free slot, or a folder that cannot
        be served.
    """
    if self.adapters is None:
      raise AdapterError("this engine serves no LoRA adapters (--enable-lora)", "lora_name")
    with self._adapter_lock:  # one read-modify-write of the held state at a time
      state, adapter = self.adapters.load(self.runner.states[0], name, path)
      self.runner.states = (state, self.runner.states[1])  # one assignment: a step sees either
    return adapter

  def unload_adapter(self, name: str) -> None:
    """Frees adapter `name`'s slot (any thread).

    Raises:
      AdapterError: it is not loaded, or a request queued or running still uses it.
    """
    if self.adapters is None:
      raise AdapterError("this engine serves no LoRA adapters (--enable-lora)", "lora_name")
    with self._inbox_lock, self._adapter_lock:
      slot = self.adapters.slot_of(name)
      live = [req for group in self._inbox for req in group]
      live += list(self.scheduler.requests.copy().values())
      if any(req.adapter == slot for req in live):
        raise AdapterError(
          f"cannot unload {name!r}: requests using it are still running", "lora_name"
        )
      state = self.adapters.unload(self.runner.states[0], name)
      self.runner.states = (state, self.runner.states[1])

  def abort(self, request_id: RequestId) -> None:
    """Cancels a request (any thread); its blocks are freed at the start of the next step."""
    with self._abort_lock:
      self._aborts.append(request_id)

  def generate(
    self,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
  ) -> list[list[int]]:
    """Serves a list of prompts to completion; the new tokens of each, in order."""
    params = SamplingParams() if params is None else params
    per_row = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    ids = [("generate", self._arrivals, i) for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, per_row):
      self.add_request(rid, p, sp)
    got: dict[RequestId, list[int]] = {rid: [] for rid in ids}
    offline, self.offline = self.offline, True
    try:
      while any(rid in self.scheduler.requests for rid in ids):
        for out in self.step():
          if out.request_id in got:
            if out.error:
              raise RequestError(out.error)
            got[out.request_id].extend(out.new_token_ids)
    finally:
      self.offline = offline
    return [got[rid] for rid in ids]

  @property
  def offline(self) -> bool:
    """Whether every request this engine will serve has been added (`generate` sets it while
    it runs; a caller that adds all its requests before stepping may set it too, as serve.py's
    batch mode does): bursts then run `offline_burst` decode iterations, as no arrival can wait
    for one."""
    return self.scheduler.offline

  @offline.setter
  def offline(self, value: bool) -> None:
    self.scheduler.offline = bool(value)

  # -- the step ----------------------------------------------------------------------------------

  def step(self) -> list[RequestOutput]:
    """Runs the scheduler's next plan (a mixed step, a burst of decode steps, or a speculative
    round); returns what changed.

    A request whose rows make the model step raise fails alone (finish_reason "error"); the
    others continue with unchanged outputs (`atlas_jax.serving.faults`).
    """
    outputs = self._step()
    finished_now = self.scheduler.finished
    if finished_now:
      reasons = {o.request_id: o.finish_reason for o in outputs if o.finished}
      for req in finished_now:
        _log_finished(req, reasons.get(req.id))
      self.scheduler.finished = []
    return outputs

  def _step(self) -> list[RequestOutput]:
    self._take_inbox()  # first: an abort of an enqueued request finds it
    outputs = self._process_aborts()
    try:
      if self._inflight is not None:
        # The host settles the burst in flight while the next one (if any) runs on the device.
        burst = self._inflight
        self._inflight = self._chain(burst)
        return outputs + self._collect(burst)
      plan = self.scheduler.next_plan()
      if isinstance(plan, RoundPlan):
        got = self._speculate(plan)
        if got is not None:
          return outputs + got
      elif isinstance(plan, BurstPlan):
        self._inflight = self._dispatch(plan)
        if self._inflight is not None:
          return outputs  # its tokens are read by the next step, while the next burst runs
    except PoolLost as lost:
      return outputs + self._recover(lost)
    return outputs + self._mixed(self.scheduler.schedule())

  def _mixed(self, plan: MixedPlan) -> list[RequestOutput]:
    if not plan.rows:
      return []
    self.n_steps += 1
    self.n_computed_tokens += sum(row.n for row in plan.rows)
    self.runner.copy(self.scheduler.take_copies(plan.copies))
    try:
      results, failed = faults.run_isolated(self.runner.execute, plan.rows, self.runner)
    except PoolLost as lost:
      return self._recover(lost)
    outputs = []
    rows = plan.rows
    if failed:
      outputs += faults.fail_rows(self.scheduler, rows, failed, self._finish)
      running = set(map(id, self.scheduler.running))
      rows = [row for row in rows if id(row.req) in running]  # not failed or preempted
    return outputs + self.scheduler.update_from_output(rows, results, self._accept)

  def _dispatch(self, plan: BurstPlan, chained: Drawn | None = None) -> Drawn | None:
    """Dispatches a burst; None when it raised without taking the pools (a mixed step then
    finds the failing rows)."""
    self.runner.copy(self.scheduler.take_copies(plan.copies))
    self.n_steps += 1
    self.n_bursts += 1
    self.n_computed_tokens += plan.n_steps * len(plan.rows)
    try:
      capacity = burst_capacity(self.config)
      return self.runner.burst(plan.rows, plan.n_steps, capacity, chained=chained)
    except Exception as e:
      lost = chained.rows if chained is not None else plan.rows
      if self.runner.pool_lost():
        raise PoolLost([row.req for row in lost], e) from e
      if chained is None:
        self.scheduler.truncate(plan.rows)
      return None  # a chained burst's rows: `_collect` gives back what they reserved

  def _chain(self, prev: Drawn) -> Drawn | None:
    """The next burst, fed by `prev`'s last draws on the device before the host reads them."""
    plan = self.scheduler.chain(prev.rows, prev.n_steps)
    if plan is None:
      return None
    burst = self._dispatch(plan, chained=prev)
    if burst is not None:
      self.n_chained += 1
    return burst

  def _speculate(self, plan: RoundPlan) -> list[RequestOutput] | None:
    """One speculative round over every running request, settled at once; None when the round
    raised without taking the pools (a mixed step then runs and finds the failing rows)."""
    k = self.config.num_speculative_tokens
    rows = plan.rows
    self.runner.copy(self.scheduler.take_copies(plan.copies))
    self.n_steps += 1
    self.n_computed_tokens += (k + 1) * len(rows)
    try:
      drawn = self.runner.speculate(rows, k)
    except Exception as e:
      if self.runner.pool_lost():
        raise PoolLost([row.req for row in rows], e) from e
      self.scheduler.truncate(rows)
      return None
    self.n_spec_rounds += 1
    self.n_spec_row_rounds += len(rows)
    self.n_drafted += k * len(rows)
    self.n_accepted += int((drawn.n_draws - 1).sum())
    outputs = self._collect(drawn)
    self.n_spec_emitted += sum(len(out.new_token_ids) for out in outputs)
    return outputs

  def _collect(self, drawn: Drawn) -> list[RequestOutput]:
    """Reads a burst's or round's draws, cuts each row at its first stop, and settles the
    blocks."""
    try:
      tok, lp, top_ids, top_lp = map(
        np.asarray, (drawn.tok_IB, drawn.lp_IB, drawn.top_ids_IBk, drawn.top_lp_IBk)
      )
    except Exception as e:  # the burst failed on the device, which had taken the pool
      self._inflight = None  # a chained burst read this one's draws: it failed too
      raise PoolLost([row.req for row in drawn.rows], e) from e
    chained = set() if self._inflight is None else {id(r.req) for r in self._inflight.rows}
    draws = {}
    for i, (row, b) in enumerate(zip(drawn.rows, drawn.slot)):
      n = drawn.n_steps if drawn.n_draws is None else int(drawn.n_draws[i])
      draws[row.req.id] = (tok[:n, b], lp[:n, b], top_ids[:n, b], top_lp[:n, b])
    return self.scheduler.update_from_draws(drawn.rows, draws, self._accept, chained=chained)

  def _recover(self, lost: PoolLost) -> list[RequestOutput]:
    self._inflight = None
    return faults.recover(self.scheduler, self.runner, lost, self._finish)

  def _process_aborts(self) -> list[RequestOutput]:
    with self._abort_lock:
      aborts, self._aborts = self._aborts, []
    outputs = []
    for rid in aborts:
      req = self.scheduler.requests.get(rid)
      if req is not None:
        outputs.append(self._finish(req, "abort"))
    return outputs

  def _finish(self, req: Request, reason: str, error: str | None = None) -> RequestOutput:
    self.scheduler.release(req)
    return finished(req, reason, error)

  def _accept(self, req: Request, draws) -> tuple[RequestOutput, int]:
    """The output processor on a request's draws (tokens, logprobs, top ids, top logprobs):
    (its output, the draws kept); a request whose output fails (its detokenizer, say) ends
    alone with finish reason "error", nothing kept."""
    try:
      return self.outputs.accept(req, *draws)
    except Exception as e:  # e.g. the detokenizer: this request's fault only
      return self._finish(req, "error", f"{type(e).__name__}: {e}"), 0

  def _prompt_logprobs(self, req: Request):
    """(per prompt token its logprob, per prompt token its top `prompt_logprobs` pairs), None
    for the first token, from one pass of the model over the whole prompt."""
    n = len(req.prompt)
    lp, top_ids, top_lp = self.runner.prompt_logprobs(
      req.prompt, self.max_model_len, **(dict(adapter=req.adapter) if req.adapter else {})
    )
    k = req.params.prompt_logprobs
    lps: list[float | None] = [None] + [float(lp[t]) for t in range(n - 1)]
    tops: list[list[tuple[int, float]] | None] = [None] + [
      [(int(i), float(v)) for i, v in zip(top_ids[t, :k], top_lp[t, :k])] for t in range(n - 1)
    ]
    return lps, tops


def _lora_config(config: EngineConfig, model, draft, mesh: Mesh | None) -> EngineConfig:
  """The config an engine serving LoRA adapters runs: no drafter, no repeated kv heads. The
  prefix cache stays on: a block's keys and values depend on the adapter, so each request's
  block hashes start from its adapter's identity (`Request.cache_salt`)."""
  if draft is not None:
    raise ConfigError("--enable-lora is not allowed with speculative decoding (a draft)")
  _, tp = (1, 1) if mesh is None else placement.mesh_sizes(mesh)
  tp = max(tp, config.tensor_parallel_size or 1)
  if model.cfg.n_kv_heads < tp:
    raise ConfigError(
      f"serve.engine.tensor_parallel_size={tp} is not allowed with LoRA adapters: the model's "
      f"{model.cfg.n_kv_heads} kv heads would be repeated, and their adapters are not"
    )
  return config


def _runner_class(config: EngineConfig) -> type[ModelRunner]:
  """The runner `config.runner` names: "auto" is the CPU runner on a CPU backend."""
  on_cpu = jax.default_backend() == "cpu"
  if config.runner == "cpu" and not on_cpu:
    raise ConfigError(
      f"serve.engine.runner='cpu' is not allowed on a {jax.default_backend()} backend: the CPU "
      "runner specialises XLA's CPU backend; use 'auto' or 'ragged'"
    )
  if config.runner == "cpu" or (config.runner == "auto" and on_cpu):
    from atlas_jax.serving.cpu import CPUModelRunner

    return CPUModelRunner
  return ModelRunner


def _check_cpu_mesh(config: EngineConfig, mesh: Mesh | None, dp: int, tp: int) -> None:
  if mesh is None:
    return
  if config.cpu.weight_layout in ("out_major", "stacked"):
    raise ConfigError(
      f"serve.engine.cpu.weight_layout={config.cpu.weight_layout!r} is not allowed on a mesh of "
      f"{dp} x {tp} devices: a mesh holds its layers one array each, in-major; use 'auto' or "
      "'in_major'"
    )
  if config.cpu.matmul == "xla":
    raise ConfigError(
      f"serve.engine.cpu.matmul='xla' is not allowed on a mesh of {dp} x {tp} devices: XLA's "
      "own dots are chosen for one device; use 'auto' or 'ynnpack'"
    )


def _log_finished(req: Request, reason: str | None) -> None:
  now = time.perf_counter()
  ttft = "-" if req.t_first is None else f"{req.t_first - req.t_arrival:.3f} s"
  log.info(
    "request %s: %s, %d prompt + %d output tokens, first token %s, total %.3f s",
    req.id,
    reason,
    len(req.prompt),
    len(req.output),
    ttft,
    now - req.t_arrival,
  )


__all__ = ["Engine", "EngineConfig", "RequestError", "RequestOutput", "Row"]


def hybrid_window(cfg, drafter, config) -> int | None:
  """W (the largest window or chunk, `AttentionKind.reach`) when the model mixes sliding-window
  or chunked layers with full-attention ones and the bounded layers' blocks can live in a pool
  of their own (`HybridPool`): a KV pool, no drafter (it reads the whole history through the
  same tables), no pre-allocation (whose reservations are whole contexts), and not
  `disable_hybrid_kv_cache_manager`; else None."""
  windows = [kind.reach for kind in cfg.attention_kinds()[0]]
  windowed = sum(windowed_layers(cfg))
  off = config.preallocate or config.disable_hybrid_kv_cache_manager
  if drafter is not None or off or not 0 < windowed < cfg.n_layers:
    return None
  return max(w for w in windows if w is not None)


def window_bound(cfg, drafter) -> int | None:
  """W when every layer of the model attends within a sliding window or its chunk (the largest
  `AttentionKind.reach`, when they differ): a request's blocks before its last W positions are
  then never read again and go back to the pool. None when some layer attends to everything,
  or a drafter reads the whole history through the same block tables (a draft model's cache,
  the n-gram drafter's token pool)."""
  windows = [kind.reach for kind in cfg.attention_kinds()[0]]
  if drafter is not None or any(w is None for w in windows):
    return None
  return max(windows)
