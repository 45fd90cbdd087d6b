"""Server-sent events: the wire format, one event per token, and the choices' outputs merged.

Streaming sends one event per token, as vLLM does, each with its own text and logprobs. A
streamed request runs no decode bursts, so each token leaves as soon as the host has it;
`serve.engine.stream_bursts` keeps bursting (the tokens then arrive `decode_burst` at a time,
and `one_per_token` still sends one event each). A stream ends with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Sequence

from fastapi.responses import StreamingResponse

from atlas_jax.serving.engine import RequestOutput
from atlas_jax.serving.http.engine_thread import EngineRunner

DONE = "data: [DONE]\n\n"  # a stream's last event


def sse(payload: dict) -> str:
  """One server-sent event carrying `payload` as JSON."""
  return f"data: {json.dumps(payload)}\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
  """The response that sends `events` (SSE lines) as they come."""
  return StreamingResponse(
    events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
  )


def one_per_token(out: RequestOutput) -> list[RequestOutput]:
  """An output of several tokens (a burst's, a speculative round's) as one output per token,
  each with its own text and logprobs, the prompt's logprobs on the first and the finish on the
  last: a stream sends each token as its own event, as vLLM does."""
  n = len(out.new_token_ids)
  if n <= 1:
    return [out]
  texts = out.new_texts if len(out.new_texts) == n else [out.text] + [""] * (n - 1)
  tops = out.new_top_logprobs
  return [
    dataclasses.replace(
      out,
      new_token_ids=out.new_token_ids[j : j + 1],
      new_logprobs=out.new_logprobs[j : j + 1],
      new_top_logprobs=tops[j : j + 1],
      text=texts[j],
      new_texts=texts[j : j + 1],
      finished=out.finished and j == n - 1,
      finish_reason=out.finish_reason if j == n - 1 else None,
      error=out.error if j == n - 1 else None,
      prompt_logprobs=out.prompt_logprobs if j == 0 else None,
      prompt_top_logprobs=out.prompt_top_logprobs if j == 0 else None,
    )
    for j in range(n)
  ]


async def merged(
  runner: EngineRunner, subs: Sequence[tuple[str, asyncio.Queue]]
) -> AsyncIterator[tuple[int, RequestOutput]]:
  """(choice index, RequestOutput) in arrival order across the choices `subs` (request id,
  queue), until each has finished. On leaving, early or not (a client that disconnects
  mid-stream), the requests are aborted, which frees the blocks of those still running."""
  queue: asyncio.Queue = asyncio.Queue()

  async def pump(i, q):
    while True:
      out = await q.get()
      await queue.put((i, out))
      if out.finished:
        return

  tasks = [asyncio.create_task(pump(i, q)) for i, (_, q) in enumerate(subs)]
  left = len(subs)
  try:
    while left:
      i, out = await queue.get()
      left -= out.finished
      yield i, out
  finally:
    for t in tasks:
      t.cancel()
    for rid, _ in subs:  # no-op for finished requests
      runner.abort(rid)
