"""Hostile but realistic request bodies against a running server: never a 5xx, never a broken
neighbour. Property-based (hypothesis), bounded in example count, derandomised for CI."""

import json
import math
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atlas_jax.decoding import SamplingParams, generate
from atlas_jax.serving.engine import EngineConfig
from atlas_jax.serving.server import ServerLimits

from .conftest import byte_model, serving

PATHS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def server():
  model, tok = byte_model(2)
  config = EngineConfig(
    runner="ragged",
    n_blocks=96,
    block_size=8,
    max_num_seqs=8,
    max_num_batched_tokens=128,
    prefill_chunk=32,
  )
  limits = ServerLimits(max_prompt_tokens=96, max_tokens=16, max_n=2, max_body_bytes=2048)
  with serving(model, tok, config, "critical", model_name="m", limits=limits) as (url, _, runner):
    yield url, model, tok, runner


# -- strategies ------------------------------------------------------------------------------

SURROGATES = st.sampled_from(["\ud800", "ab\udfffc", "\udc80"])
PRINTABLE = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=30)
JUNK = st.one_of(
  st.none(),
  st.booleans(),
  st.integers(min_value=-(2**70), max_value=2**70),
  st.floats(allow_nan=True, allow_infinity=True),
  PRINTABLE,
  SURROGATES,
  st.lists(st.integers(min_value=-3, max_value=2**33), max_size=4),
  st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)

# Values each field allows; a request starts valid, then a few of its fields are spoilt.
OPTIONAL = {
  "model": PRINTABLE,
  "temperature": st.floats(min_value=0, max_value=2),
  "top_p": st.floats(min_value=0.01, max_value=1),
  "top_k": st.one_of(st.integers(min_value=-1, max_value=50), st.just(2**31 - 1)),
  "min_p": st.floats(min_value=0, max_value=1),
  "presence_penalty": st.floats(min_value=-2, max_value=2),
  "frequency_penalty": st.floats(min_value=-2, max_value=2),
  "repetition_penalty": st.floats(min_value=0.1, max_value=10),
  "n": st.integers(min_value=1, max_value=2),
  "stream": st.booleans(),
  "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
  "stop": st.one_of(PRINTABLE, st.lists(PRINTABLE, max_size=3)),
  "stop_token_ids": st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=3),
  "seed": st.integers(min_value=0, max_value=2**31 - 1),
  "ignore_eos": st.booleans(),
  "user": PRINTABLE,
}
COMPLETION = st.fixed_dictionaries(
  {
    "prompt": st.one_of(
      PRINTABLE, st.lists(st.integers(min_value=0, max_value=258), min_size=1, max_size=40)
    ),
    "max_tokens": st.integers(min_value=1, max_value=8),
  },
  optional={**OPTIONAL, "logprobs": st.integers(min_value=0, max_value=5), "echo": st.just(False)},
)
MESSAGE = st.fixed_dictionaries(
  {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": PRINTABLE},
  optional={"name": PRINTABLE},
)
CHAT = st.fixed_dictionaries(
  {
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "max_completion_tokens": st.integers(min_value=1, max_value=8),
  },
  optional={
    **OPTIONAL,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(min_value=0, max_value=5),
  },
)
NAMES = sorted({*OPTIONAL, "prompt", "messages", "max_tokens", "logprobs", "echo", "bogus"})
SPOIL = st.one_of(
  st.just([]),  # most requests stay valid
  st.just([]),
  st.lists(st.tuples(st.sampled_from(NAMES), JUNK), min_size=1, max_size=2),
)


def spoilt(body: dict, changes: list) -> str:
  for name, value in changes:
    body[name] = value
  # ASCII JSON, as most clients send it: lone surrogates escaped, NaN and Infinity as literals.
  return json.dumps(body, allow_nan=True)


REQUESTS = st.one_of(
  st.tuples(st.just(PATHS[0]), st.builds(spoilt, COMPLETION, SPOIL)),
  st.tuples(st.just(PATHS[1]), st.builds(spoilt, CHAT, SPOIL)),
  st.tuples(st.sampled_from(PATHS), st.binary(max_size=64)),  # not even JSON
  st.tuples(st.sampled_from(PATHS), JUNK.map(lambda v: json.dumps(v, allow_nan=True))),
)


# -- the property ----------------------------------------------------------------------------


def check_response(r: httpx.Response, streamed: bool) -> None:
  assert r.status_code < 500, (r.status_code, r.text[:500])
  if r.status_code >= 400:
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return
  if not streamed:
    assert r.json()["choices"]
    return
  lines = [line for line in r.text.split("\n") if line]
  assert lines[-1] == "data: [DONE]"
  for line in lines[:-1]:
    assert "error" not in json.loads(line.removeprefix("data: ")), line


def stream_once(client, prompt: str) -> str:
  text, lines = "", []
  with client.stream(
    "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 16, "stream": True}
  ) as r:
    assert r.status_code == 200
    for line in r.iter_lines():
      if line.startswith("data: {"):
        event = json.loads(line[6:])
        assert "error" not in event, event
        text += event["choices"][0]["text"]
      lines += [line] if line else []
  assert lines[-1] == "data: [DONE]"
  return text


@pytest.mark.slow  # each field's check is in tests/serving/test_server.py
def test_hostile_bodies_get_4xx_never_5xx_and_a_neighbour_stream_finishes(server):
  url, model, tok, runner = server
  prompt = "def main():"
  want = tok.decode(generate(model, [tok.encode(prompt)], SamplingParams(max_new_tokens=16))[0])
  stop, streams, failures = threading.Event(), [], []

  def neighbour():  # streams back to back for as long as the fuzzing runs
    with httpx.Client(base_url=url, timeout=120) as client:
      while not stop.is_set():
        try:
          streams.append(stream_once(client, prompt))
        except Exception as e:  # reported below, in the test's thread
          failures.append(e)
          return

  thread = threading.Thread(target=neighbour, daemon=True)
  thread.start()
  with httpx.Client(base_url=url, timeout=120) as client:

    @settings(
      max_examples=50,
      deadline=None,
      derandomize=True,
      database=None,
      suppress_health_check=list(HealthCheck),
    )
    @given(REQUESTS)
    def fuzz(request):
      path, body = request
      headers = {"Content-Type": "application/json"}
      r = client.post(path, content=body, headers=headers)
      streamed = r.status_code == 200 and "text/event-stream" in r.headers["content-type"]
      check_response(r, streamed)

    try:
      fuzz()
    finally:
      stop.set()
      thread.join(timeout=120)
  assert not failures, failures
  assert streams and all(s == want for s in streams)  # every neighbour stream intact
  assert httpx.get(url + "/health").json() == {"status": "ok"}
  assert runner.error is None


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e308, 2**63, -(2**63)])
@pytest.mark.parametrize(
  "name", ["temperature", "top_p", "top_k", "seed", "max_tokens", "presence_penalty"]
)
def test_extreme_numbers_in_every_numeric_field(server, name, value):
  url = server[0]
  body = json.dumps({"prompt": "x", "max_tokens": 2, name: value}, allow_nan=True)
  r = httpx.post(url + PATHS[0], content=body, headers={"Content-Type": "application/json"})
  assert r.status_code == 400 and r.json()["error"]["param"] == name
