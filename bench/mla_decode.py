"""MLA decode: achieved memory bandwidth of the Pallas kernel against the XLA reference.

One decode step of DeepSeek-V3-shaped MLA attention (N=128 heads, C=512, R=64, bf16) over a
latent cache of B sequences of S tokens. Decoding is memory bound: the step must read the cache,
B * S * (C + R) * 2 bytes, once, so achieved bandwidth = those bytes / step time (the queries and
outputs are < 1% of it). Prints both implementations side by side and their ratio, plus the KV
bytes per token of MLA against MHA/GQA configs (`atlas_jax.plan.kv.kv_report`).

    python bench/mla_decode.py [--batch 32] [--seq 4096] [--heads 128] [--iters 20]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from timing import seconds_per_call

from atlas_jax.kernels.mla_decode import mla_decode
from atlas_jax.plan.kv import format_kv_report, kv_report
from atlas_jax.plan.models import REFERENCE_MODELS

C, R = 512, 64


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--heads", type=int, default=128)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--block-q", type=int, default=64)
  parser.add_argument("--block-k", type=int, default=64)
  parser.add_argument("--splits", type=int, default=None, help="KV splits (default: heuristic)")
  args = parser.parse_args()
  B, S, N = args.batch, args.seq, args.heads
  dtype = jnp.bfloat16
  k = jax.random.split(jax.random.key(0), 3)
  q_nope = jax.random.normal(k[0], (B, N, C), dtype)
  q_rope = jax.random.normal(k[1], (B, N, R), dtype)
  cache = jax.random.normal(k[2], (B, S, C + R), dtype)
  lengths = jnp.full((B,), S, jnp.int32)
  scale = (128 + R) ** -0.5
  interpret = jax.default_backend() == "cpu"
  cache_bytes = B * S * (C + R) * 2

  print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind}")
  print(f"B={B} S={S} N={N} C={C} R={R} bf16; cache {cache_bytes / 2**20:.1f} MiB per layer")
  results = {}
  for impl in ("xla", "pallas"):
    fn = jax.jit(
      lambda qn, qr, c, n, impl=impl: mla_decode(
        qn,
        qr,
        c,
        n,
        scale=scale,
        implementation=impl,
        interpret=interpret,
        block_q=args.block_q,
        block_k=args.block_k,
        num_splits=args.splits,
      )
    )
    seconds = seconds_per_call(fn, q_nope, q_rope, cache, lengths, iters=args.iters)
    results[impl] = seconds
    print(f"{impl:7s} {seconds * 1e6:10.1f} us/step  {cache_bytes / seconds / 1e9:8.1f} GB/s")
  print(f"pallas / xla speed: {results['xla'] / results['pallas']:.2f}x")

  print()
  labels = {
    "DeepSeek-V3 (61 L, 128 heads)": "deepseek-v3",
    "DeepSeek-V2 (60 L, 128 heads)": "deepseek-v2",
    "DeepSeek-V2-Lite (27 L, 16 heads)": "deepseek-v2-lite",
    "Llama-2-7B (MHA)": "llama-2-7b",
    "Llama-3-8B (GQA 8)": "llama-3-8b",
    "Llama-3-70B (GQA 8)": "llama-3-70b",
  }
  models = {label: REFERENCE_MODELS[name].model for label, name in labels.items()}
  print(format_kv_report(kv_report(models)))


if __name__ == "__main__":
  main()
