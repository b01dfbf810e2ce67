"""Results and errors the SDK returns."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import httpx

E = TypeVar("E")


class MStarError(Exception):
    """An error response from the server: `status` is the HTTP status (400 client fault, 500 server fault)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"[{status}] {message}")
        self.status = status
        self.message = message


class MStarConnectionError(MStarError):
    """No answer: the server could not be reached, or did not answer within the client's timeout (`status` 0)."""

    def __init__(self, message: str):
        super().__init__(0, message)


class EventStream(Generic[E]):
    """The events of one streamed request, iterated as they arrive. The request is sent (and a refusal raised) when
    the stream is made; closing it (`close()`, the end of a `with` block, or dropping it, iterated or not) closes
    the connection, which cancels the request on the server."""

    def __init__(self, response: httpx.Response, events: Iterator[E]):
        self._response, self._events = response, events

    def __iter__(self) -> EventStream[E]:
        return self

    def __next__(self) -> E:
        return next(self._events)

    def close(self) -> None:
        self._events.close()
        self._response.close()

    def __enter__(self) -> EventStream[E]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the transport may be gone already
            pass


@dataclass(slots=True)
class ChatResult:
    text: str
    finish_reason: str
    usage: dict[str, int] = field(default_factory=dict)
    token_ids: list[int] | None = None  # only when return_token_ids=True


@dataclass(slots=True)
class ChatEvent:
    """One streamed event: new text (and tokens), or the last event with finish_reason and usage."""

    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    usage: dict[str, int] | None = None
