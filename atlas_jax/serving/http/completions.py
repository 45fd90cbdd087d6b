"""POST /v1/completions: n choices per prompt, a prompt being text or token ids.

A completion's `prompt` may be a string, a list of token ids, or a list of either (one set of
`n` choices per prompt, indexed in order); text prompts are encoded as the tokenizer encodes by
default (a Llama tokenizer adds its BOS; `add_special_tokens: false` does not). OpenAI's `echo`
repeats the prompt before each choice's text (with `logprobs`: each prompt token's logprob, the
first null).
"""

from __future__ import annotations

from atlas_jax.serving.engine import RequestOutput
from atlas_jax.serving.http.generation import (
  Choice,
  ChoiceFormat,
  Prompt,
  merge_logprobs,
  respond,
)
from atlas_jax.serving.http.protocol import (
  APIError,
  CompletionBody,
  CompletionChoice,
  CompletionLogprobs,
)
from atlas_jax.serving.http.state import State


async def create_completion(body: CompletionBody, state: State):
  state.check(body)
  if body.suffix:
    raise APIError(400, "suffix is not supported", "suffix")
  add = True if body.add_special_tokens is None else body.add_special_tokens
  one = isinstance(body.prompt, str) or all(isinstance(t, int) for t in body.prompt)
  prompts: list[Prompt] = []
  for p in [body.prompt] if one and body.prompt != [] else body.prompt:
    if p == "" or p == []:  # as vLLM: not the BOS alone
      raise APIError(400, "the prompt is empty: 'prompt' must not be empty", "prompt")
    if isinstance(p, str):
      prompts.append((state.prompt_ids(p, add), p))
    else:
      skip = body.skip_special_tokens
      text = state.tokenizer.decode(p, skip_special_tokens=skip) if body.echo else ""
      prompts.append((list(p), text))
  if not prompts:
    raise APIError(400, "the prompt is empty: 'prompt' must not be empty", "prompt")
  fmt = CompletionFormat(state.token_text)
  return await respond(state, body, prompts, fmt, logprobs=body.logprobs, echo=body.echo)


class CompletionFormat(ChoiceFormat):
  """A completion's choices carry `text`; its logprobs are OpenAI's legacy lists."""

  object = chunk_object = "text_completion"
  id_prefix = "cmpl-"
  prompt_field = "prompt"

  def logprobs(self, choice: Choice, out: RequestOutput, with_prompt: bool) -> dict:
    parts = []
    if with_prompt and out.prompt_logprobs is not None:
      prompt = (choice.prompt_ids, out.prompt_logprobs, out.prompt_top_logprobs)
      parts.append(self._logprobs(choice, *prompt))
    tokens = (out.new_token_ids, out.new_logprobs, out.new_top_logprobs)
    return merge_logprobs([*parts, self._logprobs(choice, *tokens)])

  def _logprobs(self, choice: Choice, ids, lps, tops) -> CompletionLogprobs:
    tokens = [self.token_text(t) for t in ids]
    offsets = []
    for t in tokens:  # as vLLM: each token's text after the ones before it
      offsets.append(choice.offset)
      choice.offset += len(t)
    return {
      "tokens": tokens,
      "token_logprobs": list(lps),
      "top_logprobs": [
        None if top is None else {self.token_text(t): lp for t, lp in top} for top in tops
      ],
      "text_offset": offsets,
    }

  def chunk_choice(self, index, text, logprobs, reason, stop_reason=None) -> CompletionChoice:
    return {
      "index": index,
      "text": text,
      "logprobs": logprobs,
      "finish_reason": reason,
      "stop_reason": stop_reason,
    }

  def final_choice(self, index, choice, logprobs) -> CompletionChoice:
    return {
      "index": index,
      "text": choice.text,
      "logprobs": logprobs,
      "finish_reason": choice.finish_reason,
      "stop_reason": choice.stop_reason,
    }
