"""Quantized weights on a decode step: the bytes it reads and CPU decode tokens/s, per format.

One random Llama-style model (`--d-model`, `--layers`; GQA, SwiGLU) is served five ways: float32
and bf16 weights, and the float32 model with its projections quantized by `atlas_jax.quant`
(int8 per channel, int4 per channel and group of `--group-size` inputs, fp8 e4m3 per channel;
activations float32). For each, one decode step (a token per sequence against a contiguous KV
cache of `--context` slots) is compiled, and the table gives:

  weights     the step's weight arguments, read off the compiled program (XLA's argument bytes
              less the cache's and the tokens'): deterministic, the bytes a memory-bound decode
              step must read; embeddings, norms and the LM head stay in the model's dtype
  projections the part of them the formats quantize (values and scales)
  vs f32      each over float32's
  tok/s       decode tokens per second on this machine's CPU over `--steps` steps at batch
              `--batch` (greedy, the cache filling from `--prompt` tokens)

    python bench/quant.py [--d-model 512] [--layers 4] [--batch 1] [--steps 32]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax import quant
from atlas_jax.config import ModelConfig
from atlas_jax.model import build

FORMATS = ("float32", "bfloat16", "int8", "int4", "fp8")


def model_of(args, fmt: str):
  dtype = "bfloat16" if fmt == "bfloat16" else "float32"
  cfg = ModelConfig(
    vocab_size=args.vocab,
    d_model=args.d_model,
    n_layers=args.layers,
    n_heads=args.d_model // 64,
    n_kv_heads=max(1, args.d_model // 256),
    ffn_dim=args.d_model * 8 // 3 // 128 * 128,  # a multiple of int4's default group
    max_seq_len=args.context,
    dtype=dtype,
    param_dtype=dtype,
  )
  model = build(cfg, rngs=nnx.Rngs(0))
  if fmt in quant.FORMATS:
    quant.quantize_model(model, fmt, group_size=args.group_size)
  return model


def measure(args, fmt: str) -> dict:
  model = model_of(args, fmt)
  graphdef, state = nnx.split(model)

  @jax.jit
  def step(state, cache, tokens_B1):
    logits, cache = nnx.merge(graphdef, state)(tokens_B1, cache=cache)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], cache

  cache = model.init_cache(args.batch, args.context)
  tokens = jnp.zeros((args.batch, args.prompt), jnp.int32)
  compiled = step.lower(state, cache, tokens[:, :1]).compile()
  other = sum(x.nbytes for x in jax.tree.leaves(cache)) + args.batch * 4
  weights = compiled.memory_analysis().argument_size_in_bytes - other
  rest = sum(  # embeddings, norms, the LM head: what no format quantizes
    node.get_value().nbytes
    for path, node in nnx.iter_graph(model)
    if isinstance(node, nnx.Param) and not (path and path[-1] in quant.PROJECTIONS)
  )
  prefill = jax.jit(lambda s, c, t: nnx.merge(graphdef, s)(t, cache=c)[1])
  cache = prefill(state, cache, tokens)
  token = tokens[:, -1:]
  token, cache = compiled(state, cache, token)  # warm
  jax.block_until_ready(token)
  start = time.perf_counter()
  for _ in range(args.steps):
    token, cache = compiled(state, cache, token)
  jax.block_until_ready(token)
  seconds = time.perf_counter() - start
  tok_s = args.batch * args.steps / seconds
  return {"weights": weights, "projections": weights - rest, "tok/s": tok_s}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--d-model", type=int, default=512)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--vocab", type=int, default=8192)
  p.add_argument("--context", type=int, default=256, help="KV cache slots per sequence")
  p.add_argument("--prompt", type=int, default=16, help="tokens in the cache before timing")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--steps", type=int, default=32)
  p.add_argument("--group-size", type=int, default=128, help="int4's inputs per scale")
  p.add_argument("--formats", default=",".join(FORMATS), help=f"a subset of {FORMATS}")
  args = p.parse_args(argv)
  rows = {fmt: measure(args, fmt) for fmt in args.formats.split(",")}
  base = rows.get("float32", next(iter(rows.values())))
  head = ("format", 9), ("weights MiB", 12), ("vs f32", 7), ("projections MiB", 16), ("vs f32", 7)
  print(" ".join(f"{name:>{width}}" for name, width in (*head, ("tok/s", 8))))
  for fmt, row in rows.items():
    w, pr = row["weights"], row["projections"]
    print(f"{fmt:>9} {w / 2**20:12.2f} {w / base['weights']:7.3f}", end="")
    print(f" {pr / 2**20:16.2f} {pr / base['projections']:7.3f} {row['tok/s']:8.1f}")


if __name__ == "__main__":
  main()
