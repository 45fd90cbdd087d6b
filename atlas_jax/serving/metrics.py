"""Serving metrics in the Prometheus text format: counters and histograms, no client library.

Each metric is served twice: under our `atlas_` name, and under vLLM's `vllm:` name with its
`model_name` label (`vllm_names`), so dashboards built for vLLM read this server unchanged.
"""

from __future__ import annotations

import re
import threading

# Seconds; latency buckets from a fast GPU token to a slow CPU prompt.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
  def __init__(self, name: str, help_text: str, buckets=BUCKETS):
    self.name, self.help, self.buckets = name, help_text, buckets
    self.counts = [0] * len(buckets)
    self.total = 0
    self.sum = 0.0

  def observe(self, value: float) -> None:
    for i, edge in enumerate(self.buckets):
      if value <= edge:
        self.counts[i] += 1
    self.total += 1
    self.sum += value

  def render(self) -> list[str]:
    lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
    for edge, count in zip(self.buckets, self.counts):
      lines.append(f'{self.name}_bucket{{le="{edge}"}} {count}')
    lines += [
      f'{self.name}_bucket{{le="+Inf"}} {self.total}',
      f"{self.name}_sum {self.sum:.6f}",
      f"{self.name}_count {self.total}",
    ]
    return lines


class ServingMetrics:
  """Latency histograms and request counters; engine gauges are read at render time."""

  def __init__(self):
    self.lock = threading.Lock()
    self.ttft = Histogram("atlas_time_to_first_token_seconds", "Time to first token.")
    self.itl = Histogram("atlas_inter_token_latency_seconds", "Time between output tokens.")
    self.e2e = Histogram("atlas_e2e_request_latency_seconds", "Arrival to last token.")
    self.requests = {}  # finish_reason -> count
    self.prompt_tokens = 0
    self.generation_tokens = 0

  def finished(self, reason: str, prompt_tokens: int, generation_tokens: int) -> None:
    with self.lock:
      self.requests[reason] = self.requests.get(reason, 0) + 1
      self.prompt_tokens += prompt_tokens
      self.generation_tokens += generation_tokens

  def render(
    self,
    *,
    running: int,
    waiting: int,
    kv_usage: float,
    preemptions: int,
    prefix_queries: int,
    prefix_hits: int,
    drafted: int = 0,
    accepted: int = 0,
    acceptance_length: float = 0.0,
  ) -> str:
    def metric(name, kind, help_text, value):
      return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]

    with self.lock:
      lines = metric("atlas_num_requests_running", "gauge", "Requests in the batch.", running)
      lines += metric("atlas_num_requests_waiting", "gauge", "Requests queued.", waiting)
      lines += metric(
        "atlas_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use.", f"{kv_usage:.6f}"
      )
      lines += metric("atlas_num_preemptions_total", "counter", "Requests preempted.", preemptions)
      lines += metric(
        "atlas_prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
        prefix_queries,
      )
      lines += metric(
        "atlas_prefix_cache_hits_total",
        "counter",
        "Prompt tokens served from the prefix cache.",
        prefix_hits,
      )
      lines += metric(
        "atlas_spec_decode_num_draft_tokens_total",
        "counter",
        "Draft tokens proposed to the model (speculative decoding).",
        drafted,
      )
      lines += metric(
        "atlas_spec_decode_num_accepted_tokens_total",
        "counter",
        "Draft tokens the model accepted.",
        accepted,
      )
      lines += metric(
        "atlas_spec_decode_mean_acceptance_length",
        "gauge",
        "Tokens emitted per speculative round of a request (accepted drafts + 1).",
        f"{acceptance_length:.6f}",
      )
      lines += metric(
        "atlas_prompt_tokens_total",
        "counter",
        "Prompt tokens of finished requests.",
        self.prompt_tokens,
      )
      lines += metric(
        "atlas_generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens
      )
      lines += [
        "# HELP atlas_requests_total Finished requests by reason.",
        "# TYPE atlas_requests_total counter",
      ]
      for reason, count in sorted(self.requests.items()):
        lines.append(f'atlas_requests_total{{finish_reason="{reason}"}} {count}')
      for h in (self.ttft, self.itl, self.e2e):
        lines += h.render()
    return "\n".join(lines) + "\n"


# Our name -> vLLM's (vllm/v1/metrics/loggers.py); histograms by their base name.
VLLM_NAMES = {
  "atlas_num_requests_running": "vllm:num_requests_running",
  "atlas_num_requests_waiting": "vllm:num_requests_waiting",
  "atlas_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",  # a fraction, as vLLM's
  "atlas_num_preemptions_total": "vllm:num_preemptions_total",
  "atlas_prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
  "atlas_prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
  "atlas_spec_decode_num_draft_tokens_total": "vllm:spec_decode_num_draft_tokens_total",
  "atlas_spec_decode_num_accepted_tokens_total": "vllm:spec_decode_num_accepted_tokens_total",
  "atlas_prompt_tokens_total": "vllm:prompt_tokens_total",
  "atlas_generation_tokens_total": "vllm:generation_tokens_total",
  "atlas_requests_total": "vllm:request_success_total",
  "atlas_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
  "atlas_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
  "atlas_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
}
_SAMPLE = re.compile(r"^([a-z_]+?)(_bucket|_sum|_count)?(\{[^}]*\})? (.*)$")


def vllm_names(text: str, model_name: str) -> str:
  """The metrics of `text` (ours, as `render` writes them) under vLLM's names and labels: each
  sample gets `model_name`, and the finish reason is vLLM's `finished_reason` label."""
  label = 'model_name="' + model_name.replace("\\", "\\\\").replace('"', '\\"') + '"'
  out = []
  for line in text.splitlines():
    if line.startswith("# "):
      kind, name, rest = line[2:].split(" ", 2)
      if name in VLLM_NAMES:
        out.append(f"# {kind} {VLLM_NAMES[name]} {rest}")
      continue
    m = _SAMPLE.match(line)
    if m is None:
      continue
    name, suffix, labels, value = m.groups()
    if name not in VLLM_NAMES:
      continue
    inner = (labels or "{}")[1:-1].replace("finish_reason=", "finished_reason=")
    labels = "{" + label + ("," + inner if inner else "") + "}"
    out.append(f"{VLLM_NAMES[name]}{suffix or ''}{labels} {value}")
  return "\n".join(out) + "\n"
