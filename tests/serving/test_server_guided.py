"""Guided decoding over HTTP: response_format and the guided_* fields on both endpoints, with the
openai client and raw bodies; every bad constraint is a 400 naming its field, never a hang."""

import json
import re

import httpx
import jsonschema
import openai
import pytest

from atlas_jax.decoding.guided import GrammarCompiler
from atlas_jax.serving.engine import EngineConfig
from atlas_jax.serving.server import ServerLimits

from .conftest import byte_model, serving

SCHEMA = {
  "type": "object",
  "properties": {
    "city": {"type": "string", "maxLength": 3},
    "rain": {"type": "boolean"},
    "mm": {"type": "integer", "minimum": 0, "maximum": 99},
  },
  "required": ["city", "rain"],
}


@pytest.fixture(scope="module")
def url():
  model, tok = byte_model(1)
  config = EngineConfig(n_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=64)
  with serving(
    model,
    tok,
    config,
    model_name="tiny",
    limits=ServerLimits(max_prompt_tokens=64, max_tokens=64, max_n=2),
    guided=GrammarCompiler(tok, vocab_size=model.cfg.vocab_size, timeout_s=3.0),
  ) as (url, _, _):
    yield url


def test_openai_client_guided_requests(url):
  client = openai.OpenAI(base_url=url + "/v1", api_key="none")
  r = client.chat.completions.create(
    model="tiny",
    messages=[{"role": "user", "content": "weather?"}],
    max_tokens=64,
    temperature=1.0,
    n=2,
    response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
  )
  for choice in r.choices:
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
  r = client.completions.create(
    model="tiny",
    prompt="pick: ",
    max_tokens=8,
    temperature=1.0,
    extra_body={"guided_choice": ["red", "green", "blue"]},
  )
  assert r.choices[0].text in ("red", "green", "blue") and r.choices[0].finish_reason == "stop"


def test_streamed_guided_regex(url):
  body = {"prompt": "id: ", "max_tokens": 16, "stream": True, "guided_regex": "[A-Z]{2}[0-9]{3}"}
  text = ""
  with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
    assert r.status_code == 200
    for line in r.iter_lines():
      if line.startswith("data: {"):
        text += json.loads(line[6:])["choices"][0]["text"]
  assert re.fullmatch("[A-Z]{2}[0-9]{3}", text), text


def test_json_object(url):
  body = {"messages": [{"role": "user", "content": "{"}], "max_tokens": 64}
  r = httpx.post(
    url + "/v1/chat/completions",
    json=body | {"response_format": {"type": "json_object"}},
    timeout=60,
  )
  assert r.status_code == 200
  choice = r.json()["choices"][0]
  if choice["finish_reason"] == "stop":  # a random model may still be inside a string
    assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize(
  "fields,param,match",
  [
    ({"guided_regex": "(ab"}, "guided_regex", "cannot compile"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_json": {"type": "integer", "minimum": 3, "maximum": 1}}, "guided_json", "unsat"),
    (
      {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
      "response_format.json_schema.schema",
      "expected a JSON schema",
    ),
    (
      {
        "response_format": {
          "type": "json_schema",
          "json_schema": {"name": "x", "schema": {"properties": {"a": {"enum": []}}}},
        }
      },
      "response_format.json_schema.schema.properties.a.enum",
      "unsatisfiable",
    ),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_object"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "only one"),
  ],
)
def test_bad_constraints_are_400s_naming_the_field(url, endpoint, fields, param, match):
  body = (
    {"prompt": "x"}
    if endpoint == "completions"
    else {"messages": [{"role": "user", "content": "x"}]}
  )
  r = httpx.post(f"{url}/v1/{endpoint}", json=body | {"max_tokens": 4} | fields, timeout=30)
  assert r.status_code == 400, r.text
  err = r.json()["error"]
  assert err["param"] == param and err["type"] == "invalid_request_error"
  assert match in err["message"]


def test_a_state_explosion_is_a_400_within_the_time_limit(url):
  body = {"prompt": "x", "max_tokens": 4, "guided_regex": "(a|b)*a(a|b){24}"}
  r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
  assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
  assert "did not compile within 3s" in r.json()["error"]["message"]
  # the server goes on serving
  body = {"prompt": "x", "max_tokens": 4, "guided_choice": ["ok"]}
  assert (
    httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"] == "ok"
  )
