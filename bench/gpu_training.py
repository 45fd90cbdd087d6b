"""The training section of the one-shot GPU benchmark: atlas_jax against a PyTorch peer.

For the `small` and `llama3-1b` presets, at the preset's batch and sequence length on random
tokens: tokens/s, MFU (model FLOPs as `train.py` counts them over the device table's peak) and
peak device memory of our jitted train step, beside a PyTorch model of the same architecture
(RMSNorm, RoPE, GQA, SwiGLU, tied or untied head) trained the way a tuned PyTorch user would:
float32 master weights under bf16 autocast, `scaled_dot_product_attention` on the flash backend,
fused AdamW, gradient clipping, `torch.compile`. Each side runs in its own process (so neither
holds the other's memory and each reports its own peak); the ratio is ours / theirs.

    python bench/gpu.py --only training          # on the GPU machine
    python bench/gpu.py --only training --smoke  # CPU, toy sizes, the same code paths
    python bench/gpu_training.py --side jax --preset llama3-1b   # one side alone, JSON line out
    python bench/gpu_training.py --profile --preset llama3-1b [--trace-dir DIR]

`--profile` (also `bench/gpu.py --only profile`) accounts for one train step per op class:
FLOPs and bytes from the compiled step's HLO (`bench/step_profile.py`, which adds up to
XLA's own cost analysis), and on an accelerator the device time per class from a
`jax.profiler` trace of a few steps (kept in DIR when given).

Under --smoke the presets shrink to a toy shape and `torch.compile` uses its eager backend
(tracing, no code generation), so the run takes seconds; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # the shared bench modules, also when run with -P
PRESETS = ("small", "llama3-1b")
SMOKE = [
  "model.vocab_size=512",
  "model.d_model=64",
  "model.n_layers=2",
  "model.n_heads=4",
  "model.n_kv_heads=2",
  "model.head_dim=16",
  "model.ffn_dim=128",
  "train.batch_size=2",
  "train.seq_len=64",
]


def preset_config(preset: str, smoke: bool):
  from atlas_jax.config import load_config

  overrides = ["mesh.fsdp=1", "train.sharding=dp", *(SMOKE if smoke else [])]
  cfg = load_config(ROOT / "configs" / f"{preset}.yaml", overrides)
  if smoke and cfg.train.loss_chunk:
    cfg = load_config(ROOT / "configs" / f"{preset}.yaml", [*overrides, "train.loss_chunk=16"])
  return cfg


# -- our side ------------------------------------------------------------------------------------


def run_jax(preset: str, smoke: bool, warmup: int, steps: int) -> dict:
  from atlas_jax.training.xla_flags import apply

  added = apply(preset_config(preset, smoke).train.xla_flags)  # before jax starts its backend
  import jax
  import train_step

  from atlas_jax.plan.compute import train_flops_per_token
  from atlas_jax.training.metrics import matmul_params, peak_memory_bytes

  cfg = preset_config(preset, smoke)
  step, state = train_step.build(cfg)
  flops_tok = train_flops_per_token(
    cfg.model, cfg.train.seq_len, n_matmul_params=matmul_params(state.params)
  )
  batches = train_step.random_batches(cfg, warmup + steps)
  compile_s, seconds, metrics = train_step.run(step, state, batches, warmup)
  return {
    "tokens_per_s": steps * cfg.train.batch_size * cfg.train.seq_len / seconds,
    "flops_per_token": flops_tok,
    "peak_memory": peak_memory_bytes(),
    "loss": float(metrics["loss"]),
    "warmup_s": compile_s,
    "device_kind": jax.devices()[0].device_kind,
    "xla_flags": added,
    "settings": f"{cfg.train.precision}, remat {cfg.train.remat}, loss_chunk "
    f"{cfg.train.loss_chunk}, attention {cfg.attention.implementation or 'default'}",
  }


def profile(preset: str, smoke: bool, steps: int = 3, trace_dir: str | None = None) -> None:
  """Prints where one train step's FLOPs, bytes and (on an accelerator) device time go."""
  from atlas_jax.training.xla_flags import apply

  apply(preset_config(preset, smoke).train.xla_flags)  # before jax starts its backend
  import glob
  import tempfile

  import jax
  import step_profile
  import train_step

  cfg = preset_config(preset, smoke)
  step, state = train_step.build(cfg)
  batches = [{"tokens": b} for b in train_step.random_batches(cfg, steps + 1)]
  compiled = step.lower(state, batches[0]).compile()
  account = step_profile.hlo_account(compiled.as_text())
  xla = compiled.cost_analysis()
  xla = xla[0] if isinstance(xla, list) else xla  # older jax: one dict per device
  device = jax.devices()[0]
  measured, unmatched, top, step_s = None, 0.0, [], None
  if device.platform != "cpu":
    state, metrics = compiled(state, batches[0])  # warm-up
    jax.block_until_ready(metrics)
    with tempfile.TemporaryDirectory() as scratch:
      folder = trace_dir or scratch
      t0 = time.perf_counter()
      with jax.profiler.trace(folder):
        for b in batches[1:]:
          state, metrics = compiled(state, b)
        jax.block_until_ready(metrics)
      step_s = (time.perf_counter() - t0) / steps
      found = sorted(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True))
      measured, unmatched, top = step_profile.device_times(found[-1], account, steps=steps)
  B, T = cfg.train.batch_size, cfg.train.seq_len
  print(
    f"\n## profile: one train step of {preset} ({B} x {T}; {cfg.train.precision}, remat "
    f"{cfg.train.remat}, loss_chunk {cfg.train.loss_chunk}) on {device.device_kind}"
  )
  print(
    step_profile.markdown_table(account, measured=measured, unmatched_s=unmatched, step_s=step_s)
  )
  at_xla = account.total(per_step=False)
  print(
    f"- XLA's cost analysis: {xla.get('flops', 0):.6g} FLOPs, {xla.get('bytes accessed', 0):.6g} "
    f"bytes; this walk at XLA's count (loop bodies once): {at_xla.flops:.6g} FLOPs, "
    f"{at_xla.bytes:.6g} bytes. The table runs loop bodies their trip counts."
  )
  if measured is None:
    print("- measured time: skipped on a CPU (no device trace; CPU timings mean nothing here)")
  else:
    print(f"- wall time per step under the profiler: {step_s * 1e3:.1f} ms over {steps} steps")
    for name, seconds in top:
      print(f"- unattributed: {name} {seconds * 1e3:.2f} ms per step")
  if account.unpriced:
    print(f"- opcodes this walk prices at 0 FLOPs: {', '.join(sorted(account.unpriced))}")


# -- the PyTorch peer ----------------------------------------------------------------------------


def run_torch(preset: str, smoke: bool, warmup: int, steps: int) -> dict:
  import torch
  import torch_llama
  import train_step

  cfg = preset_config(preset, smoke)
  cuda = torch.cuda.is_available() and not smoke
  backend = "eager" if smoke else "inductor"
  batches = train_step.random_batches(cfg, warmup + steps)
  result = torch_llama.run(
    cfg, batches, warmup, device="cuda" if cuda else "cpu", bf16=True, compile_backend=backend
  )
  return {
    "tokens_per_s": steps * cfg.train.batch_size * cfg.train.seq_len / result["seconds"],
    "peak_memory": result["peak_memory"],
    "loss": result["loss"],
    "warmup_s": result["warmup_s"],
    "settings": f"torch {torch.__version__}, bf16 autocast, SDPA flash, fused AdamW, "
    f"torch.compile ({backend})",
  }


# -- the section ---------------------------------------------------------------------------------


def _sides(side: str, presets, smoke: bool, steps: int, timeout: float) -> dict[str, dict]:
  """One side in its own process: {preset: its result, or {"error": ...}}."""
  cmd = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), __file__]
  cmd += ["--side", side, "--preset", *presets, "--steps", str(steps)]
  cmd += ["--smoke"] if smoke else []
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ)
  except subprocess.TimeoutExpired:
    return {p: {"error": f"timeout after {timeout:.0f} s"} for p in presets}
  results = {}
  for line in out.stdout.splitlines():
    if line.startswith("RESULT "):
      result = json.loads(line[len("RESULT ") :])
      results[result.pop("preset")] = result
  tail = (out.stdout + out.stderr).strip().splitlines()[-3:]
  oom = any("out of memory" in s.lower() or "RESOURCE_EXHAUSTED" in s for s in tail)
  error = "out of memory" if oom else f"exit {out.returncode}: {' | '.join(tail)}"
  return {p: results.get(p, {"error": error}) for p in presets}


def _fmt_bytes(n) -> str:
  return "-" if n is None else f"{n / 1e9:.1f} GB"


def training(
  smoke: bool, *, presets=PRESETS, steps: int | None = None, timeout: float | None = None
):
  """Prints the training table: each preset, ours and the PyTorch peer, and the ratio."""
  steps = steps or (2 if smoke else 20)
  timeout = timeout or (90 if smoke else 140)  # per side: compilation plus the timed steps
  print("\n## training: atlas_jax vs PyTorch (same architecture, batch and sequence)")
  print("| preset | batch x seq | stack | tokens/s | MFU | peak memory | ours / theirs |")
  print("|---|---|---|---|---|---|---|")
  notes = []
  # On the GPU each preset and side gets its own process, so each peak is its own; the smoke run
  # shares one process per side to save start-up time.
  groups = [list(presets)] if smoke else [[p] for p in presets]
  for group in groups:
    ours_all = _sides("jax", group, smoke, steps, timeout * len(group))
    theirs_all = _sides("torch", group, smoke, steps, timeout * len(group))
    for preset in group:
      notes += _rows(preset, ours_all[preset], theirs_all[preset], smoke)
  for note in notes:
    print(f"- {note}")


def _rows(preset: str, ours: dict, theirs: dict, smoke: bool) -> list[str]:
  """Prints the preset's two table rows; returns their notes."""
  from atlas_jax.devices import match_device_kind

  cfg = preset_config(preset, smoke)
  shape = f"{cfg.train.batch_size} x {cfg.train.seq_len}"
  # MFU only where the device's peak is known (never on a CPU): the planner's device table.
  known = None if smoke else match_device_kind(ours.get("device_kind", ""))
  both = "error" not in ours and "error" not in theirs
  notes = []
  for name, result in (("atlas_jax", ours), ("PyTorch", theirs)):
    if "error" in result:
      print(f"| {preset} | {shape} | {name} | failed: {result['error']} | - | - | - |")
      continue
    tps = result["tokens_per_s"]
    util = "-"
    if known is not None and "flops_per_token" in ours:
      util = f"{tps * ours['flops_per_token'] / known.peak_bf16_flops:.1%}"
    ratio = "-" if not both else f"{tps / theirs['tokens_per_s']:.2f}"
    mem = _fmt_bytes(result["peak_memory"])
    print(f"| {preset} | {shape} | {name} | {tps:,.0f} | {util} | {mem} | {ratio} |", flush=True)
    notes.append(f"{preset} {name}: {result['settings']}; warm-up {result['warmup_s']:.0f} s")
  return notes


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--side", choices=("jax", "torch"), help="run one side, print a RESULT line")
  p.add_argument("--preset", choices=PRESETS, nargs="+", default=list(PRESETS))
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--profile", action="store_true", help="op-class account of one step")
  p.add_argument("--trace-dir", help="with --profile: keep the profiler trace here")
  args = p.parse_args(argv)
  if args.profile:
    for preset in args.preset:
      profile(preset, args.smoke, steps=min(args.steps, 3), trace_dir=args.trace_dir)
    return 0
  if args.side is None:
    training(args.smoke, presets=args.preset, steps=args.steps)
    return 0
  run = run_jax if args.side == "jax" else run_torch
  for preset in args.preset:
    result = run(preset, args.smoke, args.warmup, args.steps)
    print("RESULT " + json.dumps({"preset": preset, **result}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
