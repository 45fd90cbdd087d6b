"""A chat request's tools: `tool_choice` checked, the guided constraint of a forced call, and
each choice's output read back as an assistant message (reasoning, content, tool calls).

As vLLM serves them:
  auto      (with `--enable-auto-tool-choice --tool-call-parser NAME`) the model writes calls in
            its own syntax, read back by the parser; without a parser, `auto` is a 400.
  none      the tools still reach the template; the output is plain content.
  required  the output is constrained to a JSON array of `{"name": ..., "parameters": {...}}`
            objects, one per call (one only with `parallel_tool_calls: false`), each name one of
            the tools and its parameters valid against that tool's schema.
  {"type": "function", "function": {"name": N}}
            the output is constrained to N's parameters schema: it is N's call's arguments.
"""

from __future__ import annotations

import json
from typing import Any

from atlas_jax.decoding.guided import GuidedSpec
from atlas_jax.serving.http.protocol import APIError
from atlas_jax.serving.reasoning import ReasoningParser, ReasoningStream
from atlas_jax.serving.tool_parsers import (
  PartialCall,
  Scan,
  ToolCallStream,
  ToolParser,
  json_call,
  make_call,
  scan_json_array,
)


def tool_names(tools: list[dict] | None) -> list[str]:
  """The functions' names, checked: a 400 naming the tool that is malformed."""
  names = []
  for i, tool in enumerate(tools or []):
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or tool.get("type", "function") != "function":
      raise APIError(
        400, f"tools.{i}: expected {{'type': 'function', 'function': {{...}}}}", f"tools.{i}"
      )
    if not isinstance(fn.get("name"), str) or not fn["name"]:
      raise APIError(400, f"tools.{i}.function.name must be a non-empty string", f"tools.{i}")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
      raise APIError(
        400, f"tools.{i}.function.parameters must be a JSON schema object", f"tools.{i}"
      )
    names.append(fn["name"])
  return names


def resolve_choice(tool_choice: Any, tools: list[dict] | None, auto_parser: bool) -> str | None:
  """The request's mode: None (no tools, or "none"), "auto", "required", or a function's name.

  Raises:
    APIError 400 naming `tool_choice` (or `tools`) when it cannot be served.
  """
  names = tool_names(tools)
  if tool_choice is None:
    tool_choice = "auto" if names else "none"
  if tool_choice == "none":
    return None
  if not names:
    raise APIError(400, f"tool_choice={tool_choice!r} needs `tools`", "tool_choice")
  if tool_choice == "auto":
    if not auto_parser:
      raise APIError(
        400,
        'tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
        "--tool-call-parser",
        "tool_choice",
      )
    return "auto"
  if tool_choice == "required":
    return "required"
  if isinstance(tool_choice, dict):
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type") == "function" and name in names:
      return name
    raise APIError(
      400, f"tool_choice names the function {name!r}; the tools are {names}", "tool_choice"
    )
  raise APIError(
    400,
    f"tool_choice={tool_choice!r} is not allowed: 'none', 'auto', 'required' or "
    '{"type": "function", "function": {"name": ...}}',
    "tool_choice",
  )


def _parameters(fn: dict) -> dict:
  return fn.get("parameters") or {"type": "object", "properties": {}}


def forced_spec(mode: str, tools: list[dict], parallel: bool) -> GuidedSpec:
  """The guided constraint of `required` or a named function (see the module's docstring)."""
  fns = [t["function"] for t in tools]
  if mode != "required":
    fn = next(f for f in fns if f["name"] == mode)
    return GuidedSpec("json_schema", json.dumps(_parameters(fn)), "tools")
  item = {
    "anyOf": [
      {
        "type": "object",
        "properties": {"name": {"const": f["name"]}, "parameters": _parameters(f)},
        "required": ["name", "parameters"],
      }
      for f in fns
    ]
  }
  schema = {"type": "array", "items": item, "minItems": 1}
  if not parallel:
    schema["maxItems"] = 1
  return GuidedSpec("json_schema", json.dumps(schema), "tools")


class RequiredCalls(ToolParser):
  """The output of `tool_choice: "required"`: a JSON array of {name, parameters}."""

  name = "required"

  def extract(self, text):
    try:
      value = json.loads(text)
    except json.JSONDecodeError:
      return text, []
    calls = [json_call(obj) for obj in value] if isinstance(value, list) else [None]
    return (None, calls) if calls and None not in calls else (text, [])

  def scan(self, text):
    return Scan(0, scan_json_array(text, 0))


class NamedCall(ToolParser):
  """The output of a named `tool_choice`: the function's arguments."""

  def __init__(self, function: str):
    self.function = function

  def extract(self, text):
    return None, [make_call(self.function, text)]

  def scan(self, text):
    return Scan(0, [PartialCall(self.function, text.rstrip())])


class MessageReader:
  """One choice's output as an assistant message: whole (`message`) or streamed (`delta`)."""

  def __init__(
    self, reasoning: ReasoningParser | None, tools: ToolParser | None, with_reasoning=False
  ):
    self.reasoning, self.tools = reasoning, tools
    # the message has a reasoning_content (None without a parser: the server has one, but this
    # request's output is all answer)
    self.with_reasoning = with_reasoning or reasoning is not None
    self.text = ""
    self.content_sent = 0
    self.reasoning_stream = ReasoningStream(reasoning) if reasoning else None
    self.tool_stream = ToolCallStream(tools) if tools else None

  @property
  def called(self) -> bool:
    return bool(self.tool_stream and self.tool_stream.called)

  def message(self, text: str) -> dict:
    reasoning, content = (None, text) if self.reasoning is None else self.reasoning.split(text)
    message: dict = {"role": "assistant", "content": content}
    if self.with_reasoning:
      message["reasoning_content"] = reasoning
    calls = []
    if self.tools is not None and content is not None:
      message["content"], calls = self.tools.extract(content)
    elif self.reasoning is None and content is None:
      message["content"] = ""
    message["tool_calls"] = calls
    return message

  def delta(self, text: str, final: bool) -> dict:
    """What `text` (the output's new text) adds: content, reasoning_content, tool_calls."""
    self.text += text
    delta: dict = {}
    content = self.text
    if self.reasoning_stream is not None:
      reasoning, content = self.reasoning_stream.feed(self.text, final)
      if reasoning:
        delta["reasoning_content"] = reasoning
    if self.tool_stream is not None:
      new, calls = self.tool_stream.feed(content, final)
      if new:
        delta["content"] = new
      if calls:
        delta["tool_calls"] = calls
    else:
      new = content[self.content_sent :]
      self.content_sent = max(self.content_sent, len(content))
      if new or self.reasoning is None:  # a plain chat's events always carry content
        delta["content"] = new
    return delta
