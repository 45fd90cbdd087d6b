"""The README's "What each technique buys": the planner on named configs, beside what this
repository measured.

    python bench/techniques.py      # prints the section the README carries

The planner columns are computed here; the measured column quotes BENCHMARKS.md (where each
figure's command and machine are), and `tests/test_bench_techniques.py` checks that the README
holds exactly this output and that every quoted number is in BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses

from atlas_jax.plan import compute, memory, params
from atlas_jax.plan.models import REFERENCE_MODELS
from atlas_jax.plan.planner import PlanInputs, make_plan
from atlas_jax.plan.report import fmt_bytes, fmt_count

# Measured ratios quoted from BENCHMARKS.md: (text, the numbers as they appear there).
MEASURED = {
  "kv_cache": ("23.4x faster per token at n = 512 (tiny model, CPU)", ("23.4",)),
  "paged": (
    "98.4% of reserved slots used vs 23.2% pre-allocated; 4.31x the concurrent sequences; "
    "through the engine on the same pool, 5.4x the sequences per step, 1.00x the tokens/s on a "
    "2-core CPU",
    ("98.4", "23.2", "4.31x", "5.4x", "1.00x"),
  ),
  "prefix": (
    "63.8% of prompt tokens served from the cache; 69.9 vs 45.3 concurrent sequences",
    ("63.8", "69.9", "45.3"),
  ),
  "flash": (
    "residuals exact against the train step (`tests/plan`); compiled forward + backward "
    "temporaries at 8192 tokens: 120.4 MiB vs 6,160.3 MiB, 2x vs 4x per doubling of T",
    ("120.4", "6,160.3"),
  ),
  "remat": (
    "small.yaml: selective keeps 10% of `none` for +3.6% FLOPs, full 1% for +27%",
    ("190.4", "1926.0", "1.036x", "1.267x"),
  ),
  "scaling": (
    "15 train.py runs, 27k-1.6M parameters: L = 2.50 + 44.6 / N^0.425 + 1808 / D^0.546, "
    "optimum 205 to 59 tokens per parameter at 4.2e10-9.9e14 FLOPs (notebook 07)",
    ("0.425", "0.546", "205", "59"),
  ),
  "mtp": (
    "s4 (738k parameters), equal training FLOPs, 3 seeds: next-token loss +0.335 nats/token "
    "with MTP (0.270 of it from the fewer tokens)",
    ("0.335", "0.270"),
  ),
  "dispatch": (
    "dropless dispatch on 8 devices: all-gather + reduce-scatter moves 4.92 MB per device, an "
    "all-to-all 50.43 MB (E 64, k 6)",
    ("4.92", "50.43"),
  ),
}
EXACT = "exact against the allocated arrays (`tests/plan`)"


def _model(name: str):
  return REFERENCE_MODELS[name].model


def _kv(name: str, seq_len: int = 4096, precision: str = "bf16") -> dict:
  inputs = PlanInputs(seq_len=seq_len, batch=1, devices=1, precision=precision)
  return make_plan(_model(name), inputs)["kv_cache"]


def _alt(kv: dict, kind: str) -> dict:
  return next(a for a in kv["alternatives"] if a["kind"] == kind)


def rows() -> list[tuple[str, str, str, str]]:
  """(technique, configuration, what the planner says, measured here)."""
  out = []

  m8 = _model("llama-3-8b")
  n = 4096
  cached = compute.decode_flops_per_token(m8, n + 1)
  recompute = (n + 1) * (
    compute.decode_flops_per_token(m8, 0) + compute.attention_flops_per_token(m8, n + 1)
  )
  out.append(
    (
      "KV cache",
      "Llama-3-8B, token 4097",
      f"{recompute / cached:,.0f}x fewer FLOPs than recomputing the prefix",
      MEASURED["kv_cache"][0],
    )
  )

  kv70 = _kv("llama-2-70b", precision="fp16")
  mha70 = _alt(kv70, "MHA")
  out.append(
    (
      "GQA (8 kv heads)",
      "Llama-2-70B, 4096 tokens, fp16",
      f"{fmt_bytes(kv70['bytes_per_sequence'])} per sequence, not "
      f"{fmt_bytes(mha70['bytes_per_sequence'])} (MHA): {mha70['vs_model']:.0f}x",
      EXACT,
    )
  )
  kv8 = _kv("llama-3-8b")
  out.append(
    (
      "GQA (8 kv heads)",
      "Llama-3-8B, 4096 tokens",
      f"{fmt_bytes(kv8['bytes_per_sequence'])} per sequence, {_alt(kv8, 'MHA')['vs_model']:.0f}x "
      "less than MHA",
      EXACT,
    )
  )
  v3 = _kv("deepseek-v3")
  out.append(
    (
      "MLA (latent 512 + rope 64)",
      "DeepSeek-V3, 4096 tokens",
      f"{v3['bytes_per_token']:,} B/token: {_alt(v3, 'MHA')['vs_model']:.1f}x less than MHA, "
      f"{_kv('llama-3-70b')['bytes_per_token'] / v3['bytes_per_token']:.1f}x less than "
      "Llama-3-70B (GQA-8)",
      EXACT,
    )
  )
  out.append(
    (
      "Paged KV cache",
      "blocks of 16 tokens",
      "at most 15 slots per sequence unused, whatever the length",
      MEASURED["paged"][0],
    )
  )
  out.append(
    ("Prefix caching", "a shared 256-token system prompt", "stored once", MEASURED["prefix"][0])
  )

  def act(policy: str, attention: str = "flash") -> float:
    return memory.activation_bytes(
      m8, policy=policy, batch=1, seq_len=8192, compute_bytes=2, attention=attention
    ).saved

  out.append(
    (
      "FlashAttention",
      "Llama-3-8B training, 1 x 8192 tokens, no remat",
      f"saved activations {fmt_bytes(act('none', 'flash'))}, not "
      f"{fmt_bytes(act('none', 'xla'))} with the [N, T, S] probabilities",
      MEASURED["flash"][0],
    )
  )
  out.append(
    (
      "Remat",
      "same, FlashAttention",
      f"none {fmt_bytes(act('none'))}, selective {fmt_bytes(act('selective'))}, "
      f"full {fmt_bytes(act('full'))}, every_k {fmt_bytes(act('every_k'))}",
      MEASURED["remat"][0],
    )
  )

  m7 = _model("llama-2-7b")
  dp = memory.state_bytes(m7, strategy="dp", devices=1).total
  z8 = memory.state_bytes(m7, strategy="zero3", devices=8).total
  z64 = memory.state_bytes(m7, strategy="zero3", devices=64).total
  out.append(
    (
      "Mixed-precision AdamW",
      "Llama-2-7B",
      f"16 bytes per parameter: {fmt_bytes(dp)} of weights, gradients and moments",
      "exact against the trainer's state (`tests/plan`)",
    )
  )
  out.append(
    (
      "ZeRO-3",
      "Llama-2-7B on 8 / 64 devices",
      f"{fmt_bytes(z8)} / {fmt_bytes(z64)} per device (1/{dp / z8:.0f}, 1/{dp / z64:.0f})",
      "exact against the sharded state on 8 devices (`tests/plan`)",
    )
  )
  v3 = _model("deepseek-v3")
  pc = params.counts(v3)
  dense = 6.0 * (pc.matmul + pc.mtp)
  sparse = 6.0 * (pc.matmul_active + pc.mtp_active)
  out.append(
    (
      "Mixture of experts",
      "DeepSeek-V3, 256 routed experts, top-8",
      f"{fmt_count(pc.active)} of {fmt_count(pc.inference)} parameters per token: "
      f"{dense / sparse:.1f}x fewer weight FLOPs than a dense model of its size",
      "total exact against the modules by `jax.eval_shape`, active within the published 37B "
      "(`tests/plan`)",
    )
  )
  one = memory.state_bytes(v3, strategy="zero1", devices=64)
  ep8 = memory.state_bytes(v3, strategy="zero1", devices=64, expert=8)
  out.append(
    (
      "Expert parallelism",
      "DeepSeek-V3, 64 devices, ZeRO-1, 8-way expert axis",
      f"routed experts {fmt_bytes(ep8.experts)} per device, not {fmt_bytes(one.experts)}",
      MEASURED["dispatch"][0] + " (`bench/moe.py`)",
    )
  )
  m8_params = params.counts(m8).total
  out.append(
    (
      "Compute-optimal scaling",
      "Llama-3-8B",
      f"Chinchilla: {compute.chinchilla_tokens(m8_params) / 1e9:.0f}B training tokens "
      f"({compute.CHINCHILLA_TOKENS_PER_PARAM} per parameter)",
      MEASURED["scaling"][0],
    )
  )
  with_mtp = compute.train_flops_per_token(v3, 4096)
  without = compute.train_flops_per_token(dataclasses.replace(v3, mtp=None), 4096)
  out.append(
    (
      "Multi-token prediction",
      "DeepSeek-V3, one MTP module",
      f"+{with_mtp / without - 1:.1%} training FLOPs per token",
      MEASURED["mtp"][0],
    )
  )
  return out


def techniques_markdown() -> str:
  lines = [
    "| technique | configuration | what the planner says | measured here |",
    "|---|---|---|---|",
  ]
  lines += [f"| {' | '.join(row)} |" for row in rows()]
  return "\n".join(lines)


if __name__ == "__main__":
  print(techniques_markdown())
