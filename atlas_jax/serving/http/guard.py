"""`Guard`, the raw ASGI layer in front of every endpoint."""

from __future__ import annotations

import logging

from atlas_jax.serving.http.protocol import error_response

log = logging.getLogger("atlas_jax.serving")


class Guard:
  """The outermost layer of the app (raw ASGI): API key, body size, and unexpected errors.

  The body is read here, up to `max_body_bytes` whatever the transfer encoding (a chunked body
  has no Content-Length to check up front), and handed on whole; a larger one gets 413 without
  being read further, and the connection is closed, since the rest of it is still on the way.
  An exception no handler took becomes an OpenAI-shaped 500 (logged with its traceback), so the
  client's keep-alive connection survives it.
  """

  def __init__(self, app, *, api_key: str | None, max_body_bytes: int):
    self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    if self.api_key is not None and scope["path"].startswith("/v1/"):
      if headers.get("authorization", "") != f"Bearer {self.api_key}":
        response = error_response(401, "invalid or missing API key", kind="authentication_error")
        return await response(scope, receive, send)
    too_large = error_response(
      413, f"request body over {self.max_body_bytes} bytes", headers={"Connection": "close"}
    )
    size = headers.get("content-length", "")
    if size.isdigit() and int(size) > self.max_body_bytes:
      return await too_large(scope, receive, send)
    chunks, n = [], 0
    while True:
      message = await receive()
      if message["type"] == "http.disconnect":
        return
      chunks.append(message.get("body", b""))
      n += len(chunks[-1])
      if n > self.max_body_bytes:
        return await too_large(scope, receive, send)
      if not message.get("more_body", False):
        break
    body, replayed = b"".join(chunks), False

    async def replay():
      nonlocal replayed
      if not replayed:
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}
      return await receive()  # then the disconnect, which streaming responses listen for

    started = False

    async def watch(message):
      nonlocal started
      started = started or message["type"] == "http.response.start"
      await send(message)

    try:
      await self.app(scope, replay, watch)
    except Exception:
      if started:
        raise  # mid-response: nothing better than closing the connection
      log.exception("unhandled error serving %s %s", scope["method"], scope["path"])
      await error_response(500, "internal server error", kind="server_error")(scope, replay, send)
