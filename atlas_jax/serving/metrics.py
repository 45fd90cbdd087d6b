"""Serving metrics in the Prometheus text format: counters and histograms, no client library."""

from __future__ import annotations

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
