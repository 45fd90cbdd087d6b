"""Speculative decoding on trained models: acceptance, target passes per token, tokens/s.

Three models trained with `train.py` on the embedded corpus (byte tokenizer, so one vocabulary):
a target (`configs/spec-target.yaml`), a draft about 20x smaller (`configs/spec-draft.yaml`) and
the target's shape with four parallel MTP heads (`configs/spec-target-mtp.yaml`); the target also
drafts by prompt lookup ("ngram": the tokens that followed the latest n-gram's earlier occurrence
in the row's own prompt and output, no model). Run
directories under `--runs` are reused; missing or unfinished ones are trained (the commands are
printed first). Prompts are windows of the held-out split of the corpus.

For each batch size and for greedy and sampled (temperature 1) decoding, every case runs once to
compile, then all cases run interleaved `--repeat` times; tables give the median. Per case:

* mean acceptance length: tokens a row emits per target pass (accepted drafts + 1);
* target passes per generated token: the decode loop's passes per row over its tokens (plain
  decoding: 1);
* tokens/s, and the speedup: the median over repetitions of speculative tokens/s over the plain
  decoding of the same model in the same repetition (the draft-model and n-gram cases against the
  target, the MTP cases against the MTP model decoding plainly).

    python bench/speculative.py [--runs checkpoints/speculative] [--ks 1,2,4,8] [--batches 1,8]
    python bench/speculative.py --smoke      # toy models trained for two steps: the code paths
    python bench/speculative.py --engine [--engine-guided]   # only the engine table

On a shared machine CPU timings swing with load: compare only runs printed with a low load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import atlas_jax
from atlas_jax.config import load_config
from atlas_jax.data import pipeline
from atlas_jax.data.tokenizer import load_tokenizer
from atlas_jax.decoding import speculative
from atlas_jax.decoding.generate import generate
from atlas_jax.decoding.sampling import SamplingParams
from atlas_jax.training import checkpoint

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
  "target": "configs/spec-target.yaml",
  "draft": "configs/spec-draft.yaml",
  "mtp": "configs/spec-target-mtp.yaml",
}
# --smoke: toy shapes and two training steps, so every code path runs in seconds.
SMOKE_SET = [
  "model.d_model=32",
  "model.n_layers=1",
  "model.n_heads=2",
  "model.n_kv_heads=1",
  "model.ffn_dim=64",
  "train.steps=2",
  "train.batch_size=8",  # divisible by the device count the tests fake (8)
  "train.seq_len=32",
  "train.eval_every=0",
]


def train_command(name: str, runs: Path, smoke: bool) -> list[str]:
  cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / CONFIGS[name])]
  for kv in [f"train.checkpoint_dir={runs / name}"] + (SMOKE_SET if smoke else []):
    cmd += ["--set", kv]
  return cmd + ["--sample-prompt", ""]


def finished(run: Path) -> bool:
  """A run directory whose latest checkpoint is its config's last step."""
  if not checkpoint.is_checkpoint(run):
    return False
  steps = load_config(run / "config.yaml").train.steps
  return checkpoint.manager(run).latest_step() == steps


def ensure_runs(runs: Path, smoke: bool) -> dict[str, Path]:
  """Trains (or resumes) each model whose run directory is missing or unfinished."""
  for name in CONFIGS:
    if finished(runs / name):
      print(f"# reusing {runs / name}")
      continue
    cmd = train_command(name, runs, smoke)
    print("# training:", " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if smoke else None)
    print(f"# trained {name} in {time.perf_counter() - t0:.0f} s", flush=True)
  return {name: runs / name for name in CONFIGS}


def eval_prompts(run: Path, runs: Path, batch: int, length: int, seed: int = 0) -> list[list[int]]:
  """`batch` windows of `length` tokens from the corpus's held-out split."""
  cfg = load_config(run / "config.yaml")
  files = pipeline.token_files(cfg.data, load_tokenizer(cfg.data.tokenizer), runs / ".data")
  tokens = files["eval"][0]
  starts = np.random.default_rng(seed).integers(0, len(tokens) - length, batch)
  return [np.asarray(tokens[s : s + length]).tolist() for s in starts]


def last_eval_loss(run: Path) -> float:
  losses = [
    json.loads(line)["eval_loss"]
    for line in (run / "metrics.jsonl").read_text().splitlines()
    if "eval_loss" in line
  ]
  return losses[-1] if losses else float("nan")


def n_params(model) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model)))


class Case:
  """One way to decode the prompts: plain (draft None) or speculative with k draft tokens."""

  def __init__(self, label: str, model, draft=None, k: int = 0):
    self.label, self.model, self.draft, self.k = label, model, draft, k

  def run(self, prompts, params: list[SamplingParams]):
    """(seconds, SpeculativeStats or None)."""
    t0 = time.perf_counter()
    if self.draft is None:
      generate(self.model, prompts, params)
      return time.perf_counter() - t0, None
    _, _, stats = speculative.speculative_generate(
      self.model, self.draft, prompts, params, stops=[[] for _ in prompts], k=self.k
    )
    return time.perf_counter() - t0, stats


def measure(cases: list[Case], prompts, params, repeat: int, warmed: set) -> list[dict]:
  """Each case once to compile (first time at this batch), then `repeat` interleaved rounds."""
  B = len(prompts)
  for c in cases:
    if (c.label, c.k, B) not in warmed:
      c.run(prompts, params)
      warmed.add((c.label, c.k, B))
  times = {id(c): [] for c in cases}
  stats = {}
  for _ in range(repeat):
    for c in cases:
      seconds, s = c.run(prompts, params)
      times[id(c)].append(seconds)
      stats[id(c)] = s
  n_tokens = sum(p.max_new_tokens for p in params)
  return [
    dict(case=c, tok_s=[n_tokens / t for t in times[id(c)]], stats=stats[id(c)]) for c in cases
  ]


def print_table(rows: list[dict], baselines: dict[int, dict]) -> None:
  print("| draft | k | mean acceptance length | target passes / token | tok/s | speedup |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    c, s = r["case"], r["stats"]
    tok_s = statistics.median(r["tok_s"])
    if s is None:
      print(f"| none ({c.label}) | - | 1.00 | 1.00 | {tok_s:.0f} | 1.00 |")
      continue
    base = baselines[id(c.model)]["tok_s"]
    speedup = statistics.median(t / b for t, b in zip(r["tok_s"], base))
    passes = s.row_rounds / max(s.emitted, 1)
    print(
      f"| {c.label} | {c.k} | {s.mean_acceptance_length:.2f} | {passes:.2f} | {tok_s:.0f} | "
      f"{speedup:.2f} |"
    )


def engine_table(target, drafts: dict, prompts, args, grammar=None) -> None:
  """The serving engine with and without speculation, same requests, interleaved: where the
  batch stops paying for speculation (`EngineConfig.speculative_max_batch`). With `grammar`,
  every request is guided by it (plain: one masked step per token; speculation: the grammar
  walked along each round's drafts)."""
  from atlas_jax.serving.engine import Engine, EngineConfig

  k = args.engine_k
  against = "plain guided steps" if grammar is not None else "plain decode bursts"
  print(
    f"\n## engine: speculation against {against} (k={k}, temperature "
    f"{args.engine_temperature}, prompt "
    f"{args.prompt_len}, {args.new_tokens} new tokens, median of {args.repeat}; load average "
    f"{os.getloadavg()[0]:.2f} before)"
  )
  print("| batch | draft | mean acceptance length | tok/s | plain tok/s | speedup |")
  print("|---|---|---|---|---|---|")
  for B in [int(b) for b in args.engine_batches.split(",")]:
    rows = (prompts * B)[:B]
    params = SamplingParams(
      max_new_tokens=args.new_tokens,
      temperature=args.engine_temperature,
      ignore_eos=grammar is None,  # a grammar ends the output itself (the schema outlasts it)
      guided=grammar,
    )
    Z = 16
    config = EngineConfig(
      n_blocks=B * -(-(args.prompt_len + args.new_tokens + 16) // Z) + 8,
      block_size=Z,
      max_num_seqs=B,
      max_num_batched_tokens=max(B * args.prompt_len, 64),
      prefill_chunk=64,
      num_speculative_tokens=k,
      speculative_max_batch=B,
      guided_speculative_max_batch=B,
    )

    def run(draft, config=config, rows=rows, params=params):
      eos_id = None if grammar is None else grammar.eos_id
      engine = Engine(target, config, draft=draft, eos_id=eos_id)
      t0 = time.perf_counter()
      outs = engine.generate(rows, params)
      assert all(len(o) == params.max_new_tokens for o in outs)  # the same work in every arm
      return len(rows) * params.max_new_tokens / (time.perf_counter() - t0), engine

    for draft in (None, *drafts.values()):
      run(draft)  # compile
    times = {name: [] for name in (None, *drafts)}
    length = {}
    for _ in range(args.repeat):
      for name in times:
        tok_s, engine = run(None if name is None else drafts[name])
        times[name].append(tok_s)
        length[name] = engine.mean_acceptance_length
    plain = times[None]
    for name in drafts:
      speedup = statistics.median(t / b for t, b in zip(times[name], plain))
      print(
        f"| {B} | {name} | {length[name]:.2f} | {statistics.median(times[name]):.0f} | "
        f"{statistics.median(plain):.0f} | {speedup:.2f} |"
      )
  print(f"(load average {os.getloadavg()[0]:.2f} after)")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--runs", help="run directories (default: checkpoints/speculative)")
  p.add_argument("--ks", default="1,2,4,8", help="draft tokens per round, comma-separated")
  p.add_argument("--batches", default="1,8")
  p.add_argument("--prompt-len", type=int, default=64)
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--repeat", type=int, default=3)
  p.add_argument("--modes", default="greedy,sampled", help="greedy and/or sampled (temperature 1)")
  p.add_argument("--smoke", action="store_true", help="toy models trained for two steps")
  p.add_argument(
    "--engine", action="store_true", help="only the engine table (speculation vs bursts by batch)"
  )
  p.add_argument("--engine-batches", default="1,2,4,8")
  p.add_argument("--engine-k", type=int, default=4)
  p.add_argument("--engine-temperature", type=float, default=0.0)
  p.add_argument(
    "--engine-guided",
    action="store_true",
    help="the engine table with every request guided by a JSON schema (bench/guided.py's)",
  )
  args = p.parse_args(argv)
  if args.smoke:
    args.ks, args.batches, args.prompt_len, args.new_tokens, args.repeat = "1,2", "2", 8, 8, 1

  with tempfile.TemporaryDirectory() as tmp:
    runs = Path(tmp) if args.smoke else Path(args.runs or ROOT / "checkpoints" / "speculative")
    dirs = ensure_runs(runs, args.smoke)
    models = {name: checkpoint.load_model(d)[0] for name, d in dirs.items()}
    target, draft, mtp = models["target"], models["draft"], models["mtp"]
    print(
      f"\n# {time.strftime('%Y-%m-%d')} {platform.processor() or platform.machine()}, "
      f"{os.cpu_count()} cores, jax {jax.__version__} ({jax.default_backend()}), "
      f"atlas_jax {atlas_jax.__version__}"
    )
    for name, d in dirs.items():
      c = models[name].cfg
      print(
        f"# {name}: {n_params(models[name]):,} parameters (d={c.d_model} L={c.n_layers} "
        f"F={c.ffn_dim}), eval loss {last_eval_loss(d):.3f} nats/byte"
        + (" (main + MTP heads' weighted loss)" if c.mtp is not None else "")
      )
    if args.engine or args.engine_guided:
      prompts = eval_prompts(dirs["target"], runs, 8, args.prompt_len)
      grammar = None
      if args.engine_guided:
        from guided import SCHEMA  # bench/guided.py: outputs longer than --new-tokens

        from atlas_jax.decoding.guided import GrammarCompiler, spec_from_request

        tok = checkpoint.load_model(dirs["target"])[2]
        compiler = GrammarCompiler(tok, vocab_size=target.cfg.vocab_size)
        grammar = compiler.compile(spec_from_request(guided_json=SCHEMA))
      engine_table(target, {"draft model": draft, "ngram": "ngram"}, prompts, args, grammar)
      return
    ks = [int(k) for k in args.ks.split(",")]
    heads = mtp.mtp.n_draft_heads
    cases = [Case("target", target), Case("mtp model", mtp)]
    cases += [Case("draft model", target, draft, k) for k in ks]
    cases += [Case("mtp", mtp, "mtp", k) for k in ks if k <= heads]
    cases += [Case("ngram", target, "ngram", k) for k in ks]
    if any(k > heads for k in ks):
      print(f"# MTP drafts at most {heads} tokens (one per head): k > {heads} not run")

    warmed: set = set()
    summary = []
    for B in [int(b) for b in args.batches.split(",")]:
      prompts = eval_prompts(dirs["target"], runs, B, args.prompt_len)
      for mode in args.modes.split(","):
        temperature = 0.0 if mode == "greedy" else 1.0
        params = [
          SamplingParams(
            max_new_tokens=args.new_tokens, temperature=temperature, seed=b, ignore_eos=True
          )
          for b in range(B)
        ]
        load0 = os.getloadavg()[0]
        rows = measure(cases, prompts, params, args.repeat, warmed)
        load1 = os.getloadavg()[0]
        print(
          f"\n## batch {B}, {mode} (prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"median of {args.repeat}; load average {load0:.2f} before, {load1:.2f} after)"
        )
        baselines = {id(r["case"].model): r for r in rows if r["stats"] is None}
        print_table(rows, baselines)
        summary += [(B, mode, r, baselines) for r in rows if r["stats"] is not None]

    best = [
      (
        r["stats"].row_rounds / max(r["stats"].emitted, 1),
        statistics.median(
          t / b for t, b in zip(r["tok_s"], baselines[id(r["case"].model)]["tok_s"])
        ),
        f"{r['case'].label} k={r['case'].k} {mode}",
      )
      for B, mode, r, baselines in summary
      if B == 1
    ]
    if best:
      passes = min(best)
      fastest = max(best, key=lambda x: x[1])
      print(
        f"\n# batch 1: fewest target passes / token {passes[0]:.2f} ({passes[2]}; goal <= 0.5), "
        f"best speedup {fastest[1]:.2f}x ({fastest[2]}; goal > 1)"
      )


if __name__ == "__main__":
  main()
