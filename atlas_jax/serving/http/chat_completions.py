"""POST /v1/chat/completions: a chat rendered by the model's template, answered by the assistant.

The messages are rendered by the chat template (`atlas_jax.serving.chat`) and the text encoded as
transformers encodes a rendered template (the template writes its own BOS). Each choice is one
assistant message; a stream opens with an event per choice announcing the role, then sends the
content's deltas.

Tool calling belongs here (not yet served: a request's `tools` is an ignored field): the tools
passed to the template's render in `chat_prompt_ids` (transformers gives a template a `tools`
variable), and in `ChatFormat` a parser of the model's tool-call syntax turning the text of
`final_choice` into the message's `tool_calls`, and a stream's deltas in `chunk_choice` into
their pieces.
"""

from __future__ import annotations

from atlas_jax.serving.chat import ChatTemplateError
from atlas_jax.serving.engine import RequestOutput
from atlas_jax.serving.http.generation import Choice, ChoiceFormat, respond
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


async def create_chat_completion(body: ChatBody, state: State):
  state.check(body)
  ids = chat_prompt_ids(state, body.messages, body, body.add_special_tokens)
  logprobs = (body.top_logprobs or 0) if body.logprobs else None
  return await respond(state, body, [(ids, "")], ChatFormat(state.token_text), logprobs=logprobs)


def chat_prompt_ids(
  state: ServerState, messages: list[ChatMessage], fields: ChatFields, add: bool | None
) -> list[int]:
  """A chat's prompt ids: the template's text encoded as transformers encodes it (`add`: with
  the tokenizer's special tokens; None: as the template says)."""
  try:
    text = state.template.render(
      [m.model_dump(exclude_none=True) for m in messages],
      add_generation_prompt=fields.add_generation_prompt,
      continue_final_message=fields.continue_final_message,
      **(fields.chat_template_kwargs or {}),
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

  def chunk_choice(self, index, text, logprobs, reason) -> ChatChunkChoice:
    delta = {"content": text}
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

  def final_choice(self, index, choice, logprobs) -> ChatChoice:
    message = {"role": "assistant", "content": choice.text}
    return {
      "index": index,
      "message": message,
      "logprobs": logprobs,
      "finish_reason": choice.finish_reason,
    }
