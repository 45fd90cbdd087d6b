"""vLLM's POST /tokenize and POST /detokenize, in its shapes."""

from __future__ import annotations

from atlas_jax.serving.http.chat_completions import chat_prompt_ids
from atlas_jax.serving.http.protocol import APIError, DetokenizeBody, TokenizeBody
from atlas_jax.serving.http.state import State


async def tokenize(body: TokenizeBody, state: State):
  """A `prompt`'s ids, or a chat's (`messages`) as the chat endpoint would encode it."""
  state.check(body)
  if (body.prompt is None) == (body.messages is None):
    raise APIError(400, "give one of 'prompt' (text) or 'messages' (a chat)", "prompt")
  if body.prompt is not None:
    add = True if body.add_special_tokens is None else body.add_special_tokens
    ids = state.tokenizer.encode(body.prompt, add_special_tokens=add)
  else:
    ids = chat_prompt_ids(state, body.messages, body, body.add_special_tokens, tools=body.tools)
  strs = [state.token_text(t) for t in ids] if body.return_token_strs else None
  return {"count": len(ids), "max_model_len": state.context, "tokens": ids, "token_strs": strs}


async def detokenize(body: DetokenizeBody, state: State):
  """The text of `tokens`, special tokens included."""
  state.check(body)
  bad = next((t for t in body.tokens if t >= state.vocab_size), None)
  if bad is not None:
    raise APIError(
      400,
      f"token id {bad} is not allowed: token ids must be in [0, {state.vocab_size})",
      "tokens",
    )
  return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}
