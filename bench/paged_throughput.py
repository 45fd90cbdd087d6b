"""PagedAttention's throughput claim through the real engine: the same requests, the same pool
bytes, served paged and with naive pre-allocation (`serve.engine.preallocate`: every request
reserves a whole context up front, as the servers before vLLM did).

    python bench/paged_throughput.py [--requests 96] [--max-model-len 512] [--contexts 4]

The workload is ShareGPT-like (`bench/kv_sim.py`'s log-normal prompt and output lengths, means
~160 and ~340 tokens at a 2048-token context), scaled to the model's context, once as is and once
behind a shared system prompt (an eighth of the context). The pool holds `--contexts` full
contexts: pre-allocation seats exactly that many requests; the paged engine admits what the
blocks hold (its own `max_num_seqs` cap aside) and preempts when they run out. Each
configuration serves a warm-up pass of other random prompts first (compilation), then the timed
pass; the configurations are interleaved and repeated, and the best pass of each is reported.
Deterministic (the schedule, whatever the clock): engine steps, sequences running per step,
preemptions. Timed: output tokens/s, requests/s, sequences running (time-weighted). The ratio
paged / pre-allocated is set against the paper's 2-4x.

The model is a small random Llama (float32, CPU by default): the point is how many sequences a
pool serves at once, not the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time

import jax
import numpy as np
from flax import nnx
from kv_sim import make_workload  # bench/kv_sim.py

import atlas_jax
from atlas_jax.config import EngineConfig, ModelConfig
from atlas_jax.decoding.sampling import SamplingParams
from atlas_jax.model import build

REFERENCE_CONTEXT = 2048  # the context kv_sim's lengths are drawn for


@dataclasses.dataclass
class Pass:
  seconds: float
  output_tokens: int
  requests: int
  mean_running: float  # time-weighted
  preemptions: int
  steps: int  # engine steps (a burst counts once)
  mean_running_per_step: float  # deterministic: the schedule, not the clock

  @property
  def tokens_per_s(self) -> float:
    return self.output_tokens / self.seconds

  @property
  def requests_per_s(self) -> float:
    return self.requests / self.seconds


def workload(n: int, max_len: int, vocab: int, *, shared: bool, seed: int):
  """(prompts, per-request params): kv_sim's lengths scaled from 2048 tokens to `max_len`."""
  scale = max_len / REFERENCE_CONTEXT
  system_len = REFERENCE_CONTEXT // 8 if shared else 0
  reqs = make_workload(n=n, max_len=REFERENCE_CONTEXT, system_prompt_len=system_len, seed=seed)
  rng = np.random.default_rng(seed)
  system = rng.integers(0, vocab, int(system_len * scale)).tolist()
  prompts, params = [], []
  for r in reqs:
    own = max(1, round((len(r.prompt) - system_len) * scale))
    prompts.append(system + rng.integers(0, vocab, own).tolist())
    new = max(1, min(round(len(r.output) * scale), max_len - len(prompts[-1])))
    params.append(SamplingParams(max_new_tokens=new, ignore_eos=True))
  return prompts, params


def serve(engine, prompts, params, tag: str) -> Pass:
  """Serves every request at once (an offline batch), timing the whole pass."""
  for i, (p, sp) in enumerate(zip(prompts, params)):
    engine.add_request((tag, i), p, sp)
  preempted, steps0 = engine.n_preemptions, engine.n_steps
  out_tokens, weighted, running_sum, n = 0, 0.0, 0, 0
  start = last = time.perf_counter()
  while engine.has_unfinished():
    for out in engine.step():
      out_tokens += len(out.new_token_ids)
    now = time.perf_counter()
    running = engine.n_running  # what the step just run held, less those it finished
    weighted += running * (now - last)
    running_sum, n, last = running_sum + running, n + 1, now
  seconds = time.perf_counter() - start
  return Pass(
    seconds,
    out_tokens,
    len(prompts),
    weighted / seconds,
    engine.n_preemptions - preempted,
    engine.n_steps - steps0,
    running_sum / max(n, 1),
  )


def main(argv=None) -> None:
  from atlas_jax.serving.engine import Engine

  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--requests", type=int, default=96)
  p.add_argument("--max-model-len", type=int, default=512)
  p.add_argument("--contexts", type=int, default=4, help="full contexts the pool holds")
  p.add_argument("--block-size", type=int, default=16)
  p.add_argument("--max-num-seqs", type=int, default=64, help="the paged engine's batch cap")
  p.add_argument("--repeat", type=int, default=2)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  args = p.parse_args(argv)

  L, Z = args.max_model_len, args.block_size
  cfg = ModelConfig(
    vocab_size=1024,
    d_model=args.d_model,
    n_layers=args.layers,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=4 * args.d_model,
    max_seq_len=L,
  )
  model = build(cfg, rngs=nnx.Rngs(0))
  n_blocks = args.contexts * -(-L // Z)
  base = EngineConfig(
    n_blocks=n_blocks,
    block_size=Z,
    max_model_len=L,
    max_num_seqs=args.max_num_seqs,
    max_num_batched_tokens=512,
    prefill_chunk=256,
  )
  configs = {
    "paged": base,
    "pre-allocated": dataclasses.replace(base, preallocate=True),
  }
  print(
    f"# {time.strftime('%Y-%m-%d')} {platform.machine()}, {os.cpu_count()} cores, load "
    f"{os.getloadavg()[0]:.2f}; jax {jax.__version__} ({jax.default_backend()}), atlas_jax "
    f"{atlas_jax.__version__}; model d={cfg.d_model} L={cfg.n_layers} V={cfg.vocab_size} "
    f"float32; pool {n_blocks} blocks of {Z} = {args.contexts} contexts of {L} tokens"
  )
  for shared in (False, True):
    prompts, params = workload(args.requests, L, cfg.vocab_size, shared=shared, seed=1)
    warm_prompts, warm_params = workload(args.requests, L, cfg.vocab_size, shared=shared, seed=2)
    engines = {name: Engine(model, c) for name, c in configs.items()}
    best: dict[str, Pass] = {}
    for engine in engines.values():
      serve(engine, warm_prompts, warm_params, "warm")
    for rep in range(args.repeat):
      for name, engine in engines.items():  # interleaved
        got = serve(engine, prompts, params, f"pass{rep}")
        if name not in best or got.seconds < best[name].seconds:
          best[name] = got
    plen = np.mean([len(q) for q in prompts])
    olen = np.mean([sp.max_new_tokens for sp in params])
    what = "behind a shared system prompt" if shared else "no shared prefix"
    print(
      f"\n## {args.requests} requests, prompt mean {plen:.0f}, output mean {olen:.0f} tokens, "
      f"{what}; best of {args.repeat} (load {os.getloadavg()[0]:.2f})"
    )
    print(
      "| engine | seats | engine steps | running per step | preemptions | output tok/s | "
      "requests/s | running (time-weighted) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in best.items():
      seats = engines[name].config.max_num_seqs
      print(
        f"| {name} | {seats} | {r.steps} | {r.mean_running_per_step:.1f} | {r.preemptions} | "
        f"{r.tokens_per_s:,.0f} | {r.requests_per_s:.2f} | {r.mean_running:.1f} |"
      )
    paged, pre = best["paged"], best["pre-allocated"]
    print(
      f"paged / pre-allocated: {paged.tokens_per_s / pre.tokens_per_s:.2f}x output tokens/s, "
      f"{pre.steps / paged.steps:.2f}x fewer engine steps, "
      f"{paged.mean_running_per_step / pre.mean_running_per_step:.2f}x the sequences per step "
      "(the PagedAttention paper: 2-4x throughput)"
    )


if __name__ == "__main__":
  main()
