"""The HTTP server end to end on loopback: the openai client, SSE streams, errors, metrics, load."""

import asyncio
import json
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from flax import nnx

from atlas_jax.config import ModelConfig
from atlas_jax.data.tokenizer import ByteTokenizer
from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.model.transformer import Transformer
from atlas_jax.serving.engine import Engine, EngineConfig
from atlas_jax.serving.server import EngineRunner, ServerLimits, build_app

KEY = "test-key"


@pytest.fixture(scope="module")
def server():
  tok = ByteTokenizer()
  cfg = ModelConfig(
    vocab_size=tok.vocab_size,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=64,
    max_seq_len=128,
    init_std=0.3,
  )
  model = Transformer(cfg, rngs=nnx.Rngs(1))
  engine = Engine(
    model,
    EngineConfig(
      n_blocks=160, block_size=8, max_num_seqs=16, max_num_batched_tokens=128, prefill_chunk=32
    ),
    eos_id=tok.eos_id,
    detokenize=tok.decode,
  )
  runner = EngineRunner(engine)
  app = build_app(
    runner,
    encode=tok.encode,
    decode=tok.decode,
    model_name="tiny",
    limits=ServerLimits(max_prompt_tokens=64, max_tokens=32, max_n=2, max_body_bytes=4096),
    api_key=KEY,
  )
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
  thread = threading.Thread(target=srv.run, daemon=True)
  thread.start()
  while not srv.started:
    time.sleep(0.05)
  yield f"http://127.0.0.1:{port}", model, tok, engine
  srv.should_exit = True
  thread.join(timeout=10)
  runner.shutdown()


def expected(model, tok, prompt, n):
  ids = generate(model, [tok.encode(prompt)], SamplingParams(max_new_tokens=n), eos_id=tok.eos_id)
  return tok.decode(ids[0])


def test_openai_client_completions_and_chat(server):
  url, model, tok, _ = server
  client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
  assert [m.id for m in client.models.list().data] == ["tiny"]
  r = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, temperature=0)
  assert r.choices[0].text == expected(model, tok, "def f(x):", 8)
  assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
  streamed = "".join(
    c.choices[0].text
    for c in client.completions.create(
      model="tiny", prompt="def f(x):", max_tokens=8, temperature=0, stream=True
    )
  )
  assert streamed == r.choices[0].text
  chat = client.chat.completions.create(
    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
  )
  assert chat.choices[0].message.content == expected(model, tok, "user: hi\nassistant:", 6)
  deltas = [
    c.choices[0].delta.content or ""
    for c in client.chat.completions.create(
      model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
    )
  ]
  assert "".join(deltas) == chat.choices[0].message.content
  seeded = [
    client.completions.create(model="tiny", prompt="ab", max_tokens=8, temperature=1.0, seed=5)
    .choices[0]
    .text
    for _ in range(2)
  ]
  assert seeded[0] == seeded[1]
  lp = client.completions.create(model="tiny", prompt="ab", max_tokens=3, logprobs=2)
  assert len(lp.choices[0].logprobs.token_logprobs) == 3
  assert all(len(t) <= 2 for t in lp.choices[0].logprobs.top_logprobs)


def test_sse_ends_with_done(server):
  url = server[0]
  with httpx.stream(
    "POST",
    url + "/v1/completions",
    headers={"Authorization": f"Bearer {KEY}"},
    json={"prompt": "x", "max_tokens": 4, "stream": True},
  ) as r:
    lines = [line for line in r.iter_lines() if line]
  assert r.headers["content-type"].startswith("text/event-stream")
  assert lines[-1] == "data: [DONE]"
  assert all(line.startswith("data: {") for line in lines[:-1])


@pytest.mark.parametrize(
  "body, status, match",
  [
    (b"{not json", 400, "malformed JSON"),
    (json.dumps({"prompt": "x", "bogus": 1}), 400, "unknown field 'bogus'"),
    (json.dumps({"prompt": "x", "max_tokens": "5"}), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "temperature": 9}), 400, "temperature"),
    (json.dumps({"prompt": "x", "max_tokens": 33}), 400, "exceeds the limit 32"),
    (json.dumps({"prompt": "x", "n": 3}), 400, "n=3"),
    (json.dumps({"prompt": "x" * 65}), 400, "the limit is 64"),
    (json.dumps({"prompt": "x" * 5000}), 413, "4096 bytes"),
    (json.dumps({"max_tokens": 3}), 400, "prompt"),
  ],
)
def test_bad_requests_get_openai_errors(server, body, status, match):
  url = server[0]
  r = httpx.post(
    url + "/v1/completions",
    content=body,
    headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
  )
  assert r.status_code == status
  assert match in r.json()["error"]["message"]
  assert httpx.get(url + "/health").json()["status"] == "ok"  # still serving


def test_api_key_and_metrics(server):
  url = server[0]
  assert httpx.get(url + "/v1/models").status_code == 401
  text = httpx.get(url + "/metrics").text
  for name in (
    "atlas_time_to_first_token_seconds_bucket",
    "atlas_inter_token_latency_seconds",
    "atlas_e2e_request_latency_seconds_count",
    "atlas_num_requests_running",
    "atlas_num_requests_waiting",
    "atlas_kv_cache_usage_ratio",
    "atlas_num_preemptions_total",
    "atlas_prefix_cache_hits_total",
  ):
    assert name in text


def test_64_concurrent_streams(server):
  url, model, tok, engine = server
  rng = np.random.default_rng(0)
  prompts = [
    "".join(chr(c) for c in rng.integers(97, 123, int(n))) for n in rng.integers(2, 40, 64)
  ]
  want = generate(
    model, [tok.encode(p) for p in prompts], SamplingParams(max_new_tokens=12), eos_id=tok.eos_id
  )

  async def one(client, prompt):
    text, done = "", False
    async with client.stream(
      "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "stream": True}
    ) as r:
      assert r.status_code == 200
      async for line in r.aiter_lines():
        if line == "data: [DONE]":
          done = True
        elif line.startswith("data: "):
          text += json.loads(line[6:])["choices"][0]["text"]
    assert done
    return text

  async def main():
    async with httpx.AsyncClient(
      base_url=url,
      timeout=120,
      headers={"Authorization": f"Bearer {KEY}"},
      limits=httpx.Limits(max_connections=64),
    ) as client:
      return await asyncio.gather(*(one(client, p) for p in prompts))

  got = asyncio.run(main())
  assert got == [tok.decode(w) for w in want]  # none lost, none crossed
  deadline = time.time() + 5
  while engine.has_unfinished() and time.time() < deadline:
    time.sleep(0.05)
  s = engine.allocator.stats()
  assert s.n_used == 0 and s.n_free + s.n_cached == s.n_blocks
