"""The output processor: drawn tokens -> a request's output, its text, its stops and logprobs.

A step hands it each row's draws (one, or a burst's or a round's several); it appends them to
the request's output up to the first stop (an eos or stop token, max_tokens, a stop string in
the detokenised text, or a guided output that is complete), advances the request's grammar
matcher, and reports what the client may see: the new tokens, their logprobs and top
alternatives, and the new text (also per token, as single steps would have let it out),
holding back what could still become a stop string. Output text is detokenised incrementally
(`atlas_jax.serving.detokenize`). It never touches the pool: the scheduler settles the blocks of
what was kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from atlas_jax.decoding.guided import GuidedMatcher
from atlas_jax.serving.requests import Request, RequestOutput

# (request) -> (per prompt token its logprob, per prompt token its top pairs), None first.
PromptLogprobs = Callable[[Request], tuple[list, list]]


class OutputProcessor:
  """Turns draws into RequestOutputs (`prompt_logprobs` scores a whole prompt when asked)."""

  def __init__(self, prompt_logprobs: PromptLogprobs):
    self.prompt_logprobs = prompt_logprobs

  def accept(self, req: Request, tokens, logprobs, top_ids, top_logprobs):
    """Appends drawn tokens to a request's output up to its first stop.

    Returns:
      (the RequestOutput, how many of `tokens` were kept). A finished output has
      `finished=True`; releasing the request is the caller's.
    """
    n_top = req.params.logprobs or 0
    kept, kept_lp, kept_top, texts = [], [], [], []
    reason = stop_reason = None
    first = not req.output
    for token, logprob, ids, lps in zip(tokens, logprobs, top_ids, top_logprobs):
      token = int(token)
      req.output.append(token)
      kept.append(token)
      kept_lp.append(float(logprob))
      if req.params.logprobs is not None:
        kept_top.append([(int(t), float(p)) for t, p in zip(ids[:n_top], lps[:n_top])])
      stop_token = token in req.stop_ids
      if stop_token:
        reason = "stop"
        stop_reason = token if token in req.params.stop_token_ids else None
      elif req.matcher is not None and _guide(req.matcher, token):
        reason = "stop"  # the output is whole and only eos could follow
      elif len(req.output) >= req.params.max_new_tokens:
        reason = "length"
      if req.detok is not None:
        if stop_token and not req.params.include_stop_str_in_output:
          req.detok.flush()  # as vLLM, the text leaves out the token it stopped on
        elif _text(req, token, final=reason is not None):
          reason, stop_reason = "stop", req.stop_str  # a stop string
      # What this token lets out, as a step that drew it alone would report.
      texts.append("" if req.detok is None else _emit(req, reason))
      if reason is not None:
        break
    out = RequestOutput(
      req.id,
      kept,
      kept_lp,
      kept_top,
      "".join(texts),
      finished=reason is not None,
      finish_reason=reason,
      new_texts=texts,
      stop_reason=stop_reason,
    )
    if first:
      req.t_first = time.perf_counter()
      if req.params.prompt_logprobs is not None:
        out.prompt_logprobs, out.prompt_top_logprobs = self.prompt_logprobs(req)
    return out, len(kept)


def finished(req: Request, reason: str, error: str | None = None) -> RequestOutput:
  """The output that ends a request with nothing new (abort, error)."""
  return RequestOutput(req.id, [], [], [], "", finished=True, finish_reason=reason, error=error)


def _guide(matcher: GuidedMatcher, token: int) -> bool:
  """Advances a guided request's matcher; True when its output is complete."""
  matcher.advance(token)
  return matcher.is_complete


def _text(req: Request, token: int, *, final: bool) -> bool:
  """Detokenises one more token; True when a stop string now appears in the text."""
  req.detok.push(token)
  if final:
    req.detok.flush()
  if len(req.output) <= req.params.min_tokens:
    return False  # as vLLM: no stop string within the first min_tokens tokens
  full = req.detok.text
  for s in req.params.stop:
    at = full.find(s, max(0, req.n_text_sent - len(s) + 1))
    if at >= 0 and (req.stop_at is None or at < req.stop_at):
      req.stop_at, req.stop_end, req.stop_str = at, at + len(s), s
  return req.stop_at is not None


def _emit(req: Request, reason: str | None) -> str:
  """The text a request may send now: up to a stop string, or holding back what could still
  become one."""
  full = req.detok.text
  if req.stop_at is not None:
    end = req.stop_end if req.params.include_stop_str_in_output else req.stop_at
  elif reason is None:
    end = len(full) - max((len(s) - 1 for s in req.params.stop), default=0)
  else:
    end = len(full)
  end = max(end, req.n_text_sent)
  text = full[req.n_text_sent : end]
  req.n_text_sent = end
  return text
