"""Guided decoding after the thinking, as vLLM applies it: with `--reasoning-parser` and a
tokenizer whose `</think>` is one token (Qwen3's), a request's constraint starts after that token;
the thinking is sampled freely. With thinking off (the template writes an empty think block) the
constraint applies from the first token."""

import json

import httpx
import jsonschema
import pytest
from flax import nnx

from atlas_jax.config import ModelConfig
from atlas_jax.data.tokenizer import HFTokenizer, train_bpe
from atlas_jax.decoding.guided import GrammarCompiler
from atlas_jax.model import build
from atlas_jax.serving.chat import ChatTemplate
from atlas_jax.serving.engine import EngineConfig
from atlas_jax.serving.server import ServerLimits

from .conftest import TINY, serving
from .test_tool_calls import HISTORY, QWEN_TOOLS_TEMPLATE, SCHEMAS, TOOLS, stream

SCHEMA = {
  "type": "object",
  "properties": {
    "city": {"enum": ["Paris", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9},
  },
  "required": ["city", "days"],
  "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def tokenizer():
  """A byte-level BPE with Qwen3's thinking markers as added (not special) tokens."""
  corpus = ["<|im_start|>user\nWeather in Paris?<|im_end|>\n", '{"city": "Oslo", "days": 3}']
  tok = train_bpe(corpus * 20, 300)._tok
  tok.add_tokens(["<think>", "</think>"])
  return HFTokenizer(tok, bos="<s>", eos="</s>", pad="<pad>")


@pytest.fixture(scope="module")
def server(tokenizer):
  cfg = ModelConfig(**{**TINY, "vocab_size": tokenizer.vocab_size, "max_seq_len": 1024})
  model = build(ModelConfig(**{**cfg.__dict__, "n_kv_heads": 2, "init_std": 0.3}), rngs=nnx.Rngs(5))
  config = EngineConfig(n_blocks=256, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
  with serving(
    model,
    tokenizer,
    config,
    model_name="tiny",
    chat_template=ChatTemplate(QWEN_TOOLS_TEMPLATE, where="test"),
    limits=ServerLimits(max_tokens=256, max_n=4),
    guided=GrammarCompiler(tokenizer, vocab_size=model.cfg.vocab_size, timeout_s=20.0),
    tool_parser="hermes",
    reasoning_parser="qwen3",
  ) as (url, _, _):
    yield url


def post(url, body):
  r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", **body}, timeout=120)
  assert r.status_code == 200, r.text
  return r.json()


def _thinking_body(tokenizer, **fields):
  # A random model draws </think> about once in V tokens: a bias ends its thinking sooner. Eos
  # while thinking ends the output with no answer (as in vLLM): the bias keeps it out; the
  # grammar ends the answer itself once only eos may follow.
  end = tokenizer.encode("</think>")
  assert len(end) == 1
  bias = {str(end[0]): 4.0, str(tokenizer.eos_id): -100.0}
  return {"messages": HISTORY[:2], "max_tokens": 160, "temperature": 1.0, "logit_bias": bias} | (
    fields
  )


def test_the_schema_applies_after_the_thinking(server, tokenizer):
  thoughts = []
  for seed in range(2):
    body = _thinking_body(tokenizer, response_format=FORMAT, seed=seed, n=4)
    for choice in post(server, body)["choices"]:
      message = choice["message"]
      assert choice["finish_reason"] == "stop", message
      assert message["reasoning_content"] is not None, message
      jsonschema.validate(json.loads(message["content"]), SCHEMA)
      thoughts.append(message["reasoning_content"])
  # The thinking was drawn without the grammar: most of it could not begin a JSON object.
  free = [t for t in thoughts if t.strip() and not t.lstrip().startswith("{")]
  assert len(free) >= len(thoughts) // 2, thoughts
  # streamed: the same split, the content valid
  fields, _, reason = stream(server, _thinking_body(tokenizer, response_format=FORMAT, seed=7))
  assert reason == "stop"
  jsonschema.validate(json.loads(fields["content"]), SCHEMA)


def test_thinking_off_constrains_from_the_start(server, tokenizer):
  body = _thinking_body(
    tokenizer,
    guided_json=SCHEMA,
    n=4,
    seed=0,
    chat_template_kwargs={"enable_thinking": False},
  )
  for choice in post(server, body)["choices"]:
    message = choice["message"]
    assert message["reasoning_content"] is None
    jsonschema.validate(json.loads(message["content"]), SCHEMA)


def test_required_tool_calls_after_the_thinking(server, tokenizer):
  body = _thinking_body(tokenizer, tools=TOOLS, tool_choice="required", n=4, seed=1)
  body["parallel_tool_calls"] = False  # one call: with eos kept out, an array would go on
  for choice in post(server, body)["choices"]:
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls", message
    assert message["reasoning_content"] is not None and message["tool_calls"]
    for call in message["tool_calls"]:
      jsonschema.validate(
        json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]]
      )
