"""Full fine-tuning against LoRA on the same model: train-step tokens/s and memory, side by side.

    python bench/finetune.py [--config configs/tiny.yaml] [--rank 16] [--repeats 3] [--steps 20]
    python bench/finetune.py --no-time      # memory and counts only (no step is run)

Both runs train the preset's model on the same random batches, on one device, interleaved
(full, LoRA, full, LoRA, ...) so that a machine's load drifts onto both alike; the load average
is printed before and after. Memory is XLA's account of the compiled step (`memory_analysis`):
its arguments (the train state and the batch) plus its temporaries (activations, gradients,
the update), what the device must hold while the step runs. Beside it, the planner's training
state in bytes per model parameter (`atlas_jax.plan.memory.state_bytes`, one device, dp); the
step's arguments are exactly the planner's parameters and Adam state, the batch and two step
counters (`memory_row`, which tests/test_bench_finetune.py checks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
import numpy as np
from timing import seconds_for
from train_step import build, random_batches

from atlas_jax.config import load_config
from atlas_jax.model.lora import resolve
from atlas_jax.plan import memory
from atlas_jax.plan.params import counts
from atlas_jax.training.checkpoint import single_device_mesh
from atlas_jax.training.step import make_train_step, make_trainer, split_trainable


def step_memory(cfg) -> dict[str, int]:
  """XLA's bytes for the compiled step: arguments (state + batch) and temporaries."""
  trainer = make_trainer(cfg, mesh=single_device_mesh())
  step = make_train_step(trainer)
  state = trainer.abstract_state()
  batch = {"tokens": jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len + 1), np.int32)}
  analysis = step.lower(state, batch).compile().memory_analysis()
  return {
    "arguments": int(analysis.argument_size_in_bytes),
    "temporaries": int(analysis.temp_size_in_bytes),
  }


def planned_state(cfg) -> memory.StateBytes:
  """The planner's training state for `cfg` on one device (dp)."""
  lora = None
  if cfg.train.lora is not None:
    adapters = resolve(cfg.model, cfg.train.lora)
    lora = (adapters.rank, adapters.targets)
  return memory.state_bytes(cfg.model, strategy="dp", devices=1, lora=lora)


def memory_row(cfg) -> dict[str, float]:
  """What does not need a timer: trainable parameters, the compiled step's memory and the
  planner's state (bytes, and bytes per model parameter)."""
  trainer = make_trainer(cfg, mesh=single_device_mesh())
  trained, _ = split_trainable(cfg, trainer.abstract_state().params)
  st = planned_state(cfg)
  return {
    "trainable": sum(x.size for x in jax.tree.leaves(trained)),
    **step_memory(cfg),
    "batch": cfg.train.batch_size * (cfg.train.seq_len + 1) * 4,  # int32 tokens
    "planned_params": st.params,
    "planned_opt_state": st.opt_state,
    "bytes_per_param": st.total / counts(cfg.model).total,
  }


def timed(step, state, batches) -> tuple[float, object]:
  """(seconds for `batches`, the state after them): the state is donated step to step."""

  def one(tokens):
    nonlocal state
    state, metrics = step(state, {"tokens": tokens})
    return metrics

  seconds, _ = seconds_for(one, batches)
  return seconds, state


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--config", default="configs/tiny.yaml")
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--targets", default="attn,mlp")
  p.add_argument("--steps", type=int, default=20, help="timed steps per repeat")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--no-time", action="store_true", help="memory and counts only: no step is run")
  args = p.parse_args(argv)
  targets = "[" + ", ".join(t.strip() for t in args.targets.split(",")) + "]"
  base = [*args.set, "mesh.fsdp=1", "train.lora=null"]
  lora = f"train.lora={{rank: {args.rank}, targets: {targets}}}"
  cfgs = {
    "full": load_config(args.config, base),
    "lora": load_config(args.config, [*base, lora]),
  }
  print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs")
  c = cfgs["full"]
  print(
    f"model: {args.config} ({counts(c.model).total:,} parameters), batch {c.train.batch_size} x "
    f"{c.train.seq_len} tokens, precision {c.train.precision}"
  )
  tps: dict[str, list[float]] = {name: [] for name in cfgs}
  if not args.no_time:
    batches = random_batches(c, args.steps)
    steps = {name: build(cfg) for name, cfg in cfgs.items()}
    tokens = c.train.batch_size * c.train.seq_len * args.steps
    for r in range(args.repeats + 1):  # the first round compiles and warms up
      for name, (step, state) in steps.items():
        seconds, state = timed(step, state, batches if r else batches[:2])
        steps[name] = (step, state)
        if r:
          tps[name].append(tokens / seconds)
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
  print()
  print(
    f"| run | trainable params | tokens/s (median of {args.repeats}) | step memory: state + "
    "batch | temporaries | total | planner: state bytes / param |"
  )
  print("|---|---|---|---|---|---|---|")
  rows = {}
  for name, cfg in cfgs.items():
    m = memory_row(cfg)
    median = statistics.median(tps[name]) if tps[name] else None
    rows[name] = (median, m["arguments"] + m["temporaries"])
    print(
      f"| {name} | {m['trainable']:,} | {'not timed' if median is None else f'{median:,.0f}'} | "
      f"{m['arguments'] / 2**20:.1f} MiB | {m['temporaries'] / 2**20:.1f} MiB | "
      f"{rows[name][1] / 2**20:.1f} MiB | {m['bytes_per_param']:.2f} |"
    )
  (f_tps, f_mem), (l_tps, l_mem) = rows["full"], rows["lora"]
  speed = "" if f_tps is None else f"{l_tps / f_tps:.2f}x full fine-tuning's tokens/s, "
  print(f"\nLoRA rank {args.rank}: {speed}{l_mem / f_mem:.2f}x its step memory")
  return 0


if __name__ == "__main__":
  sys.exit(main())
