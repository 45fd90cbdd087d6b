"""The HTTP server end to end on loopback: the openai client, SSE streams, errors, metrics, load."""

import asyncio
import dataclasses
import json
import socket
import time

import httpx
import numpy as np
import openai
import pytest

from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.serving.engine import EngineConfig
from atlas_jax.serving.server import ServerLimits

from .conftest import byte_model, serving

KEY = "test-key"


@pytest.fixture(scope="module")
def server():
  model, tok = byte_model(1)
  config = EngineConfig(
    n_blocks=160, block_size=8, max_num_seqs=16, max_num_batched_tokens=128, prefill_chunk=32
  )
  limits = ServerLimits(max_prompt_tokens=64, max_tokens=32, max_n=2, max_body_bytes=4096)
  with serving(model, tok, config, model_name="tiny", limits=limits, api_key=KEY) as (url, e, _):
    yield url, model, tok, e


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
    # Fields past what the engine's step holds are refused before they reach it.
    (json.dumps({"prompt": "x", "top_k": 2**40}), 400, "invalid value for 'top_k'"),
    (json.dumps({"prompt": "x", "stop_token_ids": [2**31]}), 400, "'stop_token_ids.0'"),
    (b'{"prompt": "x", "temperature": NaN}', 400, "'temperature': Input should be a finite"),
    # Text no tokenizer can encode (a lone surrogate), in any string field.
    (b'{"prompt": "ab\\ud800"}', 400, "'prompt': the text cannot be encoded as UTF-8"),
    (b'{"prompt": "x", "stop": ["\\udfff"]}', 400, "'stop.0': the text cannot be encoded"),
    (b'{"prompt": "x", "model": "\\ud800"}', 400, "'model': the text cannot be encoded"),
    # Body-parse errors: bytes that are not UTF-8, nesting past the parser, not an object.
    (b"\xff\xfe", 400, "malformed JSON body"),
    (b"[" * 3000, 400, "malformed JSON body"),
    (b"[1, 2]", 400, "the body must be a JSON object"),
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


def test_chat_text_that_cannot_be_encoded(server):
  body = {"messages": [{"role": "user", "content": "hi \ud83d"}]}
  r = httpx.post(
    server[0] + "/v1/chat/completions",
    content=json.dumps(body),  # ASCII JSON with the surrogate escaped, as a client would send it
    headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
  )
  assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"


@pytest.mark.parametrize(
  "method, path, status",
  [("GET", "/nope", 404), ("GET", "/v1/models/x", 404), ("GET", "/v1/completions", 405)],
)
def test_routing_errors_have_openai_shape(server, method, path, status):
  r = httpx.request(method, server[0] + path, headers={"Authorization": f"Bearer {KEY}"})
  assert r.status_code == status
  assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def _request(sock, body: bytes, path="/v1/completions", extra=b"") -> bytes:
  head = (
    f"POST {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {KEY}\r\n"
    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
  ).encode()
  sock.sendall(head + extra + b"\r\n" + body)


def _response(sock) -> tuple[int, dict, bytes]:
  """One HTTP/1.1 response read off a raw socket: (status, headers, body)."""
  data = b""
  while b"\r\n\r\n" not in data:
    chunk = sock.recv(65536)
    if not chunk:
      raise ConnectionError(f"closed after {data!r}")
    data += chunk
  head, body = data.split(b"\r\n\r\n", 1)
  lines = head.decode("latin-1").split("\r\n")
  headers = dict((k.strip().lower(), v.strip()) for k, v in (x.split(":", 1) for x in lines[1:]))
  while len(body) < int(headers.get("content-length", 0)):
    chunk = sock.recv(65536)
    if not chunk:
      raise ConnectionError("closed mid-body")
    body += chunk
  return int(lines[0].split()[1]), headers, body


def test_the_connection_stays_usable_after_a_4xx(server):
  host, port = server[0].removeprefix("http://").split(":")
  with socket.create_connection((host, int(port)), timeout=60) as sock:
    for bad in (b'{"prompt": "\\ud800"}', b"{oops", b'{"prompt": "x", "top_k": 1e999}'):
      _request(sock, bad)
      status, headers, body = _response(sock)
      assert status == 400 and headers.get("connection") != "close"
      assert json.loads(body)["error"]["type"] == "invalid_request_error"
    _request(sock, json.dumps({"prompt": "ab", "max_tokens": 2}).encode())
    status, _, body = _response(sock)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2


def test_a_chunked_body_is_cut_off_at_the_limit(server):
  # No Content-Length to check up front: the limit (4096) must hold while the body is read.
  host, port = server[0].removeprefix("http://").split(":")
  with socket.create_connection((host, int(port)), timeout=60) as sock:
    sock.sendall(
      b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
      + f"Authorization: Bearer {KEY}\r\n".encode()
      + b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    for _ in range(3):  # 3 x 2000 bytes, and the body never ends: only the limit can answer
      sock.sendall(b"7d0\r\n" + b" " * 2000 + b"\r\n")
    status, headers, body = _response(sock)
  assert status == 413 and "4096 bytes" in json.loads(body)["error"]["message"]
  assert headers["connection"] == "close"  # the rest of the body is still on its way
  assert httpx.get(server[0] + "/health").json()["status"] == "ok"


def test_a_request_failing_in_the_engine_fails_alone(server, monkeypatch):
  url, model, tok, engine = server
  original = engine.programs
  calls = []

  def guard(program, seed_arg, step_arg, n_draws):
    def call(state, pool, *args):
      seeds, steps = np.asarray(args[seed_arg]).tolist(), np.asarray(args[step_arg]).tolist()
      calls.append(seeds)
      # The fault: any call in which the row with seed 13 draws its second token or later.
      if any(seed == 13 and i + n_draws > 1 for seed, i in zip(seeds, steps)):
        raise OverflowError("injected fault")
      return program(state, pool, *args)

    return call

  K = engine.config.decode_burst  # draws per burst call
  monkeypatch.setattr(
    engine,
    "programs",
    dataclasses.replace(
      original,
      forward_sample=guard(original.forward_sample, 5, 6, 1),
      decode_burst=guard(original.decode_burst, 3, 4, K),
    ),
  )

  async def stream(client, body):
    texts, errors, lines = {}, [], []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
      assert r.status_code == 200
      async for line in r.aiter_lines():
        lines += [line] if line else []
        if line.startswith("data: {"):
          event = json.loads(line[6:])
          if "error" in event:
            errors.append(event["error"])
          for c in event.get("choices", []):
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert lines[-1] == "data: [DONE]"
    return texts, errors

  async def main():
    async with httpx.AsyncClient(
      base_url=url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}
    ) as client:
      other = asyncio.create_task(stream(client, {"prompt": "def f(x):", "max_tokens": 32}))
      # n=2: choice 0 (seed 12) and choice 1 (seed 13) are admitted in the same step, so
      # they decode their second tokens in the same call.
      both = await stream(client, {"prompt": "import os", "max_tokens": 32, "n": 2, "seed": 12})
      return await other, both

  (other, other_errors), (both, errors) = asyncio.run(main())
  assert other_errors == [] and other[0] == expected(model, tok, "def f(x):", 32)
  assert both[0] == expected(model, tok, "import os", 32)  # greedy: the seed does not matter
  assert len(errors) == 1 and "OverflowError: injected fault" in errors[0]["message"]
  assert any(13 in seeds and 12 in seeds for seeds in calls)  # batched, then isolated
  assert httpx.get(url + "/health").json() == {"status": "ok"}


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
