"""What a vLLM client meets besides tools: `structured_outputs`, top_logprobs up to 20 (the
server's --max-logprobs), `stop_reason`, an empty prompt refused, /metrics under vLLM's names,
and `hf export`'s files readable as any written file."""

import json
import os
import re
import stat

import httpx
import jsonschema
import numpy as np
import pytest
from flax import nnx

from atlas_jax import hf
from atlas_jax.config import ModelConfig
from atlas_jax.decoding.guided import GrammarCompiler
from atlas_jax.model import build
from atlas_jax.serving.engine import EngineConfig
from atlas_jax.serving.server import ServerLimits

from .conftest import TINY, byte_model, serving

SCHEMA = {
  "type": "object",
  "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
  "required": ["ok", "n"],
}


@pytest.fixture(scope="module")
def url():
  model, tok = byte_model(2)
  config = EngineConfig(n_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=64)
  with serving(
    model,
    tok,
    config,
    model_name="tiny",
    limits=ServerLimits(max_prompt_tokens=64, max_tokens=64, max_logprobs=20),
    guided=GrammarCompiler(tok, vocab_size=model.cfg.vocab_size, timeout_s=10.0),
  ) as (url, _, _):
    yield url


def post(url, path, body):
  return httpx.post(f"{url}/v1/{path}", json={"model": "tiny", **body}, timeout=60)


# The chat endpoint under -m slow: both read `structured_outputs` through the same request
# fields (test_server_guided sends chat requests with constraints in the default run).
@pytest.mark.parametrize(
  "path", ["completions", pytest.param("chat/completions", marks=pytest.mark.slow)]
)
def test_structured_outputs(url, path):
  base = (
    {"prompt": "x"} if path == "completions" else {"messages": [{"role": "user", "content": "x"}]}
  )
  text = lambda r: (
    r.json()["choices"][0].get("text") or r.json()["choices"][0]["message"]["content"]
  )
  r = post(url, path, base | {"max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}})
  assert r.status_code == 200 and text(r) in ("yes", "no")
  r = post(url, path, base | {"max_tokens": 8, "structured_outputs": {"regex": "[a-c]{3}"}})
  assert re.fullmatch("[a-c]{3}", text(r))
  r = post(url, path, base | {"max_tokens": 40, "structured_outputs": {"json": SCHEMA}})
  jsonschema.validate(json.loads(text(r)), SCHEMA)
  r = post(url, path, base | {"max_tokens": 8, "structured_outputs": {"grammar": "root ::= x"}})
  assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.grammar"
  r = post(url, path, base | {"max_tokens": 8, "structured_outputs": {"choice": []}})
  assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.choice"


def test_twenty_top_logprobs(url):
  body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True}
  r = post(url, "chat/completions", body | {"top_logprobs": 20})
  assert r.status_code == 200, r.text
  for token in r.json()["choices"][0]["logprobs"]["content"]:
    tops = token["top_logprobs"]
    assert len(tops) == 20
    lps = [t["logprob"] for t in tops]
    assert lps == sorted(lps, reverse=True) and token["logprob"] <= lps[0] + 1e-6
  r = post(url, "completions", {"prompt": "x", "max_tokens": 2, "logprobs": 20})
  assert all(len(t) <= 20 for t in r.json()["choices"][0]["logprobs"]["top_logprobs"])
  for path, field in [("chat/completions", "top_logprobs"), ("completions", "logprobs")]:
    bad = (
      body | {"top_logprobs": 21} if field == "top_logprobs" else {"prompt": "x", "logprobs": 21}
    )
    r = post(url, path, bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_max_logprobs_limit_is_checked():
  assert ServerLimits().max_logprobs == 20  # vLLM's default
  with pytest.raises(ValueError, match="serve.limits.max_logprobs"):
    ServerLimits(max_logprobs=21)


def test_stop_reason(url):
  base = {"prompt": "hello", "max_tokens": 12, "temperature": 0}
  free = post(url, "completions", base).json()["choices"][0]
  assert free["stop_reason"] is None
  out = free["text"]
  stop = out[2:4]
  assert len(stop) == 2  # the greedy text is long enough to stop inside
  got = post(url, "completions", base | {"stop": ["zzz", stop]}).json()["choices"][0]
  assert got["finish_reason"] == "stop" and got["stop_reason"] == stop
  assert got["text"] == out[: out.find(stop)]
  # a stop token id: the output's third token
  ids = httpx.post(url + "/tokenize", json={"prompt": out, "add_special_tokens": False}).json()
  token = ids["tokens"][2]
  got = post(url, "completions", base | {"stop_token_ids": [token]}).json()["choices"][0]
  assert got["finish_reason"] == "stop" and got["stop_reason"] == token
  chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12, "temperature": 0}
  text = post(url, "chat/completions", chat).json()["choices"][0]["message"]["content"]
  got = post(url, "chat/completions", chat | {"stop": [text[1:3]]}).json()["choices"][0]
  assert got["stop_reason"] == text[1:3]
  events = []
  body = {"model": "tiny", **base, "stop": [stop], "stream": True}
  with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
    for line in r.iter_lines():
      if line.startswith("data: {"):
        events.append(json.loads(line[6:])["choices"][0])
  assert events[-1]["stop_reason"] == stop and all(e["stop_reason"] is None for e in events[:-1])


@pytest.mark.parametrize(
  "path,body,param",
  [
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": ["a", ""]}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
  ],
)
def test_empty_prompts_are_400s(url, path, body, param):
  r = post(url, path, body)
  assert r.status_code == 400, r.text
  assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_metrics_under_vllm_names(url):
  post(url, "completions", {"prompt": "ab", "max_tokens": 3})
  text = httpx.get(url + "/metrics").text
  values = {}
  for line in text.splitlines():
    if not line.startswith("#"):
      name, value = line.rsplit(" ", 1)
      values[name] = float(value)
  for ours, theirs in [
    ("atlas_prompt_tokens_total", 'vllm:prompt_tokens_total{model_name="tiny"}'),
    ("atlas_generation_tokens_total", 'vllm:generation_tokens_total{model_name="tiny"}'),
    ("atlas_num_requests_running", 'vllm:num_requests_running{model_name="tiny"}'),
    ("atlas_kv_cache_usage_ratio", 'vllm:kv_cache_usage_perc{model_name="tiny"}'),
    (
      "atlas_time_to_first_token_seconds_count",
      'vllm:time_to_first_token_seconds_count{model_name="tiny"}',
    ),
    (
      'atlas_requests_total{finish_reason="length"}',
      'vllm:request_success_total{model_name="tiny",finished_reason="length"}',
    ),
  ]:
    assert values[theirs] == values[ours], theirs
  assert values['vllm:generation_tokens_total{model_name="tiny"}'] >= 3
  assert "# TYPE vllm:e2e_request_latency_seconds histogram" in text
  assert 'vllm:inter_token_latency_seconds_bucket{model_name="tiny",le="+Inf"}' in values


def test_hf_save_writes_files_readable_as_the_umask_allows(tmp_path):
  cfg = ModelConfig(**TINY, n_kv_heads=2)
  old = os.umask(0o022)
  try:
    hf.save(build(cfg, rngs=nnx.Rngs(0)), tmp_path)
    hf.save_tensors({"w": np.zeros(2, np.float32)}, tmp_path / "adapter.safetensors")
  finally:
    os.umask(old)
  for name in ("model.safetensors", "config.json", "adapter.safetensors"):
    assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644, name
