"""POST /v1/chat/completions: a chat rendered by the model's template, answered by the assistant.

The messages are rendered by the chat template (`atlas_jax.serving.chat`) and the text encoded as
transformers encodes a rendered template (the template writes its own BOS). Each choice is one
assistant message; a stream opens with an event per choice announcing the role, then sends the
content's deltas.

Tool calling (`tools.py`): the request's `tools` reach the template as transformers' `tools`
variable; `tool_choice` picks how calls come back: read from the model's own syntax by the
server's tool-call parser (`auto`), or forced by guided decoding (`required`, a named function).
Each choice's text is read back by a `MessageReader`: with `--reasoning-parser`, the thinking as
`reasoning_content`; the calls as `tool_calls` (finish_reason "tool_calls"); streamed, as
deltas of each. With a reasoning parser and thinking on, a guided constraint (the request's own
or a forced call's) applies to the answer after `</think>`, as vLLM's does.
"""

from __future__ import annotations

from atlas_jax.decoding.guided import GuidedDecodingError
from atlas_jax.serving import reasoning, tool_parsers
from atlas_jax.serving.chat import ChatTemplateError
from atlas_jax.serving.engine import RequestOutput
from atlas_jax.serving.http.generation import Choice, ChoiceFormat, requested_spec, respond
from atlas_jax.serving.http.protocol import (
  APIError,
  ChatBody,
  ChatChoice,
  ChatChunkChoice,
  ChatFields,
  ChatLogprobs,
  ChatMessage,
  encodable,
)
from atlas_jax.serving.http.state import ServerState, State
from atlas_jax.serving.http.tools import (
  MessageReader,
  NamedCall,
  RequiredCalls,
  forced_spec,
  resolve_choice,
)


async def create_chat_completion(body: ChatBody, state: State):
  state.check(body)
  mode = resolve_choice(body.tool_choice, body.tools, state.tool_parser is not None)
  ids = chat_prompt_ids(state, body.messages, body, body.add_special_tokens, tools=body.tools)
  logprobs = (body.top_logprobs or 0) if body.logprobs else None
  forced = None
  if mode in (None, "auto"):
    tools = tool_parsers.get_parser(state.tool_parser) if mode == "auto" else None
    if tools is not None:  # the call markers may be special tokens: keep them in the text
      body = body.model_copy(update={"skip_special_tokens": False})
  else:
    forced = forced_spec(mode, body.tools, body.parallel_tool_calls)
    tools = RequiredCalls() if mode == "required" else NamedCall(mode)
  think = gated = None
  if state.reasoning_parser is not None:
    think = reasoning.get_parser(state.reasoning_parser, body.chat_template_kwargs)
    if think.thinking and reasoning.marker_id(state.tokenizer, think.end) is not None:
      gated = think  # a constraint applies after the thinking
    elif forced is not None or _all_answer(body):
      think = None
  fmt = ChatFormat(
    state.token_text,
    reader=lambda: MessageReader(think, tools, state.reasoning_parser is not None),
    named=mode not in (None, "auto", "required"),
  )
  return await respond(
    state, body, [(ids, "")], fmt, logprobs=logprobs, forced=forced, after_reasoning=gated
  )


def _all_answer(body: ChatBody) -> bool:
  """Whether the output cannot hold any thinking where the constraint applies from its first
  token (a `</think>` that is not one token: see `reasoning.gate`): a JSON or choice constraint
  has no room for a <think> block; a regex may spell one, and is read with the reasoning parser."""
  try:
    spec = requested_spec(body)
  except GuidedDecodingError:
    return False  # `respond` answers it with a 400
  return spec is not None and spec.kind != "regex"


def chat_prompt_ids(
  state: ServerState,
  messages: list[ChatMessage],
  fields: ChatFields,
  add: bool | None,
  tools: list[dict] | None = None,
) -> list[int]:
  """A chat's prompt ids: the template's text encoded as transformers encodes it (`add`: with
  the tokenizer's special tokens; None: as the template says); `tools` reach the template as
  its `tools` variable, as `apply_chat_template(tools=...)` passes them."""
  try:
    text = state.template.render(
      [m.model_dump(exclude_none=True) for m in messages],
      add_generation_prompt=fields.add_generation_prompt,
      continue_final_message=fields.continue_final_message,
      **{"tools": tools, **(fields.chat_template_kwargs or {})},
    )
    encodable(text)
  except ChatTemplateError as e:  # the request's fault (e.g. the roles' order)
    raise APIError(400, str(e), e.field) from None
  except ValueError as e:
    raise APIError(400, f"the chat's text: {e}", "messages") from None
  return state.prompt_ids(text, state.template.adds_special_tokens(text, state.tokenizer, add))


class ChatFormat(ChoiceFormat):
  """A chat's choices carry an assistant message (streamed: its deltas); its logprobs are a
  list of per-token objects."""

  object = "chat.completion"
  chunk_object = "chat.completion.chunk"
  id_prefix = "chatcmpl-"
  prompt_field = "messages"

  def __init__(self, token_text, reader=None, named: bool = False):
    super().__init__(token_text)
    self.new_reader = reader or (lambda: MessageReader(None, None))
    self.named = named  # a named tool_choice: finish_reason stays "stop", as OpenAI's
    self.readers: dict[int, MessageReader] = {}

  def reader(self, index: int) -> MessageReader:
    if index not in self.readers:
      self.readers[index] = self.new_reader()
    return self.readers[index]

  def finish_reason(self, reader: MessageReader, reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" and not self.named else reason

  def stream_start(self, n_choices: int) -> list[ChatChunkChoice]:
    delta = {"role": "assistant", "content": ""}
    return [
      {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
      for i in range(n_choices)
    ]

  def logprobs(self, choice: Choice, out: RequestOutput, with_prompt: bool) -> ChatLogprobs:
    # A chat has no echo, so never the prompt's.
    def entry(t, lp):
      text = self.token_text(t)
      return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    tokens = zip(out.new_token_ids, out.new_logprobs, out.new_top_logprobs)
    return {
      "content": [
        {**entry(t, lp), "top_logprobs": [entry(u, v) for u, v in top]} for t, lp, top in tokens
      ]
    }

  def chunk_choice(self, index, text, logprobs, reason, stop_reason=None):
    reader = self.reader(index)
    delta = reader.delta(text, final=reason is not None)
    if not any(delta.values()) and logprobs is None and reason is None:
      return None  # held back: perhaps the start of a call or of a marker
    return {
      "index": index,
      "delta": delta,
      "logprobs": logprobs,
      "finish_reason": self.finish_reason(reader, reason, reader.called),
      "stop_reason": stop_reason,
    }

  def final_choice(self, index, choice, logprobs) -> ChatChoice:
    reader = self.reader(index)
    message = reader.message(choice.text)
    return {
      "index": index,
      "message": message,
      "logprobs": logprobs,
      "finish_reason": self.finish_reason(
        reader, choice.finish_reason, bool(message["tool_calls"])
      ),
      "stop_reason": choice.stop_reason,
    }
