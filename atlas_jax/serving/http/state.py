"""What every endpoint reads: the engine thread, the tokenizer, the served names, the limits.

`build_app` makes one `ServerState` and keeps it in `app.state.server`; an endpoint asks for it
with a parameter annotated `State` (a FastAPI dependency), so handlers are plain module-level
functions of (request body, state).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import Depends, Request
from pydantic import BaseModel

from atlas_jax.config import ServerLimits
from atlas_jax.data.tokenizer import encode_prompt
from atlas_jax.decoding.guided import GrammarCompiler
from atlas_jax.decoding.sampling import SamplingParams
from atlas_jax.serving.chat import ChatTemplate, PlainChatTemplate
from atlas_jax.serving.http.engine_thread import EngineRunner
from atlas_jax.serving.http.protocol import APIError, sampling_defaults

log = logging.getLogger("atlas_jax.serving")


@dataclasses.dataclass(frozen=True)
class ServerState:
  """The server's fixed state, shared by its endpoints."""

  runner: EngineRunner
  # encode(text, add_special_tokens=), decode(ids, skip_special_tokens=), bos_id, bos_token
  tokenizer: Any
  names: list[str]  # the served model names; responses name the first unless asked for another
  template: ChatTemplate
  limits: ServerLimits
  defaults: SamplingParams  # a request's sampling where it does not say (the seed aside)
  guided: GrammarCompiler | None  # None: guided decoding is refused
  context: int  # the engine's max_model_len
  vocab_size: int
  max_prompt_tokens: int  # limits.max_prompt_tokens, or the context
  max_tokens_limit: int  # the most max_tokens may ask for: limits.max_tokens, or the context
  created: int  # when the server started (seconds since the epoch): the models' `created`
  tool_parser: str | None = None  # --tool-call-parser with --enable-auto-tool-choice: `auto`
  reasoning_parser: str | None = None  # --reasoning-parser: the thinking as reasoning_content

  @classmethod
  def create(
    cls,
    runner: EngineRunner,
    *,
    tokenizer,
    model_name: str | Sequence[str],
    chat_template: ChatTemplate | None = None,
    limits: ServerLimits | None = None,
    default_params: SamplingParams | None = None,
    guided: GrammarCompiler | None = None,
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
  ) -> ServerState:
    """The state of `build_app`'s arguments, its defaults filled in (see `build_app`)."""
    engine = runner.engine
    limits = ServerLimits() if limits is None else limits
    context = engine.max_model_len
    return cls(
      runner=runner,
      tokenizer=tokenizer,
      names=[model_name] if isinstance(model_name, str) else list(model_name),
      template=chat_template or PlainChatTemplate(),
      limits=limits,
      defaults=default_params or sampling_defaults(),
      guided=guided,
      context=context,
      vocab_size=engine.model_config.vocab_size,
      max_prompt_tokens=limits.max_prompt_tokens or context,
      max_tokens_limit=limits.max_tokens or context,
      created=int(time.time()),
      tool_parser=tool_parser,
      reasoning_parser=reasoning_parser,
    )

  @property
  def adapters(self):
    """The engine's served LoRA adapters (`atlas_jax.serving.lora.ServedAdapters`), or None."""
    return getattr(self.runner.engine, "adapters", None)

  def adapter_of(self, model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names, or None for the base model."""
    served = self.adapters
    return model if served is not None and model in served.by_name else None

  def check(self, body: BaseModel) -> None:
    """The model asked for is served; the fields ignored are named in one warning line."""
    if body.model is not None and body.model not in self.names:
      if self.adapters is None:
        raise self.not_found(body.model)
      if self.adapter_of(body.model) is None:
        served = ", ".join(repr(n) for n in [*self.names, *self.adapters.names()])
        raise APIError(
          400,
          f"model={body.model!r} is not allowed: no such model or LoRA adapter; served: {served}",
          "model",
        )
    ignored = sorted(body.model_extra or {})
    if ignored:
      log.warning("request fields ignored: %s", ", ".join(ignored))

  def not_found(self, model: str) -> APIError:
    served = ", ".join(repr(n) for n in self.names)
    return APIError(
      404,
      f"the model {model!r} does not exist; this server serves {served}",
      "model",
      code="model_not_found",
    )

  def prompt_ids(self, text: str, add_special_tokens: bool) -> list[int]:
    """A text prompt's ids, as serve.py encodes one (an empty text is the BOS alone)."""
    return encode_prompt(self.tokenizer, text, add_special_tokens)

  def token_text(self, token_id: int) -> str:
    """One token's text, special tokens included (as logprobs name tokens)."""
    return self.tokenizer.decode([token_id], skip_special_tokens=False)


def get_state(request: Request) -> ServerState:
  return request.app.state.server


# An endpoint's parameter of this type receives the app's ServerState.
State = Annotated[ServerState, Depends(get_state)]
