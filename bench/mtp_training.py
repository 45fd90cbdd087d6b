"""Does multi-token prediction make a better next-token model at equal compute? The same model
trained by train.py with and without a DeepSeek-V3-style MTP module, several seeds each.

    python bench/mtp_training.py              # trains what the cache lacks (~10 min on 2 cores)
    python bench/mtp_training.py --fit-only   # prints the cached results

Equal compute means equal training FLOPs (tokens x FLOPs per token, the MTP module's block,
projection and shared output head counted, as `atlas_jax.plan.compute.train_flops_per_token`
counts them), so the MTP runs see fewer tokens. The comparison is the held-out next-token loss
(train.py's eval leaves the heads out), per seed and as mean and spread. The MTP paper (Gloeckle
et al. 2024) and DeepSeek-V3 report gains that grow with model size and are small or negative for
small models; this ladder's rung is far below theirs, so its result says what MTP does at this
size, not at theirs. Results are cached in bench/results/mtp_training.json; notebook 07 plots them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from scaling import BATCH, ROOT, SEQ, SIZES, flops_per_token, load, machine, save, train_point

RESULTS = ROOT / "bench" / "results" / "mtp_training.json"
SIZE = SIZES[3]  # s4: 0.8M non-embedding parameters
BASE_TOKENS = 524_288  # the plain model's budget: 256 steps of 16 x 128
MTP = ["model.mtp.kind=sequential", "model.mtp.n_predict=1", "model.mtp.loss_weight=0.3"]
SEEDS = [0, 1, 2]


def arms() -> dict[str, tuple[list[str], int]]:
  """Settings and token budget of each arm, the MTP arm's budget cut to equal FLOPs."""
  base, with_mtp = flops_per_token(SIZE), flops_per_token(SIZE, MTP)
  step = BATCH * SEQ
  mtp_tokens = round(BASE_TOKENS * base / with_mtp / step) * step
  return {"next-token only": ([], BASE_TOKENS), "with MTP (D=1)": (MTP, mtp_tokens)}


def run(path: Path, data_cache: Path) -> dict:
  results = load(path)
  results.setdefault("machine", machine())
  for arm, (extra, tokens) in arms().items():
    for seed in SEEDS:
      key = f"{arm} seed {seed}"
      if key in results["runs"]:
        continue
      point = train_point(SIZE, tokens, data_cache, [*extra, f"train.seed={seed}"])
      results["runs"][key] = {"arm": arm, "seed": seed, **point}
      save(path, results)
      print(f"{key}: D={tokens:,} eval loss {point['eval_loss']:.4f}", flush=True)
  return results


def report(results: dict) -> None:
  print(f"{SIZE.name}, equal training FLOPs; {results.get('machine', {})}")
  print("| arm | tokens | FLOPs/token | training FLOPs | eval loss per seed | mean ± sd |")
  print("|---|---:|---:|---:|---|---|")
  by_arm: dict[str, list[dict]] = {}
  for r in results["runs"].values():
    by_arm.setdefault(r["arm"], []).append(r)
  means = {}
  for arm, runs in by_arm.items():
    runs.sort(key=lambda r: r["seed"])
    losses = np.array([r["eval_loss"] for r in runs])
    means[arm] = losses
    r0 = runs[0]
    print(
      f"| {arm} | {r0['tokens']:,} | {r0['flops_per_token']:.3g} | "
      f"{r0['tokens'] * r0['flops_per_token']:.3g} | "
      + ", ".join(f"{x:.4f}" for x in losses)
      + f" | {losses.mean():.4f} ± {losses.std(ddof=1) if len(losses) > 1 else 0:.4f} |"
    )
  if len(means) == 2:
    (a, la), (b, lb) = means.items()
    n = min(len(la), len(lb))
    diff = lb[:n] - la[:n]
    print(
      f"\n{b} minus {a}, seed by seed: "
      + ", ".join(f"{d:+.4f}" for d in diff)
      + f" (mean {diff.mean():+.4f} nats/token)"
    )


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--results", type=Path, default=RESULTS)
  p.add_argument("--fit-only", action="store_true", help="print the cached results only")
  p.add_argument("--data-cache", type=Path, default=ROOT / "checkpoints" / ".data")
  args = p.parse_args(argv)
  results = load(args.results) if args.fit_only else run(args.results, args.data_cache)
  report(results)


if __name__ == "__main__":
  main()
