"""Tool-call and reasoning parsers on canned model outputs, whole and streamed a character at a
time: the calls, content and reasoning that vLLM's parsers of the same names document."""

import json
import subprocess
from pathlib import Path

import pytest

from atlas_jax.serving import reasoning, tool_parsers
from atlas_jax.serving.http.tools import MessageReader, NamedCall, RequiredCalls

W = {"city": "Paris", "unit": "c"}
T = {"tz": "Europe/Oslo", "note": 'a "quoted" } brace'}
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def ds_call(name, args):
  return (
    f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
  )


# (parser, model output, content, [(name, arguments as JSON)])
CASES = [
  (
    "hermes",
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
    '"c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
    + json.dumps(T)
    + "}\n</tool_call>",
    "Let me look.\n",
    [("get_weather", W), ("get_time", T)],
  ),
  ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', None, [("f", {})]),
  # an unclosed call at the end still counts (vLLM's second alternative)
  ("hermes", '<tool_call>{"name": "f", "arguments": {"x": [1, 2]}}', None, [("f", {"x": [1, 2]})]),
  ("hermes", "No tools <tool needed>.", "No tools <tool needed>.", []),
  # a call that does not parse leaves the whole output as content
  ("hermes", '<tool_call>{"name": "f", "arguments": }</tool_call>', None, None),
  (
    "llama3_json",
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
    '{"name": "get_time", "parameters": ' + json.dumps(T) + "}",
    None,
    [("get_weather", W), ("get_time", T)],
  ),
  ("llama3_json", '{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
  ("llama3_json", "The sky is blue.", "The sky is blue.", []),
  (
    "mistral",
    'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
    '{"name": "get_time", "arguments": ' + json.dumps(T) + "}]",
    "Sure.",
    [("get_weather", W), ("get_time", T)],
  ),
  (
    "mistral",
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}[TOOL_CALLS]get_time[ARGS]'
    + json.dumps(T),
    None,
    [("get_weather", W), ("get_time", T)],
  ),
  ("mistral", "Just text.", "Just text.", []),
  (
    "deepseek_v3",
    "Checking."
    + DS_BEGIN
    + ds_call("get_weather", json.dumps(W))
    + ds_call("get_time", json.dumps(T))
    + DS_END,
    "Checking.",
    [("get_weather", W), ("get_time", T)],
  ),
  ("deepseek_v3", "Plain answer.", "Plain answer.", []),
]


def streamed(parser, text):
  """(content, [(name, arguments text)]) from a character-by-character stream, checking the
  deltas' shapes: a call's first delta carries id, type and name, the later ones arguments only."""
  stream = tool_parsers.ToolCallStream(parser)
  content, calls = "", []
  for i in range(len(text)):
    new, deltas = stream.feed(text[: i + 1], final=i == len(text) - 1)
    content += new
    for d in deltas:
      if d["index"] == len(calls):
        assert d["type"] == "function" and d["id"]
        assert d["id"].startswith("chatcmpl-tool-") or parser.name == "mistral"
        assert d["function"]["arguments"] == ""
        calls.append([d["function"]["name"], ""])
      else:
        assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        calls[d["index"]][1] += d["function"]["arguments"]
  return content, calls


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parser_whole_and_streamed(name, text, content, calls):
  parser = tool_parsers.get_parser(name)
  got_content, got_calls = parser.extract(text)
  if calls is None:  # malformed: all content, no calls
    assert got_content == text and got_calls == []
    return
  assert got_content == (text if not calls else content)
  assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == (
    calls
  )
  assert all(c["type"] == "function" for c in got_calls)
  assert len({c["id"] for c in got_calls}) == len(got_calls)
  if name != "deepseek_v3":  # vLLM re-serialises the JSON arguments (deepseek_v3: as written)
    assert [c["function"]["arguments"] for c in got_calls] == [
      json.dumps(a, ensure_ascii=False) for _, a in calls
    ]
  s_content, s_calls = streamed(parser, text)
  assert s_content == (got_content or "")
  assert [(n, json.loads(a)) for n, a in s_calls] == calls


WJ, TJ, A1 = json.dumps(W), json.dumps(T), '{"a": 1}'
TC, ARGS = "[TOOL_CALLS]", "[ARGS]"
# What vLLM 0.32's parsers of the same names return for these outputs (`extract_tool_calls`, run
# once in its own environment with a tokenizer holding the markers as special tokens; mistral's
# with and without [ARGS] in the vocabulary, as its format follows the tokenizer's version):
# (parser, output, content, [(name, arguments)]). The tests do not need vLLM.
VLLM_TOOL_CALLS = [
  (*CASES[0][:2], "Let me look.\n", [("get_weather", WJ), ("get_time", TJ)]),
  (*CASES[1][:2], None, [("f", "{}")]),
  (*CASES[2][:2], None, [("f", '{"x": [1, 2]}')]),
  (*CASES[3][:2], CASES[3][1], []),
  (*CASES[4][:2], CASES[4][1], []),
  (*CASES[5][:2], None, [("get_weather", WJ), ("get_time", TJ)]),
  (*CASES[6][:2], None, [("f", A1)]),
  (*CASES[7][:2], CASES[7][1], []),
  (*CASES[8][:2], "Sure.", [("get_weather", WJ), ("get_time", TJ)]),
  (*CASES[9][:2], None, [("get_weather", WJ), ("get_time", TJ)]),
  (*CASES[10][:2], CASES[10][1], []),
  (*CASES[11][:2], "Checking.", [("get_weather", WJ), ("get_time", TJ)]),
  (*CASES[12][:2], CASES[12][1], []),
  (
    "hermes",
    ' \n<tool_call>{"name": "f", "arguments": {"a": "é"}}</tool_call>',
    " \n",
    [("f", '{"a": "é"}')],
  ),
  ("llama3_json", 'Sure: {"name": "f", "parameters": {"a": 1}}', None, [("f", A1)]),
  ("llama3_json", '{"name": "f", "parameters": {"a": "é"}}', None, [("f", '{"a": "é"}')]),
  ("deepseek_v3", DS_BEGIN + ds_call("f", A1) + DS_END, None, [("f", A1)]),
  # mistral, JSON after the marker (tokenizers before v11)
  ("mistral", TC + '[{"name": "f", "arguments": "{\\"a\\":1}"}]', None, [("f", '{"a":1}')]),
  ("mistral", TC + '[{"name": "f", "arguments": {"a":1}}]', None, [("f", A1)]),
  ("mistral", " \n" + TC + '[{"name": "f", "arguments": {}}]', None, [("f", "{}")]),
  ("mistral", TC + ' {"name": "f", "arguments": {"a": 1}}', None, [("f", A1)]),
  ("mistral", TC + '[{"name": "f", "arguments": {"a": 1}}] trailing text', None, [("f", A1)]),
  ("mistral", TC + '[{"name": "f"}]', None, [("f", "{}")]),
  ("mistral", TC + '[{"arguments": {"a": 1}}]', None, [("", A1)]),
  ("mistral", TC + '[{"name": "f", "arguments": {"a": "é"}}, 7]', None, [("f", '{"a": "é"}')]),
  ("mistral", "Hi " + TC + TC + '[{"name": "f", "arguments": {}}]', "Hi ", [("f", "{}")]),
  ("mistral", TC + '{"name": "f", "arguments": {}} ' + TC + ' {"name": "g"}', None, [("f", "{}")]),
  # ... whose JSON holds no call: the text after the marker is the content
  ("mistral", TC + '[{"name": "f", "arguments": }]', '[{"name": "f", "arguments": }]', []),
  # mistral, name[ARGS]{...} per call (v11 on): the arguments as written
  ("mistral", TC + "f" + ARGS + '{"a":1,  "b": [1,2]}', None, [("f", '{"a":1,  "b": [1,2]}')]),
  ("mistral", "Hi" + TC + "f" + ARGS + A1, "Hi", [("f", A1)]),
  ("mistral", " \n" + TC + "f" + ARGS + "{}", None, [("f", "{}")]),
  ("mistral", TC + "f" + ARGS + A1 + " and more", None, [("f", A1)]),
  ("mistral", TC + "f" + ARGS + A1 + "\n", None, [("f", A1)]),
  ("mistral", TC + "f" + A1, None, [("f", A1)]),
  ("mistral", TC + "get_time" + ARGS + TJ, None, [("get_time", TJ)]),
  ("mistral", TC + "f" + ARGS + A1 + TC + "g" + ARGS + "{}", None, [("f", A1), ("g", "{}")]),
  ("mistral", "Plain.", "Plain.", []),
]
# Where ours differs from vLLM 0.32, on purpose: (parser, output, ours, vLLM's).
DEVIATIONS = [
  # vLLM encodes string arguments again, giving a JSON string, not the object a client expects
  (
    "hermes",
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
    (None, [("f", A1)]),
    (None, [("f", '"{\\"a\\": 1}"')]),
  ),
  # vLLM passes arguments that are not JSON on; a client could not parse them: all content
  ("mistral", TC + 'f[ARGS]{"a": }', (TC + 'f[ARGS]{"a": }', []), (None, [("f", '{"a": }')])),
  # vLLM keeps the call id's text in the name
  (
    "mistral",
    TC + "f[CALL_ID]abc123XYZ" + ARGS + A1,
    (None, [("f", A1)]),
    (None, [("fabc123XYZ", A1)]),
  ),
]


@pytest.mark.parametrize("name,text,content,calls", VLLM_TOOL_CALLS)
def test_the_calls_vllm_returns(name, text, content, calls):
  got_content, got = tool_parsers.get_parser(name).extract(text)
  assert (got_content, [(c["function"]["name"], c["function"]["arguments"]) for c in got]) == (
    content,
    calls,
  )
  if name == "mistral":  # Mistral's templates take back only nine alphanumeric characters
    assert all(c["id"].isalnum() and len(c["id"]) == 9 for c in got)
  # Streamed, the same calls where each is written out whole (named, its arguments an object in
  # the text); llama3_json streams calls only from an output that starts with them, as vLLM's.
  whole = calls and all(n and a.startswith("{") and a in text for n, a in calls)
  if whole and not (name == "llama3_json" and text.startswith("Sure")):
    s_content, s_calls = streamed(tool_parsers.get_parser(name), text)
    assert [(n, json.loads(a)) for n, a in s_calls] == [(n, json.loads(a)) for n, a in calls]
    assert s_content == (content or "")


@pytest.mark.parametrize("name,text,ours,theirs", DEVIATIONS)
def test_deviations_from_vllm(name, text, ours, theirs):
  content, got = tool_parsers.get_parser(name).extract(text)
  assert (content, [(c["function"]["name"], c["function"]["arguments"]) for c in got]) == ours
  assert ours != theirs


def test_a_partial_marker_is_held_back_until_it_is_not_one():
  stream = tool_parsers.ToolCallStream(tool_parsers.get_parser("hermes"))
  assert stream.feed("Hi <tool_") == ("Hi ", [])
  assert stream.feed("Hi <tool_x") == ("<tool_x", [])
  assert stream.feed("Hi <tool_x <tool", final=True) == (" <tool", [])


def test_unknown_parser_names_the_choices():
  with pytest.raises(ValueError, match="deepseek_v3.*hermes.*llama3_json.*mistral"):
    tool_parsers.get_parser("qwen9")


def test_forced_outputs():
  text = (
    '[{"name": "get_weather", "parameters": '
    + json.dumps(W)
    + '}, {"name": "f", "parameters": {}}]'
  )
  content, calls = RequiredCalls().extract(text)
  assert content is None
  assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
    ("get_weather", W),
    ("f", {}),
  ]
  assert [(n, json.loads(a)) for n, a in streamed(RequiredCalls(), text)[1]] == [
    ("get_weather", W),
    ("f", {}),
  ]
  _, calls = NamedCall("get_weather").extract(json.dumps(W))
  assert calls[0]["function"] == {"name": "get_weather", "arguments": json.dumps(W)}
  assert streamed(NamedCall("get_weather"), json.dumps(W))[1] == [["get_weather", json.dumps(W)]]


# -- reasoning --------------------------------------------------------------------------------

# (parser, chat_template_kwargs, output, reasoning, content)
REASONING = [
  ("deepseek_r1", None, "<think>Two and two.</think>It is 4.", "Two and two.", "It is 4."),
  ("deepseek_r1", None, "Two and two.</think>\n\nIt is 4.", "Two and two.", "\n\nIt is 4."),
  ("deepseek_r1", None, "Still thinking about <thi", "Still thinking about <thi", None),
  ("deepseek_r1", None, "<think>done</think>", "done", None),
  ("qwen3", None, "<think>\nhm\n</think>\n\n4", "\nhm\n", "\n\n4"),
  ("qwen3", {"enable_thinking": False}, "It is 4.", None, "It is 4."),
  (
    "qwen3",
    None,
    'hm<tool_call>{"name": "f", "arguments": {}}</tool_call>',
    "hm",
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
  ),
]


@pytest.mark.parametrize("name,kwargs,text,want_reasoning,want_content", REASONING)
def test_reasoning_whole_and_streamed(name, kwargs, text, want_reasoning, want_content):
  parser = reasoning.get_parser(name, kwargs)
  assert parser.split(text) == (want_reasoning, want_content)
  reader = MessageReader(parser, None)
  got = {"reasoning_content": "", "content": ""}
  for i, ch in enumerate(text):
    for key, value in reader.delta(ch, final=i == len(text) - 1).items():
      got[key] += value
  assert got == {"reasoning_content": want_reasoning or "", "content": want_content or ""}


def test_reasoning_then_tool_calls():
  """qwen3 + hermes: the thinking, then a call (the <tool_call> ends the thinking)."""
  call = {"name": "get_weather", "arguments": W}
  text = f"<think>need weather</think>\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
  make = lambda: MessageReader(reasoning.get_parser("qwen3"), tool_parsers.get_parser("hermes"))
  message = make().message(text)
  assert message["reasoning_content"] == "need weather" and message["content"] == "\n"
  assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == W
  reader, got, calls = make(), {"reasoning_content": "", "content": ""}, []
  for i, ch in enumerate(text):
    delta = reader.delta(ch, final=i == len(text) - 1)
    calls += delta.pop("tool_calls", [])
    for key, value in delta.items():
      got[key] += value
  assert got == {"reasoning_content": "need weather", "content": "\n"}
  assert calls[0]["function"]["name"] == "get_weather" and reader.called
  assert json.loads("".join(c["function"]["arguments"] for c in calls)) == W


# -- against vLLM's own parsers (its environment, when there is one) ------------------------------

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
# vLLM's parsers need a tokenizer holding their markers: a word-level one with them as specials.
VLLM_SCRIPT = """
import json, sys
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager

cases = json.load(sys.stdin)
specials = cases["specials"]
vocab = {"<unk>": 0, **{s: i + 1 for i, s in enumerate(specials)}}
tok = PreTrainedTokenizerFast(
  tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
  unk_token="<unk>",
  additional_special_tokens=specials,
)
tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
out = {"tools": [], "reasoning": []}
for name, text in cases["tools"]:
  if name == "mistral":  # its format follows mistral_common's tokenizer version: not this one
    out["tools"].append(None)
    continue
  messages = [{"role": "user", "content": "x"}]
  request = ChatCompletionRequest(model="m", messages=messages, tools=tools)
  got = ToolParserManager.get_tool_parser(name)(tok).extract_tool_calls(text, request)
  calls = [[c.function.name, c.function.arguments] for c in got.tool_calls]
  out["tools"].append([got.content, calls])
for name, kwargs, text in cases["reasoning"]:
  request = ChatCompletionRequest(
    model="m", messages=[{"role": "user", "content": "x"}], chat_template_kwargs=kwargs
  )
  cls = ReasoningParserManager.get_reasoning_parser(name)
  try:
    parser = cls(tok, chat_template_kwargs=kwargs or {})
  except TypeError:
    parser = cls(tok)
  out["reasoning"].append(list(parser.extract_reasoning(text, request)))
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow  # starts vLLM (about 30 s of imports)
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM environment (.venv-vllm)")
def test_same_as_vllms_parsers():
  specials = ["<tool_call>", "</tool_call>", "<|python_tag|>", "<think>", "</think>"]
  specials += ["[TOOL_CALLS]", "[ARGS]", DS_BEGIN, DS_END, "<｜tool▁call▁begin｜>"]
  specials += ["<｜tool▁call▁end｜>", "<｜tool▁sep｜>"]
  cases = {
    "specials": specials,
    "tools": [(name, text) for name, text, _, _ in CASES],
    "reasoning": [(name, kwargs, text) for name, kwargs, text, _, _ in REASONING],
  }
  proc = subprocess.run(
    [str(VLLM_PYTHON), "-c", VLLM_SCRIPT],
    input=json.dumps(cases),
    capture_output=True,
    text=True,
    timeout=600,
  )
  line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
  assert line is not None, proc.stderr[-3000:]
  theirs = json.loads(line[len("RESULT") :])
  compared = 0
  for (name, text, _, _), want in zip(CASES, theirs["tools"]):
    if want is None:
      continue
    content, calls = tool_parsers.get_parser(name).extract(text)
    got = [[c["function"]["name"], c["function"]["arguments"]] for c in calls]
    assert [content, got] == want, (name, text)
    compared += 1
  assert compared == sum(name != "mistral" for name, *_ in CASES)
  for (name, kwargs, text, _, _), want in zip(REASONING, theirs["reasoning"]):
    assert list(reasoning.get_parser(name, kwargs).split(text)) == want, (name, text)
