"""Where a CPU step's time goes, by op class, for us and for the PyTorch peer side by side.

    python bench/cpu_profile.py --path train [--config configs/tiny.yaml]
    python bench/cpu_profile.py --path decode [--batch 32]
    python bench/cpu_profile.py --path prefill [--chunk 128]

Ours: the step runs under `jax.profiler.trace`; every thunk the CPU backend executes is an event
on one of its threads, carrying the HLO instruction it ran and its module's id. XLA dumps each
optimized module's HLO text (`--xla_dump_to`, set before jax starts), and `bench/step_profile.py`
classes every instruction of it (matmul, attention, elementwise, ...). The thunks of one step run
on two threads at once, so a class's busy time is converted to wall time by its share of all the
busy time, times the measured wall time of a step (timed outside the profiler).

The peer: the same model in PyTorch eager (`bench/torch_llama.py`'s model for training; for the
serving paths a transformers `LlamaForCausalLM` on a `DynamicCache`, SDPA attention), under
`torch.profiler`; each aten op's self time goes to a class by its name, and the classes are
scaled to the peer's measured wall step time the same way.

Paths:
* train: one AdamW step of `--config` at its batch and sequence length, float32.
* decode: one engine step at `--batch` running requests, each with a `--context`-token context,
  drawing greedily one token (decode bursts off, so each step is one program call); the peer
  runs one cached forward of the same batch and context and an argmax.
* prefill: one engine step computing a `--chunk`-token prompt chunk for `--rows` requests; the
  peer runs the same rows' prompt forward.

Serving paths use a random Llama of the shape the issue measured against vLLM (d_model 512,
6 layers, 8 heads, 4 kv heads, FFN 1408, vocabulary 2048, float32) unless `--set` changes it.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile
import time

if __name__ == "__main__":  # XLA reads its flags once, when the backend starts
  _DUMP = tempfile.mkdtemp(prefix="xla_dump_")
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_dump_to={_DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"
  )

from collections import defaultdict

import jax
import numpy as np
import serve_peer
import step_profile

from atlas_jax import host_memory

# Thunk-executor bookkeeping events: containers of the thunks, not work of their own; and the
# control-flow thunks (a while loop's event spans its body's thunks, which are events too).
_CONTAINERS = ("ThunkExecutor", "SlinkyThreadPool", "ThreadpoolListener", "PjRt", "Execute")
_CONTROL_FLOW = re.compile(r"^(while|conditional|call)(\.\d+)?$")

# The vLLM comparison's model (bench/serve_peer.py), with room for the contexts profiled here.
SERVING_SHAPE = [*serve_peer.PEER_SHAPE, "model.max_seq_len=2048"]

# aten op -> class, first match wins (regular expressions on the op name).
_TORCH_CLASSES = (
  ("attention", r"scaled_dot_product|flash_attention|_efficient_attention"),
  ("matmul", r"aten::(mm|addmm|bmm|matmul|linear|baddbmm)$"),
  ("optimizer", r"adam|Optimizer|clip_grad|_foreach"),
  ("loss", r"log_softmax|nll_loss|cross_entropy"),
  ("sampling", r"aten::(argmax|topk|sort|multinomial)$"),
  ("reduction", r"aten::(sum|mean|norm|linalg_vector_norm|max|amax|var)$"),
  (
    "elementwise",
    r"aten::(mul|add|sub|div|silu|silu_backward|rsqrt|pow|neg|exp|sigmoid|cos|sin|where|"
    r"mul_|add_|div_|sub_|pow_|lerp_|sqrt|addcmul_|addcdiv_|threshold|gelu|tanh|clamp)",
  ),
  (
    "data movement",
    r"aten::(cat|copy_|fill_|zero_|index|index_select|embedding|embedding_dense_backward|"
    r"contiguous|clone|empty|zeros|ones|to|_to_copy|slice|select|gather|scatter|"
    r"index_put_|_index_put_impl_|transpose|t|view|reshape|expand|as_strided|unsqueeze|cumsum)",
  ),
)


def torch_class(name: str) -> str:
  for cls, pattern in _TORCH_CLASSES:
    if re.search(pattern, name):
      return cls
  return "other"


# -- ours ------------------------------------------------------------------------------------------


def accounts(dump_dir: str) -> dict[int, step_profile.Account]:
  """Module id -> the op-class account of its optimized HLO, for every module XLA dumped."""
  out = {}
  for path in glob.glob(os.path.join(dump_dir, "module_*after_optimizations.txt")):
    m = re.match(r"module_(\d+)\.", os.path.basename(path))
    if m:
      out[int(m.group(1))] = step_profile.hlo_account(open(path).read())
  return out


def trace_classes(
  run, steps: int, dump_dir: str, trace_dir: str, by_op: dict | None = None
) -> dict[str, float]:
  """Busy seconds per op class over `steps` calls of `run()`, every host thread summed; with
  `by_op`, each instruction's own busy seconds are added to it under (class, name)."""
  from jax.profiler import ProfileData

  with jax.profiler.trace(trace_dir):
    for _ in range(steps):
      jax.block_until_ready(run())
  (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  acct = accounts(dump_dir)
  busy: dict[str, float] = defaultdict(float)
  for plane in ProfileData.from_file(path).planes:
    if not plane.name.startswith("/host:CPU"):
      continue
    for line in plane.lines:
      if line.name == "python":
        continue
      for event in line.events:
        if event.name.startswith(_CONTAINERS):
          continue
        stats = dict(event.stats)
        op = stats.get("hlo_op", event.name)
        if isinstance(op, str) and _CONTROL_FLOW.match(op):
          continue
        module = acct.get(stats.get("program_id"))
        if module is None:
          busy["other"] += event.duration_ns * 1e-9
          continue
        cls = module.instruction_class.get(op, "other")
        busy[cls] += event.duration_ns * 1e-9
        if by_op is not None:
          by_op[cls, op] = by_op.get((cls, op), 0.0) + event.duration_ns * 1e-9
  return busy


def wall_seconds(run, steps: int, repeat: int = 3) -> float:
  """Best of `repeat` mean wall seconds per call over `steps` back-to-back calls."""
  best = float("inf")
  for _ in range(repeat):
    t0 = time.perf_counter()
    for _ in range(steps):
      out = run()
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - t0) / steps)
  return best


def torch_busy(run, steps: int) -> dict[str, float]:
  """Self CPU seconds per op class over `steps` calls of `run()` under torch.profiler."""
  from torch.profiler import ProfilerActivity, profile

  with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(steps):
      run()
  busy: dict[str, float] = defaultdict(float)
  for ev in prof.key_averages():
    busy[torch_class(ev.key)] += ev.self_cpu_time_total * 1e-6
  return busy


def torch_wall(run, steps: int, repeat: int = 3) -> float:
  best = float("inf")
  for _ in range(repeat):
    t0 = time.perf_counter()
    for _ in range(steps):
      run()
    best = min(best, (time.perf_counter() - t0) / steps)
  return best


# -- the paths -----------------------------------------------------------------------------------


def train_runs(config: str, overrides: list[str]):
  import torch_llama
  import train_step

  from atlas_jax.config import load_config

  cfg = load_config(config, [*train_step.PEER_DEFAULTS, *overrides])
  step, state = train_step.build(cfg)
  batches = train_step.random_batches(cfg, 2)
  holder = {"state": state}

  def ours():
    holder["state"], metrics = step(holder["state"], {"tokens": batches[0]})
    return metrics

  import torch

  torch.manual_seed(0)
  model = torch_llama.Llama(cfg.model)
  peer_step = torch_llama.train_step(
    model, cfg.train, device="cpu", bf16=False, compile_backend=None
  )
  B, T = cfg.train.batch_size, cfg.train.seq_len
  return ours, (lambda: peer_step(batches[0])), f"train {config} B={B} T={T}", B * T


def _serving_model(overrides: list[str]):
  from flax import nnx

  from atlas_jax.config import load_config
  from atlas_jax.model.transformer import Transformer

  cfg = load_config("configs/tiny.yaml", [*SERVING_SHAPE, *overrides]).model
  return cfg, Transformer(cfg, rngs=nnx.Rngs(0))


def _hf_peer(model, folder: str):
  import torch
  from transformers import AutoModelForCausalLM

  from atlas_jax import hf

  hf.save(model, folder)
  peer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  peer.eval()
  return peer


def serving_runs(path: str, args):
  import torch
  from transformers import DynamicCache

  from atlas_jax.decoding.sampling import SamplingParams
  from atlas_jax.serving.engine import Engine, EngineConfig

  cfg, model = _serving_model(args.set)
  rng = np.random.default_rng(0)
  B, n = (args.batch, args.context) if path == "decode" else (args.rows, args.chunk)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for _ in range(B)]
  engine = Engine(
    model,
    EngineConfig(
      n_blocks=B * -(-(n + 512) // 16) + 16,
      max_num_seqs=B,
      max_num_batched_tokens=max(B * n, 512),
      prefill_chunk=max(n, 16) if path == "prefill" else 256,
      decode_burst=1,
      enable_prefix_caching=False,
      max_model_len=n + 512,
    ),
  )
  greedy = SamplingParams(temperature=0.0, max_new_tokens=500, ignore_eos=True)
  counter = iter(range(10**9))
  if path == "decode":
    for i in range(B):
      engine.add_request(("profile", i), prompts[i], greedy)
    while any(r.n_computed < n for r in engine.scheduler.requests.values()):
      engine.step()

    def ours():
      engine.step()
  else:

    def ours():
      ids = [("profile", next(counter)) for _ in range(B)]
      for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_new_tokens=1))
      engine.step()  # every row's whole prompt in one step, then each finishes at its draw
      while any(rid in engine.scheduler.requests for rid in ids):
        engine.step()

  with tempfile.TemporaryDirectory() as folder:
    peer = _hf_peer(model, folder)
  tokens = torch.tensor(prompts)

  if path == "decode":
    with torch.no_grad():
      cache = DynamicCache()
      out = peer(tokens, past_key_values=cache, use_cache=True)
    state = {"cache": cache, "next": out.logits[:, -1].argmax(-1, keepdim=True)}

    def theirs():
      # One token per row on a cache of the context; the cache is cropped back each call so
      # every step sees the same context length.
      with torch.no_grad():
        out = peer(state["next"], past_key_values=state["cache"], use_cache=True)
        state["cache"].crop(-1)  # drop the token just appended
        return out.logits[:, -1].argmax(-1)
  else:

    def theirs():
      with torch.no_grad():
        return peer(tokens, use_cache=True).logits[:, -1].argmax(-1)

  label = f"{path} B={B} " + (f"context {n}" if path == "decode" else f"chunk {n}")
  return ours, theirs, label, B if path == "decode" else B * n


CLASS_ORDER = (*step_profile.CLASSES, "other")


def table(ours_busy, ours_wall, peer_busy, peer_wall, label: str) -> str:
  o_total, p_total = sum(ours_busy.values()), sum(peer_busy.values())
  rows = [
    f"#### {label}: ms per step, each class's share of busy time times the wall time",
    "",
    "| op class | atlas_jax ms | PyTorch ms | ours / theirs |",
    "|---|---|---|---|",
  ]
  for cls in CLASS_ORDER:
    o = ours_busy.get(cls, 0.0) / o_total * ours_wall * 1e3 if o_total else 0.0
    p = peer_busy.get(cls, 0.0) / p_total * peer_wall * 1e3 if p_total else 0.0
    if o < 0.005 and p < 0.005:
      continue
    ratio = f"{o / p:.2f}" if p >= 0.005 else "-"
    rows.append(f"| {cls} | {o:.2f} | {p:.2f} | {ratio} |")
  rows.append(
    f"| step (wall) | {ours_wall * 1e3:.2f} | {peer_wall * 1e3:.2f} | {ours_wall / peer_wall:.2f} |"
  )
  return "\n".join(rows)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--path", choices=["train", "decode", "prefill"], required=True)
  p.add_argument("--config", default="configs/tiny.yaml", help="train: the preset")
  p.add_argument("--batch", type=int, default=32, help="decode: running requests")
  p.add_argument("--context", type=int, default=128, help="decode: tokens in each context")
  p.add_argument("--rows", type=int, default=1, help="prefill: requests in the step")
  p.add_argument("--chunk", type=int, default=128, help="prefill: prompt tokens per request")
  p.add_argument("--steps", type=int, default=10, help="steps timed and traced")
  p.add_argument("--threads", type=int, default=2, help="PyTorch CPU threads")
  p.add_argument("--set", action="append", default=[], help="model overrides")
  p.add_argument("--top", type=int, default=0, help="also list our N costliest instructions")
  args = p.parse_args(argv)
  import torch

  torch.set_num_threads(args.threads)
  if args.path == "train":  # malloc as train.py sets it (atlas_jax.host_memory), for both
    print(f"# host memory: {host_memory.keep_freed_memory()}")
    ours, theirs, label, tokens = train_runs(args.config, args.set)
  else:
    ours, theirs, label, tokens = serving_runs(args.path, args)
  for _ in range(3):  # compile and warm up
    jax.block_until_ready(ours())
    theirs()
  load = os.getloadavg()[0]
  ours_wall = wall_seconds(ours, args.steps)
  peer_wall = torch_wall(theirs, args.steps)
  with tempfile.TemporaryDirectory() as trace_dir:
    by_op = {} if args.top else None
    ours_busy = trace_classes(ours, args.steps, _DUMP, trace_dir, by_op)
  peer_busy = torch_busy(theirs, args.steps)
  print(
    f"# {time.strftime('%Y-%m-%d')}, jax {jax.__version__}, torch {torch.__version__} "
    f"({args.threads} threads); load average {load:.2f} before, {os.getloadavg()[0]:.2f} after"
  )
  print(
    f"# tokens/s: atlas_jax {tokens / ours_wall:,.0f}, PyTorch {tokens / peer_wall:,.0f} "
    f"(ratio {peer_wall / ours_wall:.2f})"
  )
  print(table(ours_busy, ours_wall, peer_busy, peer_wall, label))
  if by_op:
    print(f"\n# our {args.top} costliest instructions, busy ms per step")
    for (cls, op), sec in sorted(by_op.items(), key=lambda kv: -kv[1])[: args.top]:
      print(f"{sec / args.steps * 1e3:9.3f}  {cls:14s} {op}")


if __name__ == "__main__":
  sys.exit(main())
