"""Results and errors the SDK returns."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import httpx

E = TypeVar("E")


def _httpx_errors(name: str) -> tuple[type[Exception], ...]:
    """httpx's exception class `name`, and httpx2's if that is installed: an `http_client` may be either (Starlette's
    TestClient is an httpx2.Client), and its transport raises its own library's errors."""
    classes: list[type[Exception]] = [getattr(httpx, name)]
    try:
        import httpx2
    except ImportError:
        return tuple(classes)
    return (*classes, getattr(httpx2, name))


TIMEOUT_ERRORS = _httpx_errors("TimeoutException")  # catch before TRANSPORT_ERRORS, whose subclass it is
TRANSPORT_ERRORS = _httpx_errors("TransportError")

# The `type` of a proxy error (mstar_common/proxy/errors.py) -> its HTTP status, for an error sent as a stream's event.
_STATUS_BY_TYPE = {"invalid_request_error": 400, "rate_limit_exceeded": 429, "service_unavailable": 503,
                   "timeout": 504}


def read_file_input(value: Any, name: str) -> bytes:
    """A file argument as its bytes: bytes-like data, a path (`str` or any `os.PathLike`) to read, or an open binary
    file (anything with `read()`); anything else is a TypeError naming the argument (a stray value was sent as
    data: `bytes(8)` is eight zero bytes, and a `PurePath` is not a `Path`)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (str, os.PathLike)):
        return Path(value).read_bytes()
    if callable(getattr(value, "read", None)):
        data = value.read()
        if isinstance(data, (bytes, bytearray, memoryview)):
            return bytes(data)
        raise TypeError(f"{name}: the file must be opened in binary mode ('rb'), got {type(data).__name__} from it")
    raise TypeError(f"{name}: expected bytes, a file path or a binary file, got {type(value).__name__}")


class MStarError(Exception):
    """An error response from the server: `status` is the HTTP status (400 client fault, 500 server fault).
    `retry_after`: the seconds the server asked the client to wait before retrying (its `Retry-After`, sent with a
    429 or 503), else None. `param`: the request field a refusal names (e.g. "top_p"), and `code` the error's code
    (e.g. "overloaded"), as the server's error body gives them, else None."""

    def __init__(self, status: int, message: str, retry_after: float | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(f"[{status}] {message}")
        self.status = status
        self.message = message
        self.retry_after = retry_after
        self.param = param
        self.code = code

    def __reduce__(self) -> tuple:
        """Pickle by the constructor's arguments (Exception's default passes `str(self)` alone, which cannot make
        one again): a worker of a process pool that raises it would break the whole pool."""
        return type(self), (self.status, self.message, self.retry_after, self.param, self.code)


class MStarConnectionError(MStarError):
    """No answer: the server could not be reached, or did not answer within the client's timeout (`status` 0)."""

    def __init__(self, message: str):
        super().__init__(0, message)

    def __reduce__(self) -> tuple:
        return type(self), (self.message,)


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


def set_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    """The knobs the caller set: one given as None is left out (the server's default), never sent as null, which a
    field such as `return_token_ids` refuses."""
    return {name: value for name, value in knobs.items() if value is not None}


class SSELines:
    """The lines of an SSE byte stream, fed in chunks. A line ends at CRLF, LF or CR (the SSE rules) and nowhere
    else: httpx's iter_lines also ends one at U+2028, U+0085, form feed ... (str.splitlines), which a server's JSON
    may hold unescaped inside a string, cutting the event in two."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, chunk: bytes) -> list[str]:
        data = self._rest + chunk
        held = data.endswith(b"\r")  # its LF may be the next chunk's first byte
        lines = re.split(rb"\r\n|\r|\n", data[:-1] if held else data)
        self._rest = lines.pop() + (b"\r" if held else b"")
        return [line.decode("utf-8", errors="replace") for line in lines]

    def close(self) -> list[str]:
        """What the stream left after its last line end (a last line without one)."""
        rest, self._rest = self._rest.rstrip(b"\r"), b""
        return [rest.decode("utf-8", errors="replace")] if rest else []


def sse_events(response: httpx.Response, parse: Callable[[dict[str, Any]], E]) -> Iterator[E]:
    """`parse` of each JSON event of an SSE response up to `[DONE]`; an error event, a lost connection or a read past
    the client's timeout raises its MStarError, and so does an event that is not an object or that `parse` cannot
    read (a 502, as for a non-streamed answer of the wrong shape: another server or version on the port). Closes
    the response when done, also when the caller stops early (the server then cancels the request)."""
    try:
        for line in _lines(response):
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            try:
                event = json.loads(data)
            except ValueError:
                raise MStarError(502, f"the stream sent an event that is not JSON: {data[:80]!r}") from None
            if not isinstance(event, dict):
                raise MStarError(502, f"the stream sent an event that is not a JSON object: {data[:80]!r}")
            if "error" in event:
                raise _stream_error(event["error"])
            try:
                item = parse(event)
            except (KeyError, IndexError, TypeError, ValueError) as exc:  # binascii.Error is a ValueError
                raise MStarError(502, f"the stream sent an event not in the shape the SDK reads "
                                      f"({type(exc).__name__}: {exc}): {data[:80]!r}") from None
            yield item
        raise MStarError(502, "the stream ended without [DONE]")
    except TIMEOUT_ERRORS as exc:
        raise MStarConnectionError(f"{response.request.url}: the stream stalled past the client's timeout "
                                   f"({exc!r})") from None
    except TRANSPORT_ERRORS as exc:
        raise MStarConnectionError(f"{response.request.url}: the connection was lost mid-stream ({exc!r})") from None
    finally:
        response.close()


def _stream_error(error: Any) -> MStarError:
    """An error event's MStarError: the proxy sends an object with `message`, `type`, `param` and `code`; anything
    else is taken as the message."""
    if not isinstance(error, dict):
        return MStarError(500, str(error))
    kind, param, code = error.get("type"), error.get("param"), error.get("code")
    return MStarError(_STATUS_BY_TYPE.get(kind, 500) if isinstance(kind, str) else 500, str(error.get("message", "")),
                      param=param if isinstance(param, str) else None, code=code if isinstance(code, str) else None)


def encode_json(value: Any) -> str:
    """A multipart form's JSON field; a value JSON cannot hold (a numpy integer, NaN) is the 400 MStarError that the
    JSON bodies' encoding gives (`MStarClient._build`), raised before anything is sent."""
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise MStarError(400, f"the request cannot be encoded: {exc}") from None


def _lines(response: httpx.Response) -> Iterator[str]:
    lines = SSELines()
    for chunk in response.iter_bytes():
        yield from lines.feed(chunk)
    yield from lines.close()


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
