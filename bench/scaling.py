"""Scaling laws measured with the real trainer: a ladder of models trained by train.py on the
stdlib corpus, L(N, D) = E + A / N^alpha + B / D^beta fitted by least squares, and the
compute-optimal split of a FLOP budget between parameters and tokens that the fit implies.

    python bench/scaling.py               # trains what the cache lacks (~25 min on 2 cores), fits
    python bench/scaling.py --fit-only    # refits and prints the cached results
    python bench/scaling.py --smoke --results /tmp/s.json   # two tiny sizes, a few steps

Every point is its own train.py run (`python train.py --config configs/tiny.yaml --set ...`,
the command stored beside its result), with the cosine schedule ending at that run's token
budget, as in Chinchilla's fixed-budget runs: a checkpoint taken halfway through a longer run
would sit higher on its schedule and overstate the loss at that budget. The loss is the held-out
next-token loss (nats/token) that train.py reports, on the same eval documents for every run.

N is Kaplan's non-embedding count: the transformer blocks' parameters, leaving out the
embedding table and the output head (at these widths the 1,024-token vocabulary's tables are
most of a small model, and counting them bends the power law). D is training tokens. The
compute-optimal split takes C = 6ND. Results are cached in bench/results/scaling.json with the
date, machine and versions; notebook 07 plots them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "scaling.json"
PRESET = "configs/tiny.yaml"  # data, tokenizer (bpe:1024), batch 16 x 128, learning rate
BATCH, SEQ = 16, 128

# Published fits, for comparison (Hoffmann et al. 2022, approach 3; Kaplan et al. 2020).
CHINCHILLA = dict(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
CHINCHILLA_TOKENS_PER_PARAM = 20
KAPLAN = dict(alpha_N=0.076, alpha_D=0.095)


@dataclasses.dataclass(frozen=True)
class Size:
  """One rung: a Llama-family model with 32-dim heads."""

  name: str
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  ffn_dim: int

  def sets(self) -> list[str]:
    fields = dataclasses.asdict(self)
    del fields["name"]
    return [f"model.{k}={v}" for k, v in fields.items()]

  def model_config(self):
    from atlas_jax.config import load_config

    return load_config(str(ROOT / PRESET), self.sets()).model


# 30x in parameters end to end (non-embedding), widths and depths growing together.
SIZES = [
  Size("s1", 32, 2, 1, 1, 96),
  Size("s2", 64, 2, 2, 1, 176),
  Size("s3", 96, 3, 3, 1, 256),
  Size("s4", 128, 4, 4, 2, 352),
  Size("s5", 192, 4, 6, 2, 512),
]
TOKENS = [262_144, 524_288, 1_048_576]  # 128, 256 and 512 steps of 16 x 128 tokens
SMOKE_SIZES, SMOKE_TOKENS = SIZES[:2], [BATCH * SEQ * 8]


def non_embedding_params(size: Size) -> int:
  from atlas_jax.plan.params import counts

  return counts(size.model_config()).blocks


def flops_per_token(size: Size, extra: list[str] = ()) -> float:
  """Training FLOPs per token of the model `train.py` builds (MTP heads counted when set)."""
  from atlas_jax.config import load_config
  from atlas_jax.plan.compute import train_flops_per_token

  cfg = load_config(str(ROOT / PRESET), size.sets() + list(extra))
  return train_flops_per_token(cfg.model, cfg.train.seq_len)


def command(size: Size, tokens: int, run_dir: Path, data_cache: Path, extra=()) -> list[str]:
  """The train.py command of one point: `tokens` tokens, cosine schedule over them, 8 evals."""
  steps = tokens // (BATCH * SEQ)
  sets = size.sets() + [
    f"train.steps={steps}",
    f"train.warmup_steps={max(8, steps // 20)}",
    f"train.log_every={max(1, steps // 8)}",
    f"train.eval_every={max(1, steps // 8)}",
    "train.eval_batches=16",
    "train.checkpoint_every=0",
    "train.keep_checkpoints=1",
    f"train.checkpoint_dir={run_dir}",
    *extra,
  ]
  args = [sys.executable, "train.py", "--config", PRESET, "--sample-prompt", ""]
  args += ["--data-cache", str(data_cache)]
  for s in sets:
    args += ["--set", s]
  return args


def shown(args: list[str], run_dir: Path, data_cache: Path) -> str:
  """The command as a user would type it (no scratch paths)."""
  words = ["python" if a == sys.executable else a for a in args]
  words = [w.replace(str(run_dir), "checkpoints/scaling/RUN") for w in words]
  words = [w.replace(str(data_cache), "checkpoints/.data") for w in words]
  return shlex.join(words)


def train_point(size: Size, tokens: int, data_cache: Path, extra=()) -> dict:
  """Runs train.py for one (size, tokens[, extra settings]) point and reads its metrics."""
  with tempfile.TemporaryDirectory(prefix="scaling-") as tmp:
    run_dir = Path(tmp) / "run"
    args = command(size, tokens, run_dir, data_cache, extra)
    start = time.perf_counter()
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
      raise RuntimeError(f"{shown(args, run_dir, data_cache)} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(run_dir, ignore_errors=True)
  evals = [r for r in records if "eval_loss" in r]
  return {
    "size": size.name,
    "tokens": tokens,
    "non_embedding_params": non_embedding_params(size),
    "flops_per_token": flops_per_token(size, extra),
    "eval_loss": evals[-1]["eval_loss"],
    "curve": [[r["step"] * BATCH * SEQ, r["eval_loss"]] for r in evals],
    "train_loss": records[-1]["loss"],
    "seconds": round(seconds, 1),
    "command": shown(args, run_dir, data_cache),
  }


def machine() -> dict:
  import jax

  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
  return {
    "date": time.strftime("%Y-%m-%d"),
    "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    "jax": jax.__version__,
    "python": platform.python_version(),
    "load_average_at_start": load,
  }


def load(path: Path) -> dict:
  return json.loads(path.read_text()) if path.exists() else {"runs": {}}


def save(path: Path, results: dict) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(results, indent=1) + "\n")


def run_ladder(path: Path, sizes: list[Size], budgets: list[int], data_cache: Path) -> dict:
  """Trains every (size, budget) point the results at `path` lack, saving after each."""
  results = load(path)
  results.setdefault("machine", machine())
  for size in sizes:
    for tokens in budgets:
      key = f"{size.name}-{tokens}"
      if key in results["runs"]:
        continue
      point = train_point(size, tokens, data_cache)
      results["runs"][key] = point
      save(path, results)
      print(
        f"{key}: N={point['non_embedding_params']:,} D={tokens:,} eval loss "
        f"{point['eval_loss']:.4f} ({point['seconds']:.0f} s)",
        flush=True,
      )
  return results


# The fit.


@dataclasses.dataclass(frozen=True)
class Fit:
  E: float
  A: float
  B: float
  alpha: float
  beta: float
  rms_log_error: float  # root-mean-square of log(predicted) - log(measured)

  def loss(self, N, D):
    N, D = np.asarray(N, float), np.asarray(D, float)
    return self.E + self.A / N**self.alpha + self.B / D**self.beta

  def optimal(self, C: float) -> tuple[float, float]:
    """The (N, D) minimising the loss at compute C = 6ND (Hoffmann et al.'s closed form)."""
    a, b = self.alpha, self.beta
    G = (a * self.A / (b * self.B)) ** (1 / (a + b))
    N = G * (C / 6) ** (b / (a + b))
    return N, C / 6 / N

  def tokens_per_param(self, C: float) -> float:
    N, D = self.optimal(C)
    return D / N


def fit(N, D, L, *, starts: int = 64, seed: int = 0) -> Fit:
  """L(N, D) = E + A/N^alpha + B/D^beta by least squares on log L, from many starting points.

  The terms are fitted as exponentials (E = e^e, A = e^a, B = e^b) so every one stays positive,
  and the residual is taken in log space, as Hoffmann et al. do, so each point weighs the same
  whatever its loss; the best of `starts` local solutions is kept (the surface has flat valleys
  where A/N^alpha trades against E).
  """
  from scipy.optimize import least_squares

  N, D, L = (np.asarray(x, float) for x in (N, D, L))
  logN, logD, logL = np.log(N), np.log(D), np.log(L)

  def residual(p):
    e, a, b, alpha, beta = p
    terms = np.stack([np.full_like(logN, e), a - alpha * logN, b - beta * logD])
    m = terms.max(axis=0)
    return m + np.log(np.exp(terms - m).sum(axis=0)) - logL

  rng = np.random.default_rng(seed)
  best = None
  for _ in range(starts):
    p0 = [
      rng.uniform(-1, np.log(L.min())),
      rng.uniform(0, 8),
      rng.uniform(0, 8),
      rng.uniform(0.05, 1.0),
      rng.uniform(0.05, 1.0),
    ]
    bounds = ([-10, -10, -10, 0.0, 0.0], [5, 30, 30, 3.0, 3.0])
    sol = least_squares(residual, p0, bounds=bounds)
    if best is None or sol.cost < best.cost:
      best = sol
  e, a, b, alpha, beta = best.x
  rms = float(np.sqrt(np.mean(best.fun**2)))
  return Fit(float(np.exp(e)), float(np.exp(a)), float(np.exp(b)), float(alpha), float(beta), rms)


def points(results: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  runs = list(results["runs"].values())
  return (
    np.array([r["non_embedding_params"] for r in runs], float),
    np.array([r["tokens"] for r in runs], float),
    np.array([r["eval_loss"] for r in runs], float),
  )


def report(results: dict) -> Fit:
  runs = results["runs"]
  sizes = sorted({r["size"] for r in runs.values()})
  budgets = sorted({r["tokens"] for r in runs.values()})
  print(f"held-out loss (nats/token) by size and tokens; {results.get('machine', {})}")
  print("| size | N (non-embedding) | " + " | ".join(f"D={d:,}" for d in budgets) + " |")
  print("|---|---:|" + "---:|" * len(budgets))
  for s in sizes:
    row = {r["tokens"]: r for r in runs.values() if r["size"] == s}
    n = next(iter(row.values()))["non_embedding_params"]
    cells = [f"{row[d]['eval_loss']:.4f}" if d in row else "-" for d in budgets]
    print(f"| {s} | {n:,} | " + " | ".join(cells) + " |")
  N, D, L = points(results)
  f = fit(N, D, L)
  print(
    f"\nfit: L = {f.E:.3f} + {f.A:.4g} / N^{f.alpha:.3f} + {f.B:.4g} / D^{f.beta:.3f}"
    f"   (rms log error {f.rms_log_error:.4f}, {len(L)} points)"
  )
  c = CHINCHILLA
  print(
    f"Chinchilla (approach 3): L = {c['E']} + {c['A']} / N^{c['alpha']} + {c['B']} / D^{c['beta']}"
    f"; Kaplan: alpha_N {KAPLAN['alpha_N']}, alpha_D {KAPLAN['alpha_D']}"
  )
  published = Fit(**CHINCHILLA, rms_log_error=0.0)
  print(
    f"(the published approach-3 fit itself gives {published.tokens_per_param(5.76e23):.0f} tokens "
    f"per parameter at Gopher's 5.76e23 FLOPs; the rule of ~{CHINCHILLA_TOKENS_PER_PARAM} is the "
    "paper's approaches 1 and 2, 67B parameters on 1.5T tokens at that budget)"
  )
  flops = sorted(6 * N * D)
  for C in (flops[0], flops[len(flops) // 2], flops[-1], 1e21):
    n_opt, d_opt = f.optimal(C)
    print(
      f"compute-optimal at C = {C:.3g} FLOPs: N = {n_opt:,.0f}, D = {d_opt:,.0f}, "
      f"{d_opt / n_opt:.1f} tokens per parameter (Chinchilla: ~{CHINCHILLA_TOKENS_PER_PARAM})"
    )
  return f


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--results", type=Path, default=RESULTS)
  p.add_argument("--fit-only", action="store_true", help="fit the cached results, train nothing")
  p.add_argument("--smoke", action="store_true", help="two tiny sizes, a few steps")
  p.add_argument("--data-cache", type=Path, default=ROOT / "checkpoints" / ".data")
  args = p.parse_args(argv)
  if not args.fit_only:
    sizes, budgets = (SMOKE_SIZES, SMOKE_TOKENS) if args.smoke else (SIZES, TOKENS)
    run_ladder(args.results, sizes, budgets, args.data_cache)
  results = load(args.results)
  if len(results["runs"]) >= 6:
    report(results)
  else:
    for key, r in results["runs"].items():
      print(f"{key}: eval loss {r['eval_loss']:.4f}  ({r['command']})")


if __name__ == "__main__":
  main()
