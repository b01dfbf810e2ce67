"""Server-sent events: framing, the terminal error event, and a response that notices a disconnect at once.

Starlette's StreamingResponse (ASGI >= 2.4) learns of a disconnect only when its next write fails, which can
be many seconds into a slow generation. `SSEResponse` always listens for `http.disconnect` and then closes
the body iterator, which closes the Triton stream beneath it, which cancels the request in Triton. A client that
keeps its connection open but stops reading (its TCP window full) never disconnects, and uvicorn's write waits for
it without a limit: a stream whose write has waited SEND_STALL_S is ended the same way.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from mstar_common.proxy.errors import from_exception

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
SEND_STALL_S = 60.0  # a write that has waited this long for the client to take its bytes ends the stream
STALL_CHECK_S = 5.0


# Characters that JSON leaves unescaped and str.splitlines (so httpx's iter_lines, and many clients) ends a line at;
# inside an SSE data line they would cut the event in two. JSON's other line breaks (control characters) are
# escaped by json.dumps already.
_LINE_BREAKS = ("\x85", "\u2028", "\u2029")


def sse_frame(event: dict[str, Any]) -> bytes:
    text = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    for char in _LINE_BREAKS:
        if char in text:
            text = text.replace(char, f"\\u{ord(char):04x}")
    return b"data: " + text.encode("utf-8") + b"\n\n"


async def sse_body(events: AsyncIterator[dict[str, Any]], timeout_s: float | None = None) -> AsyncIterator[bytes]:
    """Frame events, then `[DONE]`; an error mid-stream becomes one `{"error": ...}` event and ends the stream."""
    try:
        async for event in events:
            yield sse_frame(event)
        yield DONE
    except Exception as exc:  # noqa: BLE001 - every failure must reach the client as an error event
        yield sse_frame(from_exception(exc, timeout_s).body())
    finally:
        await events.aclose()


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str] | None = None):
        super().__init__(content, headers={"Cache-Control": "no-cache", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writing_since: float | None = None  # when the write in progress began

        async def timed_send(message) -> None:
            nonlocal writing_since
            writing_since = time.monotonic()
            try:
                await send(message)
            finally:
                writing_since = None

        async with anyio.create_task_group() as group:

            async def stream() -> None:
                try:
                    await self.stream_response(timed_send)
                except OSError:  # the client went away while we wrote
                    pass
                group.cancel_scope.cancel()

            async def watch_writes() -> None:
                while True:
                    await anyio.sleep(STALL_CHECK_S)
                    if writing_since is not None and time.monotonic() - writing_since > SEND_STALL_S:
                        logger.info("[%s] a write waited %.0f s for the client to read: the stream is ended",
                                    scope.get("state", {}).get("request_id", "-"), SEND_STALL_S)
                        group.cancel_scope.cancel()
                        return

            group.start_soon(stream)
            group.start_soon(watch_writes)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
