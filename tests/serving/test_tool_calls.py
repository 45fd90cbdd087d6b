"""Tool calling and reasoning over HTTP, as vLLM serves them: tools rendered by the template as
transformers renders them, `tool_choice` required / named constrained to the tools' schemas, the
openai client's agent loop, and auto calls and thinking read back whole and streamed."""

import json

import httpx
import jsonschema
import openai
import pytest
from flax import nnx

from atlas_jax.config import ModelConfig
from atlas_jax.data.tokenizer import ByteTokenizer
from atlas_jax.decoding.guided import GrammarCompiler
from atlas_jax.model import build
from atlas_jax.serving.chat import ChatTemplate
from atlas_jax.serving.engine import EngineConfig
from atlas_jax.serving.server import ServerLimits

from .conftest import TINY, serving

# A Qwen2.5-style (Hermes) template: the tools as JSON lines in the system turn, an assistant's
# calls as <tool_call> JSON, tool results as <tool_response> in a user turn.
QWEN_TOOLS_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call functions. Their signatures:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nReply with <tool_call>{"name": ..., "arguments": ...}</tool_call>'
    + '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}
{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}{%- endif %}"""

TOOLS = [
  {
    "type": "function",
    "function": {
      "name": "get_weather",
      "description": "The weather in a city.",
      "parameters": {
        "type": "object",
        "properties": {
          "city": {"type": "string", "enum": ["Paris", "Oslo"]},
          "unit": {"type": "string", "enum": ["c", "f"]},
        },
        "required": ["city", "unit"],
      },
    },
  },
  {
    "type": "function",
    "function": {
      "name": "roll",
      "description": "A die.",
      "parameters": {
        "type": "object",
        "properties": {"sides": {"type": "integer", "minimum": 2, "maximum": 9}},
        "required": ["sides"],
      },
    },
  },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
HISTORY = [
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": "Weather in Paris?"},
  {
    "role": "assistant",
    "content": None,
    "tool_calls": [
      {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
      }
    ],
  },
  {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


@pytest.mark.parametrize("messages", [HISTORY[:2], HISTORY, HISTORY[1:]])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_tools_render_as_transformers(messages, kwargs):
  chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
  (want,), _ = chat_template_utils.render_jinja_template(
    conversations=[messages],
    tools=TOOLS,
    chat_template=QWEN_TOOLS_TEMPLATE,
    add_generation_prompt=True,
    **kwargs,
  )
  got = ChatTemplate(QWEN_TOOLS_TEMPLATE, where="test").render(messages, tools=TOOLS, **kwargs)
  assert got == want
  assert '"name": "get_weather"' in got


@pytest.fixture(scope="module")
def url():
  tok = ByteTokenizer()
  cfg = ModelConfig(**{**TINY, "vocab_size": tok.vocab_size, "max_seq_len": 1024}, n_kv_heads=2)
  model = build(ModelConfig(**{**cfg.__dict__, "init_std": 0.3}), rngs=nnx.Rngs(3))
  config = EngineConfig(n_blocks=256, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
  with serving(
    model,
    tok,
    config,
    model_name="tiny",
    chat_template=ChatTemplate(QWEN_TOOLS_TEMPLATE, where="test"),
    limits=ServerLimits(max_tokens=256, max_n=4),
    guided=GrammarCompiler(tok, vocab_size=model.cfg.vocab_size, timeout_s=20.0),
    tool_parser="hermes",
    reasoning_parser="qwen3",
  ) as (url, _, _):
    yield url


def post(url, body):
  r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", **body}, timeout=120)
  return r


def stream(url, body) -> tuple[dict, list[dict], str | None]:
  """({field: joined text}, [tool calls joined from their deltas], the finish reason)."""
  text, calls, reason = {"content": "", "reasoning_content": ""}, [], None
  body = {"model": "tiny", **body, "stream": True}
  with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
    assert r.status_code == 200, r.read()
    for line in r.iter_lines():
      if not line.startswith("data: {"):
        continue
      choice = json.loads(line[6:])["choices"][0]
      reason = choice["finish_reason"] or reason
      for key, value in choice["delta"].items():
        if key in text:
          text[key] += value
      for d in choice["delta"].get("tool_calls", []):
        if d["index"] == len(calls):
          assert d["id"] and d["type"] == "function" and d["function"]["arguments"] == ""
          calls.append(dict(d["function"]))
        else:
          calls[d["index"]]["arguments"] += d["function"]["arguments"]
  return text, calls, reason


# Seeds 0 and 1 (parallel calls and a single call) in the default run; 2 and 3 repeat them on
# other draws with -m slow.
@pytest.mark.parametrize(
  "seed", [0, 1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)]
)
def test_required_calls_validate_against_the_schemas(url, seed):
  body = {
    "messages": HISTORY[:2],
    "tools": TOOLS,
    "tool_choice": "required",
    "max_tokens": 200,
    "temperature": 1.0,
    "seed": seed,
    "n": 2,
    "parallel_tool_calls": seed % 2 == 0,
  }
  r = post(url, body)
  assert r.status_code == 200, r.text
  for choice in r.json()["choices"]:
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert calls and choice["message"]["content"] is None
    if not body["parallel_tool_calls"]:
      assert len(calls) == 1
    for call in calls:
      jsonschema.validate(
        json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]]
      )
  if seed == 0:  # streamed, the same calls
    _, calls, reason = stream(url, body | {"n": 1})
    whole = post(url, body | {"n": 1}).json()["choices"][0]["message"]["tool_calls"]
    assert reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
      (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole
    ]


def test_named_function(url):
  choice = {"type": "function", "function": {"name": "roll"}}
  body = {"messages": HISTORY[:2], "tools": TOOLS, "tool_choice": choice, "max_tokens": 64}
  got = post(url, body).json()["choices"][0]
  assert got["finish_reason"] == "stop"  # as OpenAI answers a named choice
  (call,) = got["message"]["tool_calls"]
  assert call["function"]["name"] == "roll"
  jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["roll"])


def test_openai_agent_loop(url):
  """A call, the tool's result, the final answer: the openai client's loop."""
  client = openai.OpenAI(base_url=url + "/v1", api_key="none")
  messages = [{"role": "user", "content": "Weather in Oslo?"}]
  first = client.chat.completions.create(
    model="tiny",
    messages=messages,
    tools=TOOLS,
    tool_choice="required",
    parallel_tool_calls=False,
    max_tokens=200,
  )
  assert first.choices[0].finish_reason == "tool_calls"
  call = first.choices[0].message.tool_calls[0]
  args = json.loads(call.function.arguments)
  jsonschema.validate(args, SCHEMAS[call.function.name])
  messages.append(first.choices[0].message.model_dump(exclude_none=True))
  messages.append({"role": "tool", "tool_call_id": call.id, "content": "clear, 9 C"})
  final = client.chat.completions.create(
    model="tiny",
    messages=messages,
    tools=TOOLS,
    tool_choice="none",
    max_tokens=8,
    extra_body={"chat_template_kwargs": {"enable_thinking": False}},
  )
  answer = final.choices[0]
  assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
  assert isinstance(answer.message.content, str) and answer.message.content
  # the history, with the call and its result, rendered with the tools (/tokenize, as vLLM's)
  body = {"messages": messages, "tools": TOOLS, "add_generation_prompt": True}
  tokens = httpx.post(url + "/tokenize", json=body, timeout=30).json()
  want = ChatTemplate(QWEN_TOOLS_TEMPLATE, where="test").render(messages, tools=TOOLS)
  assert "<tool_response>\nclear, 9 C\n</tool_response>" in want and call.id
  assert tokens["count"] == len(want.encode())


@pytest.mark.slow  # builds a Hugging Face folder and starts serve.py (compiles on first use)
def test_openai_agent_loop_against_serve_py(tmp_path):
  """The same loop against serve.py itself: a tiny Qwen2-shaped folder with the tools template,
  the hermes and qwen3 parsers on."""
  import socket
  import subprocess
  import sys
  import time
  from pathlib import Path

  from .hf_folders import build_folder

  build_folder("qwen", tmp_path)
  for name, key, value in [
    ("tokenizer_config.json", "chat_template", QWEN_TOOLS_TEMPLATE),
    ("config.json", "max_position_embeddings", 2048),  # room for the tools in the prompt
  ]:
    settings = json.loads((tmp_path / name).read_text())
    (tmp_path / name).write_text(json.dumps({**settings, key: value}))
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  root = Path(__file__).resolve().parents[2]
  cmd = [sys.executable, str(root / "serve.py"), "--checkpoint", str(tmp_path), "--port", str(port)]
  cmd += ["--served-model-name", "m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
  cmd += ["--reasoning-parser", "qwen3", "--max-batch", "2", "--warmup", "none"]
  proc = subprocess.Popen(
    cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  try:
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
      assert proc.poll() is None, proc.stdout.read()
      try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
          break
      except httpx.TransportError:
        pass
      assert time.monotonic() < deadline, "serve.py did not come up"
      time.sleep(0.5)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.chat.completions.create(
      model="m",
      messages=messages,
      tools=TOOLS,
      tool_choice="required",
      parallel_tool_calls=False,
      max_tokens=200,
    )
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "clear, 9 C"})
    final = client.chat.completions.create(
      model="m", messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=16
    )
    # the folder's model always ends at once: an answer with no calls
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
  finally:
    proc.terminate()
    proc.wait(timeout=30)


CALL = (
  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}\n</tool_call>'
)


def test_auto_calls_and_thinking_read_back(url):
  """tool_choice auto with the hermes parser and the qwen3 reasoning parser; the text is forced
  by a regex so that a random model writes it."""
  text = "<think>cold?</think>\n" + CALL
  body = {
    "messages": HISTORY[:2],
    "tools": TOOLS,
    "max_tokens": 200,
    "guided_regex": text.replace("?", "\\?").replace("{", "\\{").replace("}", "\\}"),
  }
  choice = post(url, body).json()["choices"][0]
  message = choice["message"]
  assert choice["finish_reason"] == "tool_calls"
  assert message["reasoning_content"] == "cold?" and message["content"] == "\n"
  (call,) = message["tool_calls"]
  assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "f"}'}
  fields, calls, reason = stream(url, body)
  assert fields == {"content": "\n", "reasoning_content": "cold?"} and reason == "tool_calls"
  assert calls == [call["function"]]


def test_no_thinking_is_all_content(url):
  body = {
    "messages": HISTORY[:2],
    "max_tokens": 16,
    "guided_choice": ["It is 18 C."],
    "chat_template_kwargs": {"enable_thinking": False},
  }
  message = post(url, body).json()["choices"][0]["message"]
  assert message["content"] == "It is 18 C." and message["reasoning_content"] is None
  assert stream(url, body)[0] == {"content": "It is 18 C.", "reasoning_content": ""}
  # a JSON or choice constraint leaves no room for thinking: all is answer, thinking on or not
  del body["chat_template_kwargs"]
  message = post(url, body).json()["choices"][0]["message"]
  assert message["content"] == "It is 18 C." and message.get("reasoning_content") is None


@pytest.mark.parametrize(
  "fields,param",
  [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    (
      {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
      "tool_choice",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}, "tools.0"),
    ({"tools": [7], "tool_choice": "auto"}, "tools.0"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "roll"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
  ],
)
def test_bad_tool_requests_are_400s(url, fields, param):
  r = post(url, {"messages": HISTORY[:2], "max_tokens": 4, **fields})
  assert r.status_code == 400, r.text
  assert r.json()["error"]["param"] == param
