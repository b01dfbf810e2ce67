"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}`, and the handlers that produce them.

A client's fault is a 4xx whose message names the field and the rule. A server fault is a 500 that carries
only a scrubbed message and an error id; the original message is logged under that id.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import uuid
from typing import Any

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mstar_common import wire
from mstar_common.proxy.triton_stream import (
    TritonInvalidRequest,
    TritonOverloaded,
    TritonRefusedNow,
    TritonServerError,
    TritonTimeout,
    TritonUnavailable,
)

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_exceeded",
    499: "invalid_request_error",
    503: "service_unavailable",
    504: "timeout",
}
_MAX_ERRORS_SHOWN = 3
_MAX_INPUT_REPR = 60
MAX_JSON_DEPTH = sys.getrecursionlimit()  # what json.loads' C scanner nests to before a RecursionError


class APIError(Exception):
    """An error response. Raise it anywhere in request handling; the handler renders it."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        # a quoted value of any size echoed the body back (wire.MAX_MESSAGE_CHARS), and one that is not Unicode text
        # (a lone surrogate) failed the response's encode: a 500
        message = wire.encodable(wire.clipped(message))
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else wire.encodable(wire.clipped(param, 200))
        self.code = code
        self.headers = headers

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # in JSON text: the escape of a UTF-16 surrogate


def non_text_path(value: Any) -> tuple[str, bool] | None:
    """Where a parsed JSON value holds a string that is not Unicode text (a lone surrogate, from JSON's \\ud800
    escape): its path (`messages[0].content`; "" for the value itself) and whether it is a key of that path's
    object; None when every string and key is text."""
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not wire.is_unicode_text(item):
                return path, False
        elif isinstance(item, dict):
            for key, child in item.items():
                if not wire.is_unicode_text(key):
                    return path, True
                stack.append((f"{path}.{key}" if path else key, child))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(item))
    return None


def parse_json(raw: str | bytes, what: str, param: str | None = None) -> Any:
    """`json.loads(raw)`, or a 400 naming `what` (e.g. "'model_kwargs'", "request body"): text that is not JSON or
    not UTF-8, a number longer than Python's 4,300-digit limit for ints (a ValueError of its own), arrays or
    objects nested past the parser's recursion limit (`[[[[...`: a RecursionError, once a 500), and a string that
    is not Unicode text (a lone surrogate escape, which failed at its first encode: a 500), naming its path under
    `param`. Bytes must be UTF-8 (RFC 8259; a BOM is allowed): json.loads reads UTF-16 and UTF-32 too, whose lone
    surrogates no search of the bytes finds, and which a route reading a body of any content type let through."""
    if isinstance(raw, bytes):
        offset = raw.find(b"\x00")  # no UTF-8 JSON holds a NUL byte (its strings escape control characters)
        try:
            raw = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            offset = exc.start if offset < 0 else min(offset, exc.start)
        if offset >= 0:
            raise invalid_request(f"{what} is not UTF-8 text (JSON must be UTF-8): invalid byte at offset {offset}",
                                  param=param) from None
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise invalid_request(f"{what} is not valid JSON: {error}", param=param) from None
    except ValueError:
        raise invalid_request(f"{what} holds a number of more than {sys.get_int_max_str_digits()} digits",
                              param=param) from None
    except RecursionError:
        raise invalid_request(f"{what} nests arrays or objects too deeply (at most about {MAX_JSON_DEPTH} levels)",
                              param=param) from None
    text = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    found = non_text_path(value) if SURROGATE_ESCAPE.search(text) or b"\xed" in text else None
    if found is not None:
        path, is_key = found
        where = ".".join(filter(None, (param, path))).replace(".[", "[") or None
        shown = (f"a key of '{where}'" if where else "a key") if is_key else f"'{where or 'the value'}'"
        raise invalid_request(f"{what}: {shown} is {wire.NOT_UNICODE_RULE}", param=where)
    return value


# The request the current task serves (set by the proxy's middleware), so that a fault's log line names it.
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("mstar_request_id", default="-")


_COMPONENT_ERROR_ID = re.compile(re.escape(wire.SERVER_ERROR_PREFIX) + r"([0-9A-Za-z]{1,64})\)")


def server_error(
    original: str, *, status: int = 500, public: str = "internal server error", exc_info: BaseException | None = None
) -> APIError:
    """A server fault: log `original` under an error id (and the request's id) and return an error that shows
    only the error id: the component's own where `original` carries one (its log holds the cause under it), else a
    fresh one."""
    found = _COMPONENT_ERROR_ID.search(original)
    error_id = found.group(1) if found else uuid.uuid4().hex[:16]
    logger.error("[proxy] [%s] error id %s: %s", REQUEST_ID.get(), error_id, original, exc_info=exc_info)
    return APIError(status, f"{public} (error id {error_id})", code=error_id)


def check_wire_number(value: int | float, np_dtype: str, param: str, minimum: int | None = None,
                      wrap_only: bool = False) -> None:
    """A 400 naming `param` if `value` does not survive the tensor it travels in (int32 / int64 wrap around;
    float32 overflows to inf), so that the model never checks a value the client did not send. `minimum`: the
    field's own lower bound, shown in the rule (the model's upper bound may be lower than the tensor's), and refused
    here unless `wrap_only`: then a value under it that the tensor holds goes on to the model, whose refusal states
    the field's whole range."""
    if np.dtype(np_dtype).kind == "f":
        try:
            with np.errstate(over="ignore"):
                held = np.float32(value)
        except OverflowError:  # an int past float64's range (JSON's 1 followed by 400 zeros): no finite float32
            held = np.float32("inf")
        if not np.isfinite(held):
            raise invalid_request(f"'{param}': must be finite as a 32-bit float (|x| < 3.4e38), got {value!r}",
                                  param=param)
        return
    info = np.iinfo(np_dtype)
    low = info.min if minimum is None else minimum
    if isinstance(value, bool) or not (info.min if wrap_only else low) <= value <= info.max:
        raise invalid_request(f"'{param}': must be in [{low}, {info.max}], got {value!r}", param=param)


class BodyTooLarge(HTTPException):
    """Raised from the receive channel; a FastAPI HTTPException so FastAPI's body parsing re-raises it as is."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")


class NotUnicodeText(HTTPException):
    """A JSON body string (or key) holding a lone UTF-16 surrogate; raised from the receive channel like
    BodyTooLarge."""

    def __init__(self, path: str, key: bool = False):
        what = (f"a key of '{path}'" if path else "a key of the request body") if key else f"'{path or 'body'}'"
        super().__init__(400, f"{what} is {wire.NOT_UNICODE_RULE}")
        self.param = path or None


class NotUTF8Body(HTTPException):
    """A JSON body that is not UTF-8 text (RFC 8259 asks for UTF-8; Python's json also reads UTF-16/32 and the
    CESU-8 form of surrogates, which would carry lone surrogates past the text check); raised like BodyTooLarge."""

    def __init__(self, offset: int):
        super().__init__(400, f"request body is not UTF-8 text (JSON bodies must be UTF-8): invalid byte at offset "
                              f"{offset}")


# validation errors -> one readable 400


def field_path(loc: tuple | list) -> str:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _describe(error: dict[str, Any]) -> str:
    path = field_path(error.get("loc", ()))
    kind = error.get("type", "")
    msg = str(error.get("msg", "invalid value"))
    if kind == "extra_forbidden":
        return f"unknown field '{path}'"
    if not path and (kind == "missing" or isinstance(error.get("input"), (bytes, str))):
        return ("the request body must be a JSON object, sent with 'content-type: application/json'"
                + ("" if kind == "missing" else f", got {_shown(error.get('input'))}"))
    if kind == "missing":
        return f"'{path}' is required"
    if kind == "json_invalid":
        return (f"request body is not valid JSON: {error.get('ctx', {}).get('error', msg)} (send a JSON object with "
                f"'content-type: application/json')")
    msg = msg.removeprefix("Value error, ")
    text = f"{path}: {msg}" if path else msg
    if kind.endswith("_type") or kind.endswith("_parsing"):
        text += f", got {_shown(error.get('input'))}"
    return text


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown[:_MAX_INPUT_REPR] + "..." if len(shown) > _MAX_INPUT_REPR else shown


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    messages = [_describe(e) for e in errors[:_MAX_ERRORS_SHOWN]]
    if len(errors) > _MAX_ERRORS_SHOWN:
        messages.append(f"and {len(errors) - _MAX_ERRORS_SHOWN} more")
    is_field_error = errors and errors[0].get("type") != "json_invalid"
    param = field_path(errors[0].get("loc", ())) if is_field_error else None
    return invalid_request("; ".join(messages), param=param or None)


def from_pydantic(exc: ValidationError, prefix: tuple = ()) -> APIError:
    errors = [{**e, "loc": (*prefix, *e["loc"])} for e in exc.errors()]
    return validation_error(errors)


_LEADING_FIELD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\]|\.[A-Za-z_][A-Za-z0-9_]*)*): ")


def client_field(message: str, field_names: dict[str, str]) -> tuple[str, str | None]:
    """(message, param) for an entry model's refusal `field[...]: rule`: the field renamed per `field_names`
    (`text_input: 9 bytes ...` -> `prompt: 9 bytes ...`, param `prompt`); (message, None) if it names none."""
    match = _LEADING_FIELD.match(message)
    if match is None:
        return message, None
    name, rest = match.groups()
    param = field_names.get(name + rest) or field_names.get(name, name) + rest  # a whole path's own name first
    return param + message[match.end(2):], param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code >= 500:
            return server_error(str(exc.detail), status=exc.status_code).response()
        if exc.status_code == 400 and exc.detail == _FASTAPI_BODY_ERROR:
            return invalid_request(_BODY_UNPARSED).response()
        # Starlette's 405 names the methods the route takes in `Allow` (RFC 9110 requires it): kept
        return APIError(exc.status_code, str(exc.detail), param=getattr(exc, "param", None),
                        headers=getattr(exc, "headers", None)).response()


# FastAPI's words when json.loads raises what is not a JSONDecodeError, as parse_json names them
_FASTAPI_BODY_ERROR = "There was an error parsing the body"
_BODY_UNPARSED = (f"request body could not be parsed: it nests arrays or objects too deeply (at most about "
                  f"{MAX_JSON_DEPTH} levels), holds a number of more than {sys.get_int_max_str_digits()} digits, "
                  f"or is not UTF-8 text")


def from_exception(exc: BaseException, timeout_s: float | None = None, retry_after_s: int = 1,
                   field_names: dict[str, str] | None = None) -> APIError:
    """Map an error raised while serving (a Triton error or a bug) to the response the client gets. An entry
    model's refusal names its field first (`max_tokens: ...`): that becomes the error's `param`, in the client's
    name for it where `field_names` renames it (the request's `GenerationRequest.field_names`)."""
    if isinstance(exc, APIError):
        return exc
    retry = {"Retry-After": str(retry_after_s)}
    if isinstance(exc, TritonInvalidRequest):
        message, param = client_field(str(exc), field_names or {})
        return invalid_request(message, param=param)
    if isinstance(exc, TritonOverloaded):
        return APIError(429, f"the server is at capacity: {exc}", code="overloaded", headers=retry)
    if isinstance(exc, TritonTimeout):
        limit = f" of {timeout_s:g} s" if timeout_s else ""
        return APIError(504, f"the request did not finish within its time limit{limit}", code="deadline_exceeded")
    if isinstance(exc, TritonRefusedNow):
        return APIError(503, str(exc), code="unavailable", headers=retry)
    if isinstance(exc, TritonUnavailable):
        error = server_error(f"triton unavailable: {exc}", status=503, public="inference server unavailable")
        error.headers = retry
        return error
    if isinstance(exc, TritonServerError):
        return server_error(f"triton: {exc}")
    return server_error(f"{type(exc).__name__}: {exc}", exc_info=exc)
