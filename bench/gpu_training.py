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


def random_batches(cfg, n: int):
  import numpy as np

  rng = np.random.default_rng(0)
  B, T = cfg.train.batch_size, cfg.train.seq_len
  return [rng.integers(0, cfg.model.vocab_size, (B, T + 1)).astype(np.int32) for _ in range(n)]


# -- our side ------------------------------------------------------------------------------------


def run_jax(preset: str, smoke: bool, warmup: int, steps: int) -> dict:
  from atlas_jax.training.xla_flags import apply

  added = apply(preset_config(preset, smoke).train.xla_flags)  # before jax starts its backend
  import jax

  from atlas_jax.training.checkpoint import single_device_mesh
  from atlas_jax.training.metrics import flops_per_token, matmul_params, peak_memory_bytes
  from atlas_jax.training.step import make_train_step, make_trainer

  cfg = preset_config(preset, smoke)
  trainer = make_trainer(cfg, mesh=single_device_mesh())
  step = make_train_step(trainer)
  state = trainer.init(jax.random.key(0))
  flops_tok = flops_per_token(cfg.model, matmul_params(state.params), cfg.train.seq_len)
  batches = [{"tokens": b} for b in random_batches(cfg, warmup + steps)]
  t0 = time.perf_counter()
  for b in batches[:warmup]:
    state, metrics = step(state, b)
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  for b in batches[warmup:]:
    state, metrics = step(state, b)
  jax.block_until_ready(metrics)
  seconds = time.perf_counter() - t0
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

  from atlas_jax.training.checkpoint import single_device_mesh
  from atlas_jax.training.step import make_train_step, make_trainer

  cfg = preset_config(preset, smoke)
  trainer = make_trainer(cfg, mesh=single_device_mesh())
  step = make_train_step(trainer)
  state = trainer.init(jax.random.key(0))
  batches = [{"tokens": b} for b in random_batches(cfg, steps + 1)]
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


def torch_model(c, device):
  """The same architecture in PyTorch: pre-norm blocks of GQA attention and a SwiGLU MLP."""
  import torch
  import torch.nn.functional as F
  from torch import nn

  class Block(nn.Module):
    def __init__(self):
      super().__init__()
      D, N, K, H = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
      self.N, self.K, self.H = N, K, H
      self.attn_norm = nn.RMSNorm(D, eps=c.norm_eps)
      self.mlp_norm = nn.RMSNorm(D, eps=c.norm_eps)
      self.wqkv = nn.Linear(D, (N + 2 * K) * H, bias=False)  # one GEMM for q, k and v
      self.wo = nn.Linear(N * H, D, bias=False)
      self.w_gate_up = nn.Linear(D, 2 * c.ffn_dim, bias=False)
      self.w_down = nn.Linear(c.ffn_dim, D, bias=False)

    def forward(self, x, cos, sin):
      B, T, _ = x.shape
      N, K, H = self.N, self.K, self.H
      q, k, v = self.wqkv(self.attn_norm(x)).split([N * H, K * H, K * H], dim=-1)
      q = rope(q.view(B, T, N, H).transpose(1, 2), cos, sin)
      k = rope(k.view(B, T, K, H).transpose(1, 2), cos, sin)
      v = v.view(B, T, K, H).transpose(1, 2)
      o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=K != N)
      x = x + self.wo(o.transpose(1, 2).reshape(B, T, N * H))
      gate, up = self.w_gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
      return x + self.w_down(F.silu(gate) * up)

  def rope(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

  class Model(nn.Module):
    def __init__(self):
      super().__init__()
      self.embed = nn.Embedding(c.vocab_size, c.d_model)
      self.blocks = nn.ModuleList([Block() for _ in range(c.n_layers)])
      self.norm = nn.RMSNorm(c.d_model, eps=c.norm_eps)
      self.head = None if c.tie_embeddings else nn.Linear(c.d_model, c.vocab_size, bias=False)
      H = c.head_dim
      # Plain RoPE frequencies: Llama-3 scaling changes the numbers, not the work.
      inv = 1.0 / (c.rope_theta ** (torch.arange(0, H, 2, dtype=torch.float32) / H))
      self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, tokens, targets):
      T = tokens.shape[1]
      ang = torch.arange(T, device=tokens.device, dtype=torch.float32)[:, None] * self.inv_freq
      cos, sin = ang.cos(), ang.sin()
      x = self.embed(tokens)
      for block in self.blocks:
        x = block(x, cos, sin)
      x = self.norm(x)
      logits = x @ self.embed.weight.T if self.head is None else self.head(x)
      return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

  return Model().to(device)


def run_torch(preset: str, smoke: bool, warmup: int, steps: int) -> dict:
  import torch

  cfg = preset_config(preset, smoke)
  cuda = torch.cuda.is_available() and not smoke
  device = "cuda" if cuda else "cpu"
  torch.manual_seed(0)
  model = torch_model(cfg.model, device)
  t = cfg.train
  opt = torch.optim.AdamW(
    model.parameters(),
    lr=t.learning_rate,
    betas=(t.b1, t.b2),
    weight_decay=t.weight_decay,
    fused=True,
  )
  compiled = torch.compile(model, backend="eager" if smoke else "inductor")
  if cuda:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    attention = sdpa_kernel([SDPBackend.FLASH_ATTENTION])
  else:
    import contextlib

    attention = contextlib.nullcontext()

  def step(batch):
    tokens = torch.from_numpy(batch).to(device, non_blocking=True).long()
    with attention, torch.autocast(device, dtype=torch.bfloat16):
      loss = compiled(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

  sync = torch.cuda.synchronize if cuda else (lambda: None)
  batches = random_batches(cfg, warmup + steps)
  t0 = time.perf_counter()
  for b in batches[:warmup]:
    loss = step(b)
  sync()
  compile_s = time.perf_counter() - t0
  if cuda:
    torch.cuda.reset_peak_memory_stats()
  t0 = time.perf_counter()
  for b in batches[warmup:]:
    loss = step(b)
  sync()
  seconds = time.perf_counter() - t0
  return {
    "tokens_per_s": steps * t.batch_size * t.seq_len / seconds,
    "peak_memory": torch.cuda.max_memory_allocated() if cuda else None,
    "loss": float(loss),
    "warmup_s": compile_s,
    "settings": f"torch {torch.__version__}, bf16 autocast, SDPA flash, fused AdamW, "
    f"torch.compile ({'eager' if smoke else 'inductor'})",
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
