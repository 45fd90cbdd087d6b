"""Tool-call parsers: a model's tool-call syntax -> OpenAI `tool_calls`, whole or streamed.

One parser per template family, by vLLM's `--tool-call-parser` names:
  hermes       Qwen2.5 / Qwen3 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  llama3_json  Llama 3.1+: `{"name": ..., "parameters": {...}}` (optionally after
               `<|python_tag|>`), several separated by `;`
  mistral      `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
               `[TOOL_CALLS]name[ARGS]{...}` (repeated per call); ids of nine alphanumeric
               characters, as Mistral's templates require
  deepseek_v3  `<｜tool▁calls▁begin｜>`, then per call
               `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + "\\n```json\\n{...}\\n```"
               + `<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`

`extract` reads a whole output: (the content, the calls). As vLLM's parsers do, the calls'
arguments are re-serialised JSON (`json.dumps(..., ensure_ascii=False)`; deepseek_v3's and
mistral's `[ARGS]` ones are the text as written), the content is the text before the first call
(None if empty; mistral's also if only whitespace), and an output whose calls do not parse is all
content. (The tests hold vLLM's answers on the same outputs, and the few places where ours
differ on purpose.)

`scan` is what streaming needs: the output so far read as far as it is certain (the content that
cannot be the start of a call, each call's name once whole and its arguments' text so far).
`ToolCallStream` re-scans the growing text at every delta and sends what is new as OpenAI's
deltas: per call first {index, id, type, function: {name, arguments: ""}}, then
{index, function: {arguments: fragment}}; the fragments join to the arguments as the model wrote
them (the same JSON value as `extract`'s).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
from typing import Any, ClassVar

_DECODER = json.JSONDecoder()


@dataclasses.dataclass
class PartialCall:
  """A call as far as the text shows it."""

  name: str | None  # None until the name is whole
  arguments: str  # the arguments' JSON text so far (a prefix of the whole value)


@dataclasses.dataclass
class Scan:
  """A partial output read as far as it is certain."""

  content_end: int  # text[:content_end] is content for sure
  calls: list[PartialCall]


def make_call(name: str, arguments: str, call_id: str | None = None) -> dict:
  """An OpenAI tool call object, with a fresh id unless `call_id` is given."""
  return {
    "id": call_id or new_call_id(),
    "type": "function",
    "function": {"name": name, "arguments": arguments},
  }


def new_call_id() -> str:
  return "chatcmpl-tool-" + secrets.token_hex(16)


_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id() -> str:
  """Nine alphanumeric characters: the only ids Mistral's templates accept back in a history
  (they raise on any other), as vLLM's mistral parser makes them."""
  return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def partial_overlap(text: str, marker: str) -> int:
  """How many characters at the end of `text` are a proper prefix of `marker`."""
  for n in range(min(len(marker) - 1, len(text)), 0, -1):
    if text.endswith(marker[:n]):
      return n
  return 0


def value_end(text: str, start: int) -> int | None:
  """Where the JSON value starting at `start` ends (exclusive), or None if it is not whole yet.

  Only containers and strings are tracked (a call's arguments are an object)."""
  depth, in_string, i = 0, False, start
  while i < len(text):
    ch = text[i]
    if in_string:
      if ch == "\\":
        i += 1
      elif ch == '"':
        in_string = False
        if depth == 0:
          return i + 1
    elif ch == '"':
      in_string = True
    elif ch in "[{":
      depth += 1
    elif ch in "]}":
      depth -= 1
      if depth == 0:
        return i + 1
    elif depth == 0 and ch in ",}] \n\t\r":  # a bare scalar ended
      return i
    i += 1
  return None


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def partial_json_call(body: str) -> tuple[PartialCall | None, int | None]:
  """A `{"name": ..., "arguments": ...}` object being written: (the call so far, or None before
  its name; where the object ends, or None while it is open)."""
  m = _NAME.search(body)
  if not m:
    return None, None
  name = json.loads(f'"{m.group(1)}"')
  end = value_end(body, body.index("{")) if "{" in body else None
  a = _ARGS.search(body)
  args = ""
  if a and a.end() < len(body):
    stop = value_end(body, a.end())
    args = body[a.end() : stop] if stop is not None else body[a.end() :].rstrip()
    if stop is None and end is not None:  # cannot happen for valid JSON; be safe
      args = ""
  return PartialCall(name, args), end


def json_call(obj: Any) -> dict | None:
  """A parsed `{"name": ..., "arguments" | "parameters": ...}` as a tool call, or None."""
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
    return None
  args = obj.get("arguments", obj.get("parameters", {}))
  if isinstance(args, str):  # some models write the arguments as a JSON string
    try:
      args = json.loads(args)
    except json.JSONDecodeError:
      return None
  return make_call(obj["name"], json.dumps(args, ensure_ascii=False))


def scan_json_array(text: str, start: int) -> list[PartialCall]:
  """The calls of a JSON array of call objects beginning at or after `start`."""
  i = text.find("[", start)
  calls = []
  if i < 0:
    return calls
  i += 1
  while i < len(text):
    j = text.find("{", i)
    if j < 0:
      break
    call, end = partial_json_call(text[j:])
    if call is None:
      break
    calls.append(call)
    if end is None:
      break
    i = j + end
  return calls


class ToolParser:
  """A model family's tool-call syntax (see the module's docstring)."""

  name: ClassVar[str]
  markers: ClassVar[tuple[str, ...]] = ()  # where a call starts: partial ones are held back
  # Content that is only whitespace before the calls is dropped (None), as vLLM's mistral does
  blank_content_dropped: ClassVar[bool] = False

  def new_id(self) -> str:
    """A fresh id for a call this syntax writes."""
    return new_call_id()

  def extract(self, text: str) -> tuple[str | None, list[dict]]:
    """(content or None, tool calls) of a whole output."""
    raise NotImplementedError

  def scan(self, text: str) -> Scan:
    raise NotImplementedError

  def content_end(self, text: str) -> int:
    """The end of the content before the first marker (a partial marker at the end held)."""
    at = [text.find(m) for m in self.markers if m in text]
    if at:
      return min(at)
    return len(text) - max((partial_overlap(text, m) for m in self.markers), default=0)


class HermesParser(ToolParser):
  name = "hermes"
  start, end = "<tool_call>", "</tool_call>"
  markers = (start,)

  def extract(self, text):
    if self.start not in text:
      return text, []
    calls = []
    for m in re.finditer(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, re.DOTALL):
      body = m.group(1) if m.group(1) is not None else m.group(2)
      try:
        call = json_call(json.loads(body))
      except json.JSONDecodeError:
        call = None
      if call is None:
        return text, []
      calls.append(call)
    return text[: text.find(self.start)] or None, calls

  def scan(self, text):
    calls, pos = [], 0
    while (start := text.find(self.start, pos)) >= 0:
      body_at = start + len(self.start)
      close = text.find(self.end, body_at)
      body = text[body_at : close if close >= 0 else len(text)]
      call, _ = partial_json_call(body)
      if call is None:
        break
      calls.append(call)
      if close < 0:
        break
      pos = close + len(self.end)
    return Scan(self.content_end(text), calls)


class Llama3JsonParser(ToolParser):
  name = "llama3_json"
  tag = "<|python_tag|>"

  def extract(self, text):
    calls, i, end = [], 0, -1
    for m in re.finditer(r"\{", text):
      i = m.start()
      if i < end:
        continue
      try:
        obj, n = _DECODER.raw_decode(text[i:])
      except json.JSONDecodeError:
        continue
      end = i + n
      call = json_call(obj)
      if call is None:
        return text, []
      calls.append(call)
    return (None, calls) if calls else (text, [])

  def _body_start(self, text: str) -> int | None:
    """Where the calls begin, -1 while undecided, None if the output is plain content."""
    stripped = text.lstrip()
    lead = len(text) - len(stripped)
    if stripped.startswith(self.tag):
      return lead + len(self.tag)
    if stripped.startswith("{"):
      return lead
    if not stripped or self.tag.startswith(stripped):
      return -1
    return None

  def scan(self, text):
    at = self._body_start(text)
    if at is None:
      return Scan(len(text), [])
    if at < 0:
      return Scan(0, [])
    calls = []
    while (j := text.find("{", at)) >= 0:
      call, end = partial_json_call(text[j:])
      if call is None:
        break
      calls.append(call)
      if end is None:
        break
      at = j + end
    return Scan(0, calls)


class MistralParser(ToolParser):
  """As vLLM's `mistral` parser reads a Hugging Face tokenizer's output: after `[TOOL_CALLS]`,
  either JSON (tokenizers before v11: a list of `{"name", "arguments"}` objects, or one object;
  entries that are not calls skipped, string arguments kept as written) or per call
  `name[ARGS]{...}` (v11 on; also `name{...}`), whose arguments are the JSON value as written.
  The content before the first marker is None when it is only whitespace; call ids are Mistral's
  nine alphanumeric characters."""

  name = "mistral"
  start, args_tag, id_tag = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
  markers = (start,)
  blank_content_dropped = True

  def new_id(self) -> str:
    return mistral_call_id()

  def extract(self, text):
    if self.start not in text:
      return text, []
    head, *pieces = text.split(self.start)
    content = head if head.strip() else None
    body = next((p.strip() for p in pieces if p.strip()), "")
    if body.startswith(("[", "{")):
      calls = self._json_calls(body)
      # vLLM's answer when the JSON holds no call: the text after the marker as content
      return (content, calls) if calls else (body, [])
    calls = []
    for piece in pieces:
      if not piece.strip():
        continue
      name, sep, args = piece.partition(self.args_tag)
      if not sep:  # name{...}
        at = piece.find("{")
        if at < 0:
          return text, []
        name, args = piece[:at], piece[at:]
      args = args.lstrip()
      try:
        _, n = _DECODER.raw_decode(args)
      except json.JSONDecodeError:
        # vLLM passes such arguments on as they are; a client could not parse them: content
        return text, []
      calls.append(make_call(name.split(self.id_tag)[0].strip(), args[:n], self.new_id()))
    return content, calls

  def _json_calls(self, body: str) -> list[dict]:
    try:
      value, _ = _DECODER.raw_decode(body)
    except json.JSONDecodeError:
      m = re.search(r"\[{.*}\]", body, re.DOTALL)
      try:
        value = json.loads(m.group(0)) if m else None
      except json.JSONDecodeError:
        value = None
    calls = []
    for obj in [value] if isinstance(value, dict) else value if isinstance(value, list) else []:
      if not isinstance(obj, dict) or not ("name" in obj or "arguments" in obj):
        continue
      name, args = obj.get("name"), obj.get("arguments")
      if args is None:
        args = "{}"
      elif not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
      calls.append(make_call(name if isinstance(name, str) else "", args, self.new_id()))
    return calls

  def scan(self, text):
    end = self.content_end(text)
    if self.start not in text:
      return Scan(end, [])
    body_at = end + len(self.start)
    rest = text[body_at:]
    if rest.lstrip().startswith("[") or rest.lstrip().startswith("{"):
      if rest.lstrip().startswith("{"):
        call, _ = partial_json_call(rest)
        return Scan(end, [call] if call else [])
      return Scan(end, scan_json_array(text, body_at))
    calls = []
    for piece in rest.split(self.start):
      if not piece.strip():
        continue
      name, sep, args = piece.partition(self.args_tag)
      if not sep and "{" in piece:  # name{...}
        name, args = piece[: piece.find("{")], piece[piece.find("{") :]
      elif not sep:
        break
      stop = value_end(args, len(args) - len(args.lstrip()))
      args = args.strip() if stop is None else args[:stop].strip()
      calls.append(PartialCall(name.split(self.id_tag)[0].strip(), args))
    return Scan(end, calls)


class DeepSeekV3Parser(ToolParser):
  name = "deepseek_v3"
  calls_begin, calls_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
  call_begin, call_end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
  markers = (calls_begin,)
  _CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?P<type>.*)<｜tool▁sep｜>(?P<name>.*)\n```json\n(?P<args>.*)\n```"
    r"<｜tool▁call▁end｜>"
  )

  def extract(self, text):
    if self.calls_begin not in text:
      return text, []
    calls = [make_call(m["name"], m["args"]) for m in self._CALL.finditer(text)]
    if not calls:
      return text, []
    return text[: text.find(self.calls_begin)] or None, calls

  def scan(self, text):
    end = self.content_end(text)
    calls = []
    for piece in text[end:].split(self.call_begin)[1:]:
      head, sep, rest = piece.partition(self.sep)
      if not sep or "\n" not in rest:
        break
      name, _, rest = rest.partition("\n")
      fence = "```json\n"
      if not rest.startswith(fence):
        if fence.startswith(rest):  # the fence is still arriving
          calls.append(PartialCall(name, ""))
          break
        break
      args = rest[len(fence) :]
      done = args.find("\n```")
      if done >= 0:
        args = args[:done]
      else:  # hold back what could be the closing fence
        args = args[: len(args) - partial_overlap(args, "\n```" + self.call_end)].rstrip("\n")
      calls.append(PartialCall(name, args))
      if done < 0:
        break
    return Scan(end, calls)


PARSERS: dict[str, type[ToolParser]] = {
  p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, DeepSeekV3Parser)
}


def get_parser(name: str) -> ToolParser:
  """The parser of vLLM's `--tool-call-parser` name; ValueError naming the choices."""
  if name not in PARSERS:
    raise ValueError(f"--tool-call-parser={name!r} is not allowed: one of {sorted(PARSERS)}")
  return PARSERS[name]()


class ToolCallStream:
  """One streamed choice's calls: feed the whole text so far, get the new content and the
  OpenAI tool-call deltas since the last feed."""

  def __init__(self, parser: ToolParser):
    self.parser = parser
    self.content_sent = 0
    self.sent: list[str] = []  # per call announced: the arguments sent so far
    self.ids: list[str] = []

  @property
  def called(self) -> bool:
    return bool(self.sent)

  def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
    scan = self.parser.scan(text)
    end = len(text) if final and not scan.calls else scan.content_end
    if self.parser.blank_content_dropped and not text[:end].strip() and (scan.calls or not final):
      end = self.content_sent  # held: whitespace before a call is dropped
    content = ""
    if not self.sent and end > self.content_sent:  # no content after a call began
      content, self.content_sent = text[self.content_sent : end], end
    deltas = []
    for i, call in enumerate(scan.calls):
      if call.name is None:
        break
      if i == len(self.sent):
        self.ids.append(self.parser.new_id())
        self.sent.append("")
        head = {"name": call.name, "arguments": ""}
        deltas.append({"index": i, "id": self.ids[i], "type": "function", "function": head})
      new = call.arguments[len(self.sent[i]) :] if call.arguments.startswith(self.sent[i]) else ""
      if new:
        self.sent[i] += new
        deltas.append({"index": i, "function": {"arguments": new}})
    return content, deltas


__all__ = [
  "PARSERS",
  "PartialCall",
  "Scan",
  "ToolCallStream",
  "ToolParser",
  "get_parser",
  "make_call",
  "mistral_call_id",
  "new_call_id",
  "partial_overlap",
  "scan_json_array",
]
