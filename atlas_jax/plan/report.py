"""The planner's figures as tables for people: aligned text for a terminal, or markdown.

Sizes are printed in decimal units (1 GB = 10^9 bytes, as accelerator memory is sold) beside the
exact count; `--json` carries the exact numbers only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def fmt_bytes(n: float) -> str:
  """1.34 GB, 131 kB, 512 B (decimal units)."""
  for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.3g} {unit}"
  return f"{int(n)} B"


def fmt_count(n: float) -> str:
  """8.03 B, 110 M, 1.2 k: parameter and token counts."""
  for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.3g} {unit}"
  return f"{n:g}"


def fmt_seconds(s: float) -> str:
  if s >= 86400:
    return f"{s / 86400:.3g} days"
  if s >= 3600:
    return f"{s / 3600:.3g} h"
  if s >= 1:
    return f"{s:.3g} s"
  return f"{s * 1e3:.3g} ms"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, markdown: bool) -> str:
  """A table; the first column left-aligned, the others right-aligned."""
  cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
  if markdown:
    lines = ["| " + " | ".join(cells[0]) + " |"]
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in cells[1:]]
    return "\n".join(lines)
  widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

  def line(row):
    first = row[0].ljust(widths[0])
    rest = [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
    return "  " + "  ".join([first, *rest])

  rule = "  " + "  ".join("-" * w for w in widths)
  return "\n".join([line(cells[0]), rule, *map(line, cells[1:])])


def _section(title: str, body: str, *, markdown: bool) -> str:
  return f"### {title}\n\n{body}\n" if markdown else f"{title}\n{body}\n"


def _pipeline(plan: dict[str, Any], *, markdown: bool) -> str:
  pp, c = plan["pipeline"], plan["compute"]
  kind = pp["schedule"] + (f", {pp['repeats']} repeats" if pp["repeats"] > 1 else "")
  rows = [
    ("schedule", f"{pp['stages']} stages x {pp['microbatches']} micro-batches ({kind})"),
    ("iterations per accumulation step (U r + p - 1)", f"{pp['iterations']}"),
    ("bubble (p - 1) / (U r + p - 1)", f"{pp['bubble']:.1%}"),
    (
      "step time at the MFU, without / with the bubble",
      f"{fmt_seconds(pp['step_seconds_without_bubble'])} / {fmt_seconds(pp['step_seconds'])}",
    ),
    ("time to train with the bubble", fmt_seconds(c["seconds_with_bubble"])),
    (
      "ppermute bytes per step (a stage sends, fwd + bwd)",
      fmt_bytes(pp["ppermute_bytes_per_step"]),
    ),
  ]
  body = table(("pipeline", ""), rows, markdown=markdown)
  body += (
    f"\n\nGPipe keeps every micro-batch's stage inputs (and what the remat policy saves) until "
    f"the backward pass: the activations above are one stage's, {pp['iterations']} iterations "
    f"of {pp['microbatch_rows']}-row micro-batches"
  )
  if pp["constraint"] is not None:
    body += f"\nn/a: {pp['constraint']}"
  return body


def render(plan: dict[str, Any], *, markdown: bool = False) -> str:
  """Every section of a plan as tables."""
  m, inp, dev = plan["model"], plan["inputs"], plan["device"]
  T = inp["seq_len"]
  heads = (
    f"MLA latent {m['kv_lora_rank']} + rope {m['qk_rope_head_dim']}, {m['n_heads']} heads"
    if m["attention"] == "MLA"
    else f"{m['n_heads']} heads / {m['n_kv_heads']} kv heads of {m['head_dim']}"
  )
  out = [
    f"{plan['name']}: {m['attention']}, {m['n_layers']} layers, d_model {m['d_model']}, "
    f"{heads}, ffn {m['ffn_dim']}, vocab {m['vocab_size']}"
    + (
      f", {m['moe_layers']} MoE layers of {m['n_experts']} experts (top {m['top_k']}, "
      f"{m['router']}) of ffn {m['expert_ffn_dim']}"
      + (f" + shared {m['shared_ffn_dim']}" if m["shared_ffn_dim"] else "")
      if "n_experts" in m
      else ""
    )
    + (f", {m['mtp_heads']} MTP head(s)" if "mtp_heads" in m else ""),
    f"plan: seq_len {T}, batch {inp['batch']}, {inp['devices']} x {dev['name']} "
    f"({dev['peak_bf16_flops'] / 1e12:g} TFLOP/s bf16, {fmt_bytes(dev['hbm_bytes'])}, "
    f"{fmt_bytes(dev['hbm_bytes_per_s'])}/s), precision {inp['precision']}, "
    f"remat {inp['remat']}, strategy {inp['strategy']}"
    + (f" x tensor {inp['tensor']}" if inp["tensor"] > 1 else "")
    + (f" x expert {inp['expert']}" if inp["expert"] > 1 else "")
    + (f" x pipeline {inp['pipeline']}" if inp["pipeline"] > 1 else "")
    + f", {inp['attention']} attention",
  ]
  out += [f"note: {n}" for n in plan["notes"]]
  out.append("")
  if markdown:
    out = [line + "  " if line else line for line in out]

  p = plan["params"]
  rows = [
    ("total", f"{p['total']:,}", fmt_count(p["total"])),
    ("embedding", f"{p['embed']:,}", fmt_count(p["embed"])),
    ("output head", f"{p['lm_head']:,}", fmt_count(p["lm_head"])),
    ("blocks", f"{p['blocks']:,}", fmt_count(p["blocks"])),
    ("per layer", f"{p['per_layer']:,}", fmt_count(p["per_layer"])),
    ("MTP heads", f"{p['mtp']:,}", fmt_count(p["mtp"])),
    ("in matmuls", f"{p['matmul']:,}", fmt_count(p["matmul"])),
  ]
  if p["experts"]:
    rows += [
      ("routed experts", f"{p['experts']:,}", fmt_count(p["experts"])),
      ("active per token", f"{p['active']:,}", fmt_count(p["active"])),
      ("active in matmuls (the N of 6N)", f"{p['matmul_active']:,}", fmt_count(p["matmul_active"])),
    ]
  body = table(("parameters", "count", ""), rows, markdown=markdown)
  out.append(_section("Parameters", body, markdown=markdown))

  kv = plan["kv_cache"]
  rows = [
    (
      f"{kv['attention']} (this model)",
      f"{kv['bytes_per_token']:,}",
      fmt_bytes(kv["bytes_per_sequence"]),
      fmt_bytes(kv["bytes_batch"]),
      "1.00x",
    )
  ]
  for alt in kv["alternatives"]:
    shape = (
      f"{alt['kv_heads']} kv head{'s' if alt['kv_heads'] > 1 else ''}"
      if "kv_heads" in alt
      else f"latent {alt['kv_lora_rank']} + {alt['rope_dim']}"
    )
    rows.append(
      (
        f"{alt['kind']} ({shape})",
        f"{alt['bytes_per_token']:,}",
        fmt_bytes(alt["bytes_per_sequence"]),
        fmt_bytes(alt["bytes_per_token"] * T * inp["batch"]),
        f"{alt['vs_model']:.2f}x",
      )
    )
  body = table(
    ("attention", "bytes/token", f"per sequence ({T})", f"x {inp['batch']} sequences", "vs model"),
    rows,
    markdown=markdown,
  )
  fmt = kv.get("kv_cache_dtype", "auto")
  what = f"{kv['dtype_bytes']}-byte cache" if fmt == "auto" else f"{fmt} cache (scaled 8-bit codes)"
  body += (
    f"\n\n{what}; paged in blocks of {kv['block_size']}: "
    f"{kv['blocks_per_sequence']} blocks, {fmt_bytes(kv['paged_bytes_per_sequence'])} per sequence"
  )
  out.append(_section("KV cache", body, markdown=markdown))

  rows, constraints = [], []
  for s in plan["training"]["strategies"]:
    mesh = s["mesh"]
    split = s["constraint"] is None  # else the batch does not split: no activations
    if not split:
      constraints.append(f"{s['strategy']}: {s['constraint']}")
    rows.append(
      (
        s["strategy"] + (" *" if s["strategy"] == plan["training"]["selected"] else ""),
        f"{mesh['data']}x{mesh['fsdp']}x{mesh['expert']}x{mesh['stage']}x{mesh['tensor']}",
        s["micro_batch"] if split else "n/a",
        fmt_bytes(s["params"])
        + (f" ({fmt_bytes(s['expert_params'])} experts)" if s["expert_params"] else ""),
        fmt_bytes(s["grads"]),
        fmt_bytes(s["opt_state"]),
        fmt_bytes(s["activations_peak"]) if split else "n/a",
        fmt_bytes(s["total"]) if split else "n/a",
        ("yes" if s["fits"] else "no") if split else "n/a",
      )
    )
  body = table(
    (
      "strategy",
      "mesh d x f x e x p x t",
      "micro-batch",
      "params",
      "grads",
      "Adam",
      f"activations ({inp['remat']})",
      "total",
      f"fits {dev['name']}",
    ),
    rows,
    markdown=markdown,
  )
  body += (
    "\n\nfloat32 master weights, gradients and Adam moments: 16 bytes per parameter before "
    "sharding; activations at their peak (saved + one block recomputed)"
  )
  body += "".join(f"\nn/a: {c}" for c in constraints)
  tr = plan["training"]
  if tr.get("lora_rank"):
    sel = next(s for s in tr["strategies"] if s["strategy"] == tr["selected"])
    body += (
      f"\nLoRA rank {tr['lora_rank']}: {tr['trainable_params']:,} trainable parameters (adapters), "
      + (f"the base's projections in {q}, " if (q := tr.get("base_quantization")) else "")
      + "gradients and Adam moments for them only: "
      f"{sel['bytes_per_param']:.2f} bytes per model parameter on a device ({tr['selected']})"
    )
  out.append(_section("Training memory per device", body, markdown=markdown))

  sel = next(s for s in plan["training"]["strategies"] if s["strategy"] == inp["strategy"])
  if sel["constraint"] is None:
    rows = [
      (a["policy"], fmt_bytes(a["saved"]), fmt_bytes(a["recompute"]), fmt_bytes(a["peak"]))
      for a in plan["activations"]
    ]
    body = table(("remat", "saved", "recomputed at a time", "peak"), rows, markdown=markdown)
    title = f"Activations per device ({sel['micro_batch']} x {T} tokens, {inp['strategy']})"
  else:
    body, title = f"n/a: {sel['constraint']}", f"Activations per device ({inp['strategy']})"
  out.append(_section(title, body, markdown=markdown))

  if plan["pipeline"] is not None:
    out.append(_section("Pipeline", _pipeline(plan, markdown=markdown), markdown=markdown))

  c = plan["compute"]
  rows = [
    ("FLOPs per token", f"{c['flops_per_token']:.4g}"),
    ("  6N", f"{c['flops_per_token_6n']:.4g}"),
    ("  attention", f"{c['attention_flops_per_token']:.4g}"),
    ("Chinchilla-optimal tokens (20 / parameter)", fmt_count(c["chinchilla_tokens"])),
    ("tokens trained", fmt_count(c["tokens"])),
    ("training FLOPs", f"{c['train_flops']:.4g}"),
    (
      f"time on {inp['devices']} x {dev['name']} at {c['mfu']:.0%} MFU",
      fmt_seconds(c["seconds"]),
    ),
  ]
  body = table(("training", "FLOPs, tokens, time"), rows, markdown=markdown)
  out.append(_section("Compute", body, markdown=markdown))

  d = plan["decode"]
  rows = []
  seen = set()
  for bound in d.values():
    # One row per (devices, batch): on one device the whole group's row is the device's.
    if not isinstance(bound, dict) or (bound["devices"], bound["batch"]) in seen:
      continue
    seen.add((bound["devices"], bound["batch"]))
    rows.append(
      (
        f"{bound['devices']} device{'s' if bound['devices'] > 1 else ''}, batch {bound['batch']}",
        fmt_bytes(bound["bytes_per_step"]),
        fmt_seconds(bound["seconds_per_step"]),
        f"{bound['tokens_per_s']:,.0f}",
        "memory" if bound["memory_bound"] else "compute",
      )
    )
  body = table(
    ("decoding", "bytes read per step", "step time", "tokens/s ceiling", "bound by"),
    rows,
    markdown=markdown,
  )
  body += (
    f"\n\nweights {fmt_bytes(d['weight_bytes'])} (read once per step; of a mixture of experts, "
    "the experts the batch reaches), cache "
    f"{fmt_bytes(d['cache_bytes_per_sequence'])} per sequence at {T} tokens"
  )
  out.append(_section("Decode ceiling", body, markdown=markdown))

  sv = plan["serving"]
  heads = "" if sv["kv_heads_served"] is None else f", kv heads served {sv['kv_heads_served']}"
  rows = [
    (
      "weights per device"
      + {"keep": " (FP8 codes and scales kept)", "dequantize": " (FP8 dequantized)"}.get(
        sv.get("fp8_weights"), ""
      ),
      fmt_bytes(sv["weight_bytes_per_device"]),
    ),
    ("of which attention", fmt_bytes(sv["attention_weight_bytes_per_device"])),
    ("cache per token per device", fmt_bytes(sv["kv_bytes_per_token_per_device"])),
    (
      f"pool per device ({sv['memory_utilization']:.0%} of {dev['name']} less weights)",
      fmt_bytes(sv["pool_bytes_per_device"]),
    ),
    (
      "tokens held per replica",
      f"{sv['pool_tokens_per_replica']:,} ({sv['sequences_per_replica']:,} sequences at {T})",
    ),
  ]
  for bnd in sv["bounds"]:
    net = bnd["network_seconds"]
    rows.append(
      (
        f"decode, batch {bnd['batch']}: bytes per device per step, all-reduce + logits' "
        "all-gather, tokens/s",
        f"{fmt_bytes(bnd['bytes_per_step_per_device'])}, "
        f"{fmt_bytes(bnd['all_reduce_bytes_per_device'])} + "
        f"{fmt_bytes(bnd['all_gather_bytes_per_device'])}"
        + ("" if net is None else f" ({fmt_seconds(net)})")
        + f", {bnd['tokens_per_s']:,.0f}",
      )
    )
    if sv["hosts_per_replica"] > 1:
      rows.append(
        (
          f"decode, batch {bnd['batch']}: all-reduce bytes leaving each host per step",
          fmt_bytes(bnd["all_reduce_bytes_leaving_each_host"]),
        )
      )
  title = f"Serving on {sv['data']} x {sv['tensor']} (data x tensor){heads}"
  if sv["hosts"] > 1:
    title += (
      f", {sv['hosts']} hosts of {sv['devices_per_host']} devices"
      f" ({sv['hosts_per_replica']} per replica)"
    )
  out.append(
    _section(title, table(("serving", "per device"), rows, markdown=markdown), markdown=markdown)
  )
  return "\n".join(out)
