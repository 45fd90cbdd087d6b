"""Serving throughput and latency: our engine vs Hugging Face transformers, and KV cache vs none.

Three measurements in one run, on one randomly initialised model (the tiny preset's shape by
default) exported with `atlas_jax.hf.save` so both stacks use the same weights:

1. online: requests arrive as a Poisson process with ShareGPT-like lengths (log-normal prompts
   and outputs, scaled to the context); the engine serves them with continuous batching. Reports
   request throughput, output tokens/s, TTFT and inter-token latency percentiles.
2. offline, side by side: the same prompts through our engine (all queued at once) and through
   transformers `generate` (PyTorch CPU, static batches of `--batch`, greedy, the same output
   lengths); output tokens/s of each and the ratio.
3. decode cost per token at context n: the KV-cached decode step vs recomputing the whole prefix
   each step (O(n) vs O(n^2) work per sequence), as a table over n.

    python bench/serve.py [--requests 64] [--rate 8] [--batch 8] [--config configs/tiny.yaml]
"""

from __future__ import annotations

import argparse
import functools
import platform
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import atlas_jax
from atlas_jax import hf
from atlas_jax.config import load_config
from atlas_jax.decoding.sampling import SamplingParams
from atlas_jax.model.transformer import Transformer
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
    tokens = jnp.zeros((1, n), jnp.int32)
    recompute(state, tokens).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(5):
      out = recompute(state, tokens)
    out.block_until_ready()
    rows.append((n, t_cached * 1e3, (time.perf_counter() - t0) / 5 * 1e3))
  return rows


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--config", default="configs/tiny.yaml")
  p.add_argument("--requests", type=int, default=64)
  p.add_argument("--rate", type=float, default=8.0, help="mean arrivals per second")
  p.add_argument("--batch", type=int, default=8, help="running requests / HF static batch")
  p.add_argument("--max-len", type=int, default=256, help="context the lengths are scaled to")
  p.add_argument("--threads", type=int, default=2, help="PyTorch CPU threads")
  p.add_argument("--skip-hf", action="store_true")
  args = p.parse_args(argv)

  cfg = load_config(args.config).model
  model = Transformer(cfg, rngs=nnx.Rngs(0))
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
    f"# {time.strftime('%Y-%m-%d')} {platform.processor() or platform.machine()}, "
    f"jax {jax.__version__} ({jax.default_backend()}), atlas_jax {atlas_jax.__version__}"
  )
  print(
    f"# model d={cfg.d_model} L={cfg.n_layers} N={cfg.n_heads} K={cfg.n_kv_heads} "
    f"V={cfg.vocab_size}; {args.requests} requests, prompt mean {plen.mean():.0f}, "
    f"output mean {olen.mean():.0f}, batch {args.batch}"
  )

  # A full warm-up pass compiles every bucketed shape, so no measurement pays for compilation.
  run_offline_ours(Engine(model, engine_cfg), prompts, olen)
  ours = run_offline_ours(Engine(model, engine_cfg), prompts, olen)
  online = run_online(Engine(model, engine_cfg), prompts, olen, args.rate, rng)
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
