"""A serving workload replayed through two KV cache policies, on one fixed budget of token slots.

* prealloc: every running sequence reserves `max_len` slots up front, so the budget holds
  budget // max_len sequences whatever their real lengths;
* paged: sequences grow a block at a time through `atlas_jax.cache.allocator.BlockAllocator`
  (prefix caching on or off); admission needs the prompt's blocks plus a small watermark, and when
  a decode step runs out of blocks the newest sequence is preempted and later recomputed.

Lengths are ShareGPT-like (log-normal prompts of mean ~160 tokens, outputs of mean ~340, truncated
to the context); `system_prompt_len` prepends one shared prompt to every request. Metrics are
averaged over decode steps while requests wait (the budget is the bottleneck). Pure host-side
bookkeeping: `bench/kv_memory.py` prints the comparison, `notebooks/03_paged_kv_cache.ipynb`
plots it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

import numpy as np

from atlas_jax.cache.allocator import BlockAllocator, OutOfBlocksError
from atlas_jax.plan.kv import prefix_hit_rate, utilisation

VOCAB = 32000


@dataclasses.dataclass
class Request:
  rid: int
  prompt: list[int]
  output: list[int]  # the tokens it will generate, fixed up front so a replay is deterministic


@dataclasses.dataclass
class Result:
  utilisation: float
  concurrency: float
  steps: int
  hit_rate: float | None
  preemptions: int


def lognormal_lengths(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
  # A log-normal's mean is exp(mu + sigma^2 / 2); solve for mu so the sample mean is `mean`.
  mu = math.log(mean) - sigma**2 / 2
  return np.maximum(1, np.round(rng.lognormal(mu, sigma, n))).astype(int)


def make_workload(*, n: int, max_len: int, system_prompt_len: int, seed: int) -> list[Request]:
  rng = np.random.default_rng(seed)
  prompt_lens = lognormal_lengths(rng, 160.0, 1.0, n)
  output_lens = lognormal_lengths(rng, 340.0, 0.9, n)
  system = rng.integers(0, VOCAB, system_prompt_len).tolist()
  requests = []
  for rid in range(n):
    prompt_len = min(int(prompt_lens[rid]), max_len // 2 - system_prompt_len)
    output_len = min(int(output_lens[rid]), max_len - system_prompt_len - prompt_len)
    prompt = system + rng.integers(0, VOCAB, prompt_len).tolist()
    requests.append(Request(rid, prompt, rng.integers(0, VOCAB, output_len).tolist()))
  return requests


def _averages(waits: list[bool], utils: list[float], concs: list[int]) -> tuple[float, float]:
  """Mean utilisation and concurrency over the steps where requests waited (the budget was the
  bottleneck), or over every step when the budget held everything at once."""
  steps = [i for i, waiting in enumerate(waits) if waiting] or range(len(waits))
  return (
    float(np.mean([utils[i] for i in steps])),
    float(np.mean([concs[i] for i in steps])),
  )


def run_prealloc(
  requests: list[Request], *, budget_tokens: int, max_len: int, trace: list | None = None
) -> Result:
  """Each running sequence holds max_len slots; admission is a fixed number of seats.

  `trace`, if given, receives (utilisation, running sequences) for every decode step.
  """
  seats = budget_tokens // max_len
  queue = deque(requests)
  running: list[list[int]] = []  # [current length, tokens left to generate]
  waits, utils, concs = [], [], []  # per decode step
  steps = 0
  while queue or running:
    while queue and len(running) < seats:
      req = queue.popleft()
      running.append([len(req.prompt), len(req.output)])
    util = sum(r[0] for r in running) / (len(running) * max_len)
    if trace is not None:
      trace.append((util, len(running)))
    waits.append(bool(queue))
    utils.append(util)
    concs.append(len(running))
    for r in running:
      r[0] += 1
      r[1] -= 1
    running = [r for r in running if r[1] > 0]
    steps += 1
  return Result(*_averages(waits, utils, concs), steps, None, 0)


def run_paged(
  requests: list[Request],
  *,
  budget_tokens: int,
  block_size: int,
  prefix_caching: bool = True,
  trace: list | None = None,
) -> Result:
  """Continuous batching over a `BlockAllocator` holding budget_tokens slots.

  `trace`, if given, receives (utilisation, running sequences) for every decode step.
  """
  n_blocks = budget_tokens // block_size
  alloc = BlockAllocator(n_blocks, block_size, enable_prefix_caching=prefix_caching)
  watermark = max(1, n_blocks // 100)  # headroom so new admissions do not preempt at once
  queue = deque((req, 0) for req in requests)  # (request, tokens already generated)
  running: list[tuple[Request, int]] = []
  waits, utils, concs = [], [], []  # per decode step
  steps = preemptions = 0
  while queue or running:
    while queue:
      req, done = queue[0]
      tokens = req.prompt + req.output[:done]
      if alloc.n_available < -(-(len(tokens) + 1) // block_size) + watermark:
        break
      queue.popleft()
      alloc.add_sequence(req.rid, tokens)
      running.append((req, done))
    util = utilisation(alloc.stats())
    if trace is not None:
      trace.append((util, len(running)))
    waits.append(bool(queue))
    utils.append(util)
    concs.append(len(running))
    still_running = []
    for req, done in running:
      if req.rid not in alloc:  # preempted earlier in this step
        continue
      while True:
        try:
          alloc.append(req.rid, [req.output[done]])
          break
        except OutOfBlocksError:
          # Recompute-style preemption: free the newest running sequence (not yet stepped,
          # or this one) and requeue it at the front; its full blocks stay in the prefix cache.
          victim, victim_done = next((r, d) for r, d in reversed(running) if r.rid in alloc)
          alloc.free(victim.rid)
          queue.appendleft((victim, victim_done))
          preemptions += 1
          if victim is req:
            break
      if req.rid not in alloc:
        continue
      done += 1
      if done == len(req.output):
        alloc.free(req.rid)
      else:
        still_running.append((req, done))
    running = still_running
    steps += 1
  return Result(*_averages(waits, utils, concs), steps, prefix_hit_rate(alloc.stats()), preemptions)
