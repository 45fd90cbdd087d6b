"""Pipeline schedules on fake CPU devices: iterations, bubble and per-device bytes, measured off
the real trainer beside the planner's figures.

For GPipe and the circular schedule at several micro-batch counts, each row compiles the train
step of a small model on a stage x fsdp mesh and reads off it: the pipeline loops' trip count
(the compiled program), the idle share of the stages' iterations (the program's own busy flags,
`Pipeline.run`), the parameter bytes one device holds (the sharded train state), the activation
bytes it keeps for the backward pass (the compiled step's residuals) and the bytes it sends with
ppermute per step (the compiled program). The planner's formula stands beside each. Nothing is
timed: fake devices share the host's cores, and their timings are no evidence of speed.

  python bench/pipeline.py                                # 4 stages x fsdp 2, M in {4, 8, 16}
  python bench/pipeline.py --stages 2 --microbatches 4 8
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

if "jax" not in sys.modules:  # fake devices before jax starts (a test may have started it)
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from atlas_jax import measure
from atlas_jax.config import Config, load_config
from atlas_jax.plan import memory
from atlas_jax.plan import pipeline as pipeline_plan
from atlas_jax.schedule import Schedule
from atlas_jax.training import sharding as shd
from atlas_jax.training.step import make_trainer

MODEL = [
  "model.vocab_size=256",
  "model.d_model=64",
  "model.n_heads=4",
  "model.n_kv_heads=2",
  "model.ffn_dim=128",
  "model.n_layers=16",
  "model.max_seq_len=64",
  "train.seq_len=32",
  "train.remat=full",
  "attention.implementation=xla",
]


def config(stages: int, microbatches: int, repeats: int, devices: int) -> Config:
  fsdp = devices // stages
  return load_config(
    None,
    [
      *MODEL,
      f"mesh.stage={stages}",
      f"mesh.fsdp={fsdp}",
      f"train.pipeline_microbatches={microbatches}",
      f"train.pipeline_repeats={repeats}",
      f"train.batch_size={fsdp * microbatches}",  # one row per micro-batch and data shard
    ],
  )


def busy_share(cfg: Config) -> float:
  """The share of stage-iterations the pipelined program marks busy (Pipeline.run's flags)."""
  trainer = make_trainer(cfg)
  model = nnx.merge(trainer.graphdef, trainer.init(jax.random.key(0)).params)
  graphdef, blocks = nnx.split(model.blocks)
  B, T, D = cfg.train.batch_size, cfg.train.seq_len, cfg.model.d_model
  rows = (jnp.zeros((B, T), jnp.int32), None)

  def step(x, layer, rows):
    return nnx.merge(graphdef, layer)(x, rows[0])[0], None

  run = jax.jit(lambda b, x: model.pipeline.run(step, x, b, rows)[2])
  return float(np.asarray(run(blocks, jnp.zeros((B, T, D)))).mean())


def row(stages: int, microbatches: int, repeats: int, devices: int) -> dict:
  cfg = config(stages, microbatches, repeats, devices)
  t, m = cfg.train, cfg.mesh
  mesh = shd.make_mesh(m)
  sched = Schedule(stages, microbatches, repeats)
  hlo = measure.compiled_train_step(cfg, mesh=mesh)
  rows = t.batch_size // m.fsdp
  state = memory.state_bytes(cfg.model, strategy="dp", devices=devices, stage=stages)
  return {
    "schedule": "circular" if repeats > 1 else "GPipe",
    "stages": stages,
    "microbatches": microbatches,
    "repeats": repeats,
    "iterations": measure.pipeline_loops(hlo)[0],
    "iterations_formula": sched.iterations,
    "bubble": 1 - busy_share(cfg),
    "bubble_formula": sched.bubble,
    "param_bytes": measure.train_state_bytes(cfg, mesh)["params"],
    "param_bytes_plan": state.params,
    "activation_bytes": measure.saved_activation_bytes_per_device(cfg, mesh=mesh),
    "activation_bytes_plan": memory.activation_bytes(
      cfg.model,
      policy=t.remat,
      batch=rows,
      seq_len=t.seq_len,
      compute_bytes=4,
      attention="xla",
      schedule=sched,
    ).saved,
    "ppermute_bytes": measure.collective_permute_bytes(hlo),
    "ppermute_bytes_plan": pipeline_plan.ppermute_bytes(
      cfg.model, rows=rows, seq_len=t.seq_len, compute_bytes=4, schedule=sched
    ),
  }


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--stages", type=int, default=4)
  p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
  p.add_argument("--repeats", type=int, default=2, help="the circular schedule's (GPipe: 1)")
  args = p.parse_args(argv)
  devices = jax.device_count()
  cfg = config(args.stages, args.microbatches[0], 1, devices)
  print(
    f"# {datetime.date.today()}, jax {jax.__version__}, {devices} fake CPU devices: "
    f"{args.stages} stages x fsdp {devices // args.stages}, {cfg.model.n_layers} layers of "
    f"d_model {cfg.model.d_model}, {cfg.train.seq_len} tokens, one row per micro-batch and data "
    "shard, float32, remat full; measured (planner)"
  )
  print(
    "| schedule | M | iterations | bubble | params / device | activations / device | "
    "ppermute / step |"
  )
  print("|---|---|---|---|---|---|---|")
  kib = lambda b: f"{b / 1024:,.1f} KiB"
  for repeats in (1, args.repeats):
    for U in args.microbatches:
      r = row(args.stages, U, repeats, devices)
      name = r["schedule"] + (f" (r={repeats})" if repeats > 1 else "")
      print(
        f"| {name} | {U} | {r['iterations']} ({r['iterations_formula']}) | "
        f"{r['bubble']:.1%} ({r['bubble_formula']:.1%}) | {kib(r['param_bytes'])} "
        f"({kib(r['param_bytes_plan'])}) | {kib(r['activation_bytes'])} "
        f"({kib(r['activation_bytes_plan'])}) | {kib(r['ppermute_bytes'])} "
        f"({kib(r['ppermute_bytes_plan'])}) |",
        flush=True,
      )


if __name__ == "__main__":
  main()
