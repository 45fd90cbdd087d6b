"""The HTTP server end to end on loopback: the openai client, SSE streams, errors, metrics, load."""

import asyncio
import dataclasses
import json
import logging
import socket
import time

import httpx
import jax
import jax.numpy as jnp
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
    (json.dumps({"prompt": "x", "model": "gpt-4"}), 404, "the model 'gpt-4' does not exist"),
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

  def guard(program, n_draws):
    def call(state, pool, x, *args):
      seeds, steps = np.asarray(x.seed_B).tolist(), np.asarray(x.step_B).tolist()
      calls.append(seeds)
      # The fault: any call in which the row with seed 13 draws its second token or later.
      if any(seed == 13 and i + n_draws > 1 for seed, i in zip(seeds, steps)):
        raise OverflowError("injected fault")
      return program(state, pool, x, *args)

    return call

  K = engine.config.decode_burst  # draws per burst call
  monkeypatch.setattr(
    engine,
    "programs",
    dataclasses.replace(
      original,
      forward_sample=guard(original.forward_sample, 1),
      decode_burst=guard(original.decode_burst, K),
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


# -- OpenAI / vLLM request compatibility ---------------------------------------------------------


AUTH = {"Authorization": f"Bearer {KEY}"}


def call(server, body, path="/v1/completions"):
  r = httpx.post(server[0] + path, json=body, headers=AUTH, timeout=120)
  assert r.status_code == 200, r.text
  return r.json()


def test_unknown_fields_are_ignored_with_one_warning(server, caplog):
  body = {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "store": False}
  body |= {"metadata": {"a": "b"}, "service_tier": "auto", "parallel_tool_calls": True}
  with caplog.at_level(logging.WARNING, logger="atlas_jax.serving"):
    r = call(server, body)
  assert r["choices"][0]["text"] == expected(server[1], server[2], "def f(x):", 4)
  lines = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
  assert lines == ["request fields ignored: metadata, parallel_tool_calls, service_tier, store"]
  # The fields it uses are still checked.
  r = httpx.post(
    server[0] + "/v1/completions", json={**body, "min_tokens": "2"}, headers=AUTH, timeout=120
  )
  assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


def test_without_a_seed_each_request_draws_its_own(server):
  body = {"prompt": "ab", "max_tokens": 12, "temperature": 1.0}
  texts = {call(server, body)["choices"][0]["text"] for _ in range(2)}
  assert len(texts) == 2
  seeded = {call(server, {**body, "seed": 9})["choices"][0]["text"] for _ in range(2)}
  assert len(seeded) == 1


def test_logit_bias_moves_the_argmax(server):
  model, tok = server[1], server[2]
  r = call(server, {"prompt": "ab", "max_tokens": 4, "logit_bias": {str(ord("z")): 100}})
  assert r["choices"][0]["text"] == "zzzz"
  ids = tok.encode("ab")
  first = generate(model, [ids], SamplingParams(max_new_tokens=1))[0][0]
  biased = SamplingParams(max_new_tokens=4, logit_bias={first: -100})
  want = generate(model, [ids], biased, eos_id=tok.eos_id)[0]
  assert want[0] != first
  r = call(server, {"prompt": "ab", "max_tokens": 4, "logit_bias": {str(first): -100}})
  assert r["choices"][0]["text"] == tok.decode(want)
  bad = httpx.post(
    server[0] + "/v1/completions",
    json={"prompt": "ab", "logit_bias": {"300": 1}},
    headers=AUTH,
    timeout=120,
  )
  assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_min_tokens_holds_eos_back(server):
  eos = {str(server[2].eos_id): 100}  # eos is always the argmax
  r = call(server, {"prompt": "ab", "max_tokens": 8, "logit_bias": eos})
  assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (1, "stop")
  r = call(server, {"prompt": "ab", "max_tokens": 8, "logit_bias": eos, "min_tokens": 3})
  assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (4, "stop")


def test_include_stop_str_in_output(server):
  greedy = expected(server[1], server[2], "def f(x):", 16)
  pairs = (greedy[i : i + 2] for i in range(1, len(greedy) - 1))
  stop = next(p for p in pairs if p.isascii() and p.isprintable())
  at = greedy.find(stop)
  body = {"prompt": "def f(x):", "max_tokens": 16, "temperature": 0, "stop": [stop]}
  assert call(server, body)["choices"][0]["text"] == greedy[:at]
  body["include_stop_str_in_output"] = True
  assert call(server, body)["choices"][0]["text"] == greedy[: at + len(stop)]


def test_a_list_of_prompts_gets_n_choices_each_in_order(server):
  model, tok = server[1], server[2]
  want = [expected(model, tok, p, 5) for p in ("ab", "cd") for _ in range(2)]
  for prompt in (["ab", "cd"], [tok.encode("ab"), tok.encode("cd")]):
    r = call(server, {"prompt": prompt, "max_tokens": 5, "temperature": 0, "n": 2})
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in r["choices"]] == want
    assert r["usage"]["prompt_tokens"] == 4 and r["usage"]["completion_tokens"] == 20
    streamed = {}
    with httpx.stream(
      "POST",
      server[0] + "/v1/completions",
      json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "n": 2, "stream": True},
      headers=AUTH,
      timeout=120,
    ) as s:
      for line in s.iter_lines():
        if line.startswith("data: {"):
          for c in json.loads(line[6:])["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert [streamed[i] for i in range(4)] == want
  # All or none: a bad second prompt queues nothing.
  bad = httpx.post(
    server[0] + "/v1/completions",
    json={"prompt": [[97], [999]], "max_tokens": 2},
    headers=AUTH,
    timeout=120,
  )
  assert bad.status_code == 400 and "prompt 1" in bad.json()["error"]["message"]
  engine, deadline = server[3], time.time() + 5
  while engine.has_unfinished() and time.time() < deadline:
    time.sleep(0.05)
  assert not engine.has_unfinished() and engine.allocator.stats().n_used == 0


def test_echo_with_logprobs_returns_the_prompts_log_softmax(server):
  model, tok = server[1], server[2]
  greedy = expected(model, tok, "abc", 3)
  body = {"prompt": "abc", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
  choice = call(server, body)["choices"][0]
  assert choice["text"] == "abc" + greedy
  lp = choice["logprobs"]
  assert lp["tokens"][:3] == ["a", "b", "c"] and len(lp["tokens"]) == 6
  assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
  logp = jax.nn.log_softmax(model(jnp.asarray([tok.encode("abc")]))[0], axis=-1)
  want = [float(logp[0, ord("b")]), float(logp[1, ord("c")])]
  np.testing.assert_allclose(lp["token_logprobs"][1:3], want, atol=1e-5)
  assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])  # keyed by text: may collide
  assert lp["text_offset"] == [0, 1, 2, 3, 4, 5]  # one byte, one character, each


def test_text_offset_counts_characters_of_the_tokens_before(server):
  lp = call(server, {"prompt": "ab", "max_tokens": 6, "logprobs": 0})["choices"][0]["logprobs"]
  lengths = np.cumsum([0] + [len(t) for t in lp["tokens"]])[:-1]
  assert lp["text_offset"] == lengths.tolist()


def test_content_as_text_parts(server):
  body = {"max_tokens": 4, "temperature": 0}
  plain = call(server, {**body, "messages": [{"role": "user", "content": "hi\nyou"}]}, CHAT)
  parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "you"}]
  got = call(server, {**body, "messages": [{"role": "user", "content": parts}]}, CHAT)
  assert got["choices"][0]["message"] == plain["choices"][0]["message"]
  image = [{"type": "image_url", "image_url": {"url": "x"}}]
  r = httpx.post(
    server[0] + CHAT,
    json={**body, "messages": [{"role": "user", "content": image}]},
    headers=AUTH,
    timeout=120,
  )
  assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.0"


CHAT = "/v1/chat/completions"


def test_tokenize_and_detokenize_round_trip(server):
  tok = server[2]
  r = call(server, {"prompt": "héllo", "return_token_strs": True}, "/tokenize")
  assert r["tokens"] == tok.encode("héllo") and r["count"] == 6 and r["max_model_len"] == 128
  assert call(server, {"tokens": r["tokens"]}, "/detokenize") == {"prompt": "héllo"}
  chat = call(server, {"messages": [{"role": "user", "content": "hi"}]}, "/tokenize")
  assert chat["tokens"] == tok.encode("user: hi\nassistant:")
  r = httpx.post(server[0] + "/detokenize", json={"tokens": [1, 259]}, timeout=120)
  assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_the_model_is_found_by_its_id(server):
  r = httpx.get(server[0] + "/v1/models/tiny", headers=AUTH, timeout=120)
  assert r.json()["id"] == "tiny"
  r = httpx.get(server[0] + "/v1/models/gpt-4", headers=AUTH, timeout=120)
  assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
