"""The one-shot GPU benchmark: every accelerator figure BENCHMARKS.md quotes, in one command.

Each section runs in its own process with its own time limit (and the whole run within
`--budget` seconds), so one hang or crash cannot eat the rest, and prints markdown tables with
the peer beside ours and the ratio:

* correctness: every GPU kernel against its pure-jnp reference, max error per case; the section
  (and so the script) fails on a mismatch.
* attention: FlashAttention (ours) against cuDNN and XLA in TFLOP/s, the FlashAttention-3
  paper's sweep at head dim 128, with the implementation `attention(implementation=None)` picks.
* decode: paged GQA and MLA decode bandwidth against XLA and the measured copy bandwidth.
* mgpu: the experimental Mosaic GPU FlashAttention (sm_90): output and gradient error, forward
  and forward + backward TFLOP/s vs cuDNN.
* serving: the engine against the model's own jitted `generate` (same prompts and lengths) at
  batch 8, 32 and 64; batch-1 decode ms/step against the bound of reading the weights once per
  step at the card's measured copy bandwidth; transformers `generate` on CUDA in bf16 with its
  static cache, eager and under `torch.compile`, on the same weights.
* training: tokens/s, MFU and peak memory of the train step on the `small` and `llama3-1b`
  presets, beside a PyTorch peer of the same architecture and batch (bf16 autocast, SDPA flash
  attention, fused AdamW, `torch.compile`), each in its own process (`bench/gpu_training.py`).
* profile: where one `llama3-1b` train step goes per op class (matmuls, attention, elementwise,
  reductions, loss, optimizer, collectives): FLOPs and bytes from the compiled HLO, device time
  from a profiler trace of 3 steps (`bench/gpu_training.py --profile`).

The sections share the per-topic scripts' parts, each written once: `timing.py` (how a call or a
loop of steps is timed), `attention_sweep.py` (one attention configuration's TFLOP/s, also behind
`attention.py`), `train_step.py` and `torch_llama.py` (our train step and its PyTorch peer, also
behind `train.py`), `step_profile.py` (the op-class account) and `serve.py`'s engine runs.

    python bench/gpu.py              # on the GPU machine: every section, at most 9 minutes
    python bench/gpu.py --smoke      # the same code paths on CPU at toy sizes
    python bench/gpu.py --only correctness --only decode
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# name -> (seconds allowed on the GPU, seconds allowed under --smoke), in running order. The GPU
# limits add up to more than the budget: a section gets its limit or what is left, if less.
SECTIONS = {
  "correctness": (60, 60),
  "decode": (60, 60),
  "attention": (120, 60),
  "mgpu": (75, 30),
  "serving": (150, 120),
  "training": (240, 200),
  "profile": (90, 90),
}
BUDGET = 540


# -- serving -------------------------------------------------------------------------------------


def serving(smoke: bool) -> None:
  import jax
  import numpy as np
  from flax import nnx

  import serve as serve_bench
  from atlas_jax import hf
  from atlas_jax.config import ModelConfig
  from atlas_jax.model import build

  if smoke:
    cfg = ModelConfig(vocab_size=259, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    batches, prompt_len, new_tokens = [2], 8, 8
  else:
    # The 0.5B shape the serving issue measured: d 2048, 8 layers, 16/8 heads, ffn 5632.
    cfg = ModelConfig(
      vocab_size=32000,
      d_model=2048,
      n_layers=8,
      n_heads=16,
      n_kv_heads=8,
      ffn_dim=5632,
      max_seq_len=1024,
      dtype="bfloat16",
      param_dtype="bfloat16",
    )
    batches, prompt_len, new_tokens = [8, 32, 64], 128, 256
  model = build(cfg, rngs=nnx.Rngs(0))
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; model {cfg}", flush=True)
  serve_bench.print_ratio_tables(model, batches, prompt_len, new_tokens, repeat=1, burst=8)
  print_pool_from_memory(model)

  peer_batch = batches[min(1, len(batches) - 1)]
  ours = serve_bench.engine_vs_generate(
    model, batch=peer_batch, prompt_len=prompt_len, new_tokens=new_tokens, repeat=1
  )[0][2]
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, cfg.vocab_size, (peer_batch, prompt_len)).tolist()
  with tempfile.TemporaryDirectory() as folder:
    hf.save(model, folder)
    print("\n## transformers generate on the same weights (greedy, fixed lengths)")
    print("| stack | batch | tok/s | ours / theirs |")
    print("|---|---|---|---|")
    print(f"| atlas_jax engine | {peer_batch} | {ours:.0f} | 1.00 |", flush=True)
    # torch.compile is left out of the smoke run: minutes of compilation on a CPU.
    for compiled in (False,) if smoke else (False, True):
      name = "static cache, torch.compile" if compiled else "static cache, eager"
      try:
        theirs = transformers_tok_s(folder, prompts, new_tokens, compiled=compiled, smoke=smoke)
      except Exception as e:  # torch.compile support varies by version: report, go on
        print(f"| transformers ({name}) | {peer_batch} | failed: {type(e).__name__} | - |")
        continue
      print(f"| transformers ({name}) | {peer_batch} | {theirs:.0f} | {ours / theirs:.2f} |")


def print_pool_from_memory(model) -> None:
  """The pool serve.py's default engine sizes from this device's memory (where it reports it)."""
  from atlas_jax.serving.engine import Engine, EngineConfig

  engine = Engine(model, EngineConfig())
  s, c = engine.pool_size, engine.config
  print("\n## the pool sized from device memory (serve.py's defaults)")
  print("| memory | weights + in use | largest step | pool | blocks | tokens | max_num_seqs |")
  print("|---|---|---|---|---|---|---|")
  gib = lambda n: "-" if n is None else f"{n / 2**30:.2f} GiB"
  print(
    f"| {gib(s.memory)} | {gib(s.used)} | {gib(s.activations)} | {gib(s.pool_bytes)} | "
    f"{c.n_blocks} | {c.n_blocks * c.block_size} | {c.max_num_seqs} |",
    flush=True,
  )
  del engine


def transformers_tok_s(folder, prompts, new_tokens: int, *, compiled: bool, smoke: bool) -> float:
  """Output tokens/s of transformers `generate`, greedy, every row to `new_tokens`."""
  import torch
  from timing import seconds_per_call
  from transformers import AutoModelForCausalLM

  device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
  dtype = torch.float32 if device == "cpu" else torch.bfloat16
  model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
  if compiled:
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
  ids = torch.tensor(prompts, device=device)

  def run():
    with torch.no_grad():
      model.generate(
        ids,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        cache_implementation="static",
        pad_token_id=0,
      )
    if device == "cuda":
      torch.cuda.synchronize()

  return len(prompts) * new_tokens / seconds_per_call(run, iters=1)  # after a warm-up (compiling)


# -- training ------------------------------------------------------------------------------------


def training(smoke: bool) -> None:
  """Train-step tokens/s, MFU and peak memory against a PyTorch peer (`gpu_training.py`)."""
  import gpu_training

  gpu_training.training(smoke)


def profile(smoke: bool) -> None:
  """One llama3-1b train step per op class (`gpu_training.py --profile`)."""
  import gpu_training

  gpu_training.profile("llama3-1b", smoke)


# -- driver --------------------------------------------------------------------------------------


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--smoke", action="store_true", help="CPU, toy sizes: the same code paths")
  p.add_argument("--only", choices=list(SECTIONS), action="append", help="run these sections")
  p.add_argument("--budget", type=float, default=BUDGET, help="seconds for the whole run")
  p.add_argument("--section", choices=list(SECTIONS), help=argparse.SUPPRESS)  # one, in-process
  args = p.parse_args(argv)
  if args.section:
    import gpu_kernels

    run = {"serving": serving, "training": training, "profile": profile}.get(
      args.section
    ) or getattr(gpu_kernels, args.section)
    run(args.smoke)
    return 0
  failed = []
  start = time.perf_counter()
  for name in [n for n in SECTIONS if n in (args.only or SECTIONS)]:
    left = args.budget - (time.perf_counter() - start)
    if left < 10:
      print(f"\n# section {name}: SKIPPED, {left:.0f} s of the budget left", flush=True)
      failed.append(name)
      continue
    limit = min(SECTIONS[name][1 if args.smoke else 0], left)
    print(f"\n# section {name} (limit {limit:.0f} s)", flush=True)
    cmd = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), __file__]
    cmd += ["--section", name] + (["--smoke"] if args.smoke else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.smoke:
      env["JAX_PLATFORMS"] = "cpu"
    t0 = time.perf_counter()
    try:
      rc = subprocess.run(cmd, env=env, timeout=limit).returncode
    except subprocess.TimeoutExpired:
      rc = "timeout"
    print(
      f"# section {name}: {'ok' if rc == 0 else f'FAILED ({rc})'} in "
      f"{time.perf_counter() - t0:.0f} s",
      flush=True,
    )
    if rc != 0:
      failed.append(name)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
