"""Chat templates rendered as transformers renders them, over messages as OpenAI clients send them.

A model's chat template is Jinja, run in a sandbox with what `apply_chat_template` gives it:
`messages` (keys whose value is null dropped), `add_generation_prompt`, the tokenizer's special
tokens (`bos_token`, `eos_token`, ...), any extra keyword arguments (vLLM's
`chat_template_kwargs`), the `loopcontrols` extension (`{% break %}`, `{% continue %}`),
`raise_exception`, `strftime_now`, a `tojson` that leaves non-ASCII text alone, and the
`{% generation %}` tag (rendered as its body). Message content may be a string or a list of text
parts (`[{"type": "text", "text": ...}]`), joined with newlines as vLLM does for templates that
expect a string.

transformers encodes the rendered text without special tokens (the template writes its own
BOS), and so does the server; the plain fallback for a model without a template has no BOS of
its own, so its text is encoded as a completion prompt would be.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

# Appended to the final message for `continue_final_message`, found again in the rendered text
# and cut there, as transformers does.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
  """A chat that cannot be rendered: bad message content, or the template itself raised."""

  def __init__(self, message: str, field: str = "messages"):
    super().__init__(message)
    self.field = field


def message_text(content: Any, where: str) -> str | None:
  """A message's content as a string: a string as is, text parts joined with newlines.

  Raises:
    ChatTemplateError naming the part (`where`.j) when a part is not {"type": "text", "text": str}.
  """
  if content is None or isinstance(content, str):
    return content
  if not isinstance(content, list):
    raise ChatTemplateError(f"'{where}' must be a string or a list of text parts", where)
  texts = []
  for j, part in enumerate(content):
    if not isinstance(part, Mapping) or part.get("type") != "text":
      kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
      raise ChatTemplateError(
        f"'{where}.{j}' of type {kind!r} is not supported: only text parts "
        '({"type": "text", "text": ...})',
        f"{where}.{j}",
      )
    if not isinstance(part.get("text"), str):
      raise ChatTemplateError(f"'{where}.{j}.text' must be a string", f"{where}.{j}.text")
    texts.append(part["text"])
  return "\n".join(texts)


def normalise(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """Messages as the template sees them: null-valued keys dropped, content a string."""
  out = []
  for i, m in enumerate(messages):
    m = {k: v for k, v in m.items() if v is not None}
    if "content" in m:
      m["content"] = message_text(m["content"], f"messages.{i}.content")
    out.append(m)
  return out


class ChatTemplate:
  """A Hugging Face chat template (Jinja) as a messages -> prompt text function.

  Args:
    source: the template.
    special_tokens: what the template may read besides the messages ({"bos_token": "<s>", ...}).
    where: names the template in errors (a file, or "tokenizer_config.json chat_template").

  Raises:
    ValueError naming `where` when the template is not valid Jinja.
  """

  plain = False  # the fallback transcript: no BOS of its own

  def __init__(self, source: str, *, special_tokens: Mapping[str, str] | None = None, where: str):
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
      """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it)."""

      tags = {"generation"}

      def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

      def _body(self, caller):
        return caller()

    def raise_exception(message):
      raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
      return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
      )

    env = ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
      self._template = env.from_string(source)
    except jinja2.TemplateError as e:
      raise ValueError(f"{where}: not a valid Jinja template ({e})") from None
    self.source, self.where = source, where
    self.special_tokens = dict(special_tokens or {})

  def render(
    self,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    **kwargs,
  ) -> str:
    """The prompt text for `messages`; `kwargs` reach the template (over the special tokens).

    Raises:
      ChatTemplateError: bad content, an incompatible pair of options, or the template raised
        (e.g. `raise_exception("roles must alternate")`).
    """
    messages = normalise(messages)
    if continue_final_message:
      if add_generation_prompt:
        raise ChatTemplateError(
          "continue_final_message and add_generation_prompt cannot both be true",
          "continue_final_message",
        )
      if not isinstance(messages[-1].get("content"), str):
        raise ChatTemplateError("continue_final_message: the final message has no content")
      messages[-1]["content"] += _CONTINUE_TAG
    try:
      text = self._render(messages, add_generation_prompt, {**self.special_tokens, **kwargs})
    except ChatTemplateError:
      raise
    except Exception as e:  # jinja2's TemplateError, or whatever the template's code raised
      raise ChatTemplateError(f"chat template failed: {e}") from None
    if continue_final_message:
      at = text.rfind(_CONTINUE_TAG.strip())
      if at < 0:
        raise ChatTemplateError("continue_final_message: the template drops the final message")
      cut = text[:at]
      text = cut if text[at:].startswith(_CONTINUE_TAG) else cut.rstrip()
    return text

  def adds_special_tokens(self, text: str, tokenizer, add: bool | None = None) -> bool:
    """Whether rendered `text` is encoded with the tokenizer's special tokens (its BOS), as
    transformers encodes a chat: `add` where given, else only for the plain transcript (a
    template writes its own BOS), and never a second BOS."""
    add = self.plain if add is None else add
    bos = getattr(tokenizer, "bos_token", None)
    return add and not (bos and text.startswith(bos))

  def fingerprint(self) -> str:
    """What decides the rendered text: the template and the special tokens it reads."""
    return json.dumps([self.plain, self.source, sorted(self.special_tokens.items())])

  def _render(self, messages, add_generation_prompt: bool, variables: dict) -> str:
    return self._template.render(
      messages=messages, add_generation_prompt=add_generation_prompt, **variables
    )


class PlainChatTemplate(ChatTemplate):
  """The fallback for a model without a template: one "role: content" line per message, then
  "assistant:" (when a generation prompt is asked for)."""

  plain = True

  def __init__(self):
    self.source, self.where, self.special_tokens = None, "the plain chat transcript", {}

  def _render(self, messages, add_generation_prompt: bool, variables: dict) -> str:
    text = "".join(f"{m.get('role')}: {m.get('content', '')}\n" for m in messages)
    return text + ("assistant:" if add_generation_prompt else "")
