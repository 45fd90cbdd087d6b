"""PNG charts of a plan (matplotlib, imported only when plotting).

`save_charts(plan, directory)` writes kv_cache.png, kv_context.png, training_memory.png and
activations.png and returns their paths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_GB = 1e9


def _pyplot():
  try:
    import matplotlib
  except ImportError as e:
    raise ImportError(
      "--plot needs matplotlib: pip install 'atlas-jax[plot]' (or pip install matplotlib)"
    ) from e
  matplotlib.use("Agg")  # files only; no display needed
  import matplotlib.pyplot as plt

  return plt


def _alternatives(kv: dict[str, Any]) -> list[dict[str, Any]]:
  """The other attention kinds, without the one that is the model's own."""
  own = (kv["attention"], kv["bytes_per_token"])
  return [a for a in kv["alternatives"] if (a["kind"], a["bytes_per_token"]) != own]


def kv_chart(plan: dict[str, Any], ax) -> None:
  kv = plan["kv_cache"]
  alts = _alternatives(kv)
  names = [f"{kv['attention']}\n(this model)"] + [a["kind"] for a in alts]
  values = [kv["bytes_per_token"]] + [a["bytes_per_token"] for a in alts]
  bars = ax.bar(names, [v / 1e3 for v in values], color=["C3"] + ["C0"] * (len(values) - 1))
  ax.bar_label(bars, [f"{v / 1e3:,.0f}" for v in values], fontsize=8)
  ax.set_ylabel("KV cache per token (kB)")
  ax.set_title(f"{plan['name']}: KV cache per token ({kv['dtype_bytes']}-byte)")


def kv_context_chart(plan: dict[str, Any], ax) -> None:
  kv, dev, B = plan["kv_cache"], plan["device"], plan["inputs"]["batch"]
  T = plan["inputs"]["seq_len"]
  lengths = [2**i for i in range(8, 21) if 2**i <= max(4 * T, 1024)]
  rows = [(f"{kv['attention']} (this model)", kv["bytes_per_token"])]
  rows += [(a["kind"], a["bytes_per_token"]) for a in _alternatives(kv)]
  for label, per_token in rows:
    ax.plot(lengths, [per_token * n * B / _GB for n in lengths], marker=".", label=label)
  ax.axhline(dev["hbm_bytes"] / _GB, color="k", ls="--", lw=1, label=f"{dev['name']} memory")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("tokens per sequence")
  ax.set_ylabel(f"KV cache for {B} sequence(s) (GB)")
  ax.set_title("KV cache against context length")
  ax.legend(fontsize=8)


def training_chart(plan: dict[str, Any], ax) -> None:
  rows = plan["training"]["strategies"]
  names = [r["strategy"] for r in rows]
  bottom = [0.0] * len(rows)
  for key, label in (
    ("params", "parameters"),
    ("grads", "gradients"),
    ("opt_state", "Adam state"),
    ("activations_peak", f"activations ({plan['inputs']['remat']})"),
  ):
    values = [(r[key] or 0) / _GB for r in rows]  # None: the batch does not split (no bar)
    ax.bar(names, values, bottom=bottom, label=label)
    bottom = [b + v for b, v in zip(bottom, values)]
  dev = plan["device"]
  ax.axhline(dev["hbm_bytes"] / _GB, color="k", ls="--", lw=1, label=f"{dev['name']} memory")
  ax.set_ylabel("GB per device")
  ax.set_title(f"Training memory per device ({plan['inputs']['devices']} devices)")
  ax.legend(fontsize=8)


def activation_chart(plan: dict[str, Any], ax) -> None:
  rows = plan["activations"]
  names = [r["policy"] for r in rows]
  ax.bar(names, [r["saved"] / _GB for r in rows], label="saved for the backward pass")
  ax.bar(
    names,
    [r["recompute"] / _GB for r in rows],
    bottom=[r["saved"] / _GB for r in rows],
    label="recomputed at a time",
  )
  ax.set_ylabel("GB per device")
  ax.set_title("Activations per remat policy")
  if not rows:  # the batch does not split under the selected strategy
    training = plan["training"]
    sel = next(s for s in training["strategies"] if s["strategy"] == training["selected"])
    ax.set_title(f"Activations: n/a ({sel['constraint']})", fontsize=8)
    return
  ax.legend(fontsize=8)


CHARTS = {
  "kv_cache.png": kv_chart,
  "kv_context.png": kv_context_chart,
  "training_memory.png": training_chart,
  "activations.png": activation_chart,
}


def save_charts(plan: dict[str, Any], directory: str | Path) -> list[Path]:
  """Writes one PNG per chart into `directory` (created if missing); returns the paths."""
  plt = _pyplot()
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  paths = []
  for filename, draw in CHARTS.items():
    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(plan, ax)
    fig.tight_layout()
    path = directory / filename
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)
  return paths
