"""What every route shares: model lookup, running one Triton stream, and noticing a client that left."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import parse_qsl, unquote_plus

from fastapi import Request
from starlette.datastructures import FormData

from mstar_common import wire
from mstar_common.proxy.errors import APIError, from_exception, invalid_request, parse_json
from mstar_common.proxy.triton_stream import GenerationRequest, StreamResponse

if TYPE_CHECKING:
    from mstar_common.proxy.app import ProxySettings, ServedModel

T = TypeVar("T")


MAX_TEXT_FIELD_BYTES = 1 << 20  # a multipart text field (not a file), as Starlette's default part cap


_FORM_TRUE, _FORM_FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")


def form_bool(value: str, field: str) -> bool:
    """A form field's true/false (`true`, `1`, `yes`, `on` and their opposites, any case; empty is false); any
    other value is a 400 naming `field`."""
    if value.strip().lower() in _FORM_TRUE:
        return True
    if value.strip().lower() in _FORM_FALSE:
        return False
    raise invalid_request(f"'{field}' must be true or false, got {value!r}", param=field)


# ASCII spellings only: int() and float() also read "1_0" as 10 and other scripts' digits ("٥" is 5), which no
# JSON route takes, so a typo would become another request
_FORM_INT = re.compile(r"[+-]?[0-9]+")
_FORM_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(?:inf|infinity|nan)", re.I)


def form_int(value: str, field: str) -> int:
    """A form field's integer in ASCII digits (an optional sign, spaces around); else a 400 naming `field`."""
    if _FORM_INT.fullmatch(text := value.strip()):
        try:
            return int(text)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits(), 4,300)
            pass
    raise invalid_request(f"'{field}' must be an integer, got {value[:40]!r}{'...' if len(value) > 40 else ''}",
                          param=field)


def form_float(value: str) -> float | None:
    """A form field's number as a JSON or C float is written (inf and nan included, for the caller's own finite
    rule to name); None where it is none (the caller names the field)."""
    return float(text) if _FORM_FLOAT.fullmatch(text := value.strip()) else None


async def read_utf8_form(request: Request) -> FormData:
    """The request's form, refused (400 naming the field) where a text field is not UTF-8. Starlette decodes such
    a multipart field as latin-1, and a urlencoded body as latin-1 before its %XX escapes (so raw UTF-8 there
    turns to mojibake), silently. A urlencoded body is parsed here instead, as UTF-8 throughout; a multipart
    body's raw bytes (already capped by the proxy's middleware) tell its text fields apart."""
    body = await request.body()
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "application/x-www-form-urlencoded":
        return FormData(_urlencoded_pairs(body))
    # the boundary and charset as Starlette's parser reads them (python-multipart's: spaces around ';' and '=', the
    # last of a parameter sent twice), so that what is checked here is what it decodes with
    from starlette.formparsers import parse_options_header  # the parser's own (python-multipart's, either name)

    _, params = parse_options_header(request.headers.get("content-type", ""))
    _check_multipart_closed(body, params.get(b"boundary"))
    # Starlette decodes the parts' names and text in the charset the Content-Type names (utf-7 and unicode_escape
    # make lone surrogates of plain ASCII, which failed at their first encode: a 500); the fields are UTF-8
    charset = params.get(b"charset", b"utf-8").decode("latin-1")
    if charset.lower() not in ("utf-8", "utf8", "us-ascii", "ascii"):
        raise invalid_request(f"a multipart/form-data body's charset must be utf-8, not '{wire.loggable(charset, 40)}'")
    # parsed from the body read above (which the proxy's middleware capped); a text field's size is checked here,
    # where its name is known (Starlette's own part cap answers with a message that names no field)
    form = await request.form(max_part_size=max(len(body), 1))
    for key, value in form.multi_items():
        if not wire.is_unicode_text(key):
            raise invalid_request(f"the form field name '{wire.loggable(key, 100)}' is not UTF-8 text")
        if isinstance(value, str) and not value.isascii() and (  # decoded as something else, or a lone surrogate
                not wire.is_unicode_text(value) or value.encode("utf-8") not in body):
            raise invalid_request(f"'{key}' is not UTF-8 text (an upload needs a filename in its part's "
                                  f"Content-Disposition)", param=key)
        if isinstance(value, str) and len(value) > MAX_TEXT_FIELD_BYTES // 4 \
                and len(value.encode("utf-8")) > MAX_TEXT_FIELD_BYTES:
            raise invalid_request(f"'{key}' is a text field of {len(value.encode('utf-8'))} bytes; the limit is "
                                  f"{MAX_TEXT_FIELD_BYTES} (an upload needs a filename in its part's "
                                  f"Content-Disposition)", param=key)
    return form


def _check_multipart_closed(body: bytes, boundary: bytes | None) -> None:
    """A multipart body must hold its closing delimiter (`--boundary--`): Starlette reads a truncated one as the
    parts it got so far, or none, so the route would blame a missing field for a cut-off upload."""
    if not boundary:
        raise invalid_request("a multipart/form-data body needs a boundary parameter in its Content-Type")
    if b"--" + boundary + b"--" not in body:
        raise invalid_request("the multipart body is truncated or malformed: its closing boundary is missing")


FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
MODALITY_FIELDS = ("input_modalities", "output_modalities")  # list fields: a form may repeat them


def form_modalities(values: list[Any], field: str) -> list[str]:
    """A modalities list sent in a form: the field repeated (httpx sends a list so), a JSON list, or
    comma-separated names, the same on every /generate path; a 400 naming `field` for an upload, a list that is
    empty or holds anything but names."""
    out: list[Any] = []
    for value in values:
        if not isinstance(value, str):
            raise invalid_request(f"'{field}': unexpected file upload", param=field)
        if value.lstrip().startswith("["):
            parsed = parse_json(value, field, param=field)
            out.extend(parsed if isinstance(parsed, list) else [parsed])
        else:
            out.extend(v.strip() for v in value.split(",") if v.strip())
    if not out or not all(isinstance(v, str) for v in out):
        raise invalid_request(f"'{field}': must be a list of modality names, got {out!r}", param=field)
    return out


async def requested_model(request: Request) -> Any:
    """The `model` field of a /generate body (form or JSON), as sent; None where it has none or is not readable
    (the route's own parse then says why)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type in FORM_TYPES:
        return (await read_utf8_form(request)).get("model")
    try:
        body = parse_json(await request.body(), "request body")
    except APIError:  # not JSON, not UTF-8, not Unicode text, a number past the int digit limit, or nested past the
        # parser's depth: the route's parse says which
        return None
    return body.get("model") if isinstance(body, dict) else None


async def generate_model(request: Request, ctx: ServingContext, kinds: tuple[str, ...]) -> ServedModel | None:
    """The served model of one of `kinds` that a /generate request names (or the only served model, if it is of
    one of them), else None (another route module serves it)."""
    if not any(m.kind in kinds for m in ctx.models.values()):
        return None
    name = await requested_model(request)
    if name is None and len(ctx.models) == 1:
        name = next(iter(ctx.models))
    served = ctx.models.get(name) if isinstance(name, str) else None
    return served if served is not None and served.kind in kinds else None


def _urlencoded_pairs(body: bytes) -> list[tuple[str, str]]:
    pairs = []
    for chunk in body.split(b"&"):
        if not chunk:
            continue
        try:
            pairs.extend(parse_qsl(chunk.decode("utf-8"), keep_blank_values=True, encoding="utf-8", errors="strict"))
        except UnicodeDecodeError:
            key = unquote_plus(chunk.partition(b"=")[0].decode("utf-8", errors="replace"), errors="replace")
            raise invalid_request(f"'{key}' is not UTF-8 text", param=key) from None
    return pairs


class TritonClient(Protocol):
    """The interface the routes use; `TritonStreamClient` implements it, tests inject fakes."""

    def generate(
        self, model: str, request_id: str, gen: GenerationRequest, timeout_s: float | None = None
    ) -> AsyncIterator[StreamResponse]: ...

    async def is_ready(self, models: list[str]) -> bool: ...

    async def close(self) -> None: ...


class ClientDisconnected(APIError):
    def __init__(self) -> None:
        super().__init__(499, "client closed the request")


@dataclass(slots=True)
class Completion:
    """A generation folded from its stream of responses."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, response: StreamResponse) -> None:
        self.text += response.text
        self.token_ids.extend(response.token_ids)
        if response.finish_reason:
            self.finish_reason = response.finish_reason
        if response.prompt_tokens is not None:
            self.prompt_tokens = response.prompt_tokens
        if response.completion_tokens is not None:
            self.completion_tokens = response.completion_tokens

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    @property
    def finish(self) -> str:
        return self.finish_reason or "stop"


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it (and so its Triton request) if the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ClientDisconnected()
    return work.result()


class ServingContext:
    """Per-app state the routes share (kept on `app.state.serving`)."""

    def __init__(self, settings: ProxySettings, triton: TritonClient):
        self.settings = settings
        self.triton = triton
        self.models = {m.name: m for m in settings.models}
        self.created = int(time.time()) if settings.created is None else settings.created

    def resolve(self, name: str | None, param: str = "model", kinds: tuple[str, ...] = ("text",)) -> ServedModel:
        """The served model `name`, which must be of one of `kinds` (the route's: text or speech)."""
        if name is None:
            if len(self.models) == 1:
                name = next(iter(self.models))
            else:
                raise APIError(400, f"'{param}' is required: this server serves {sorted(self.models)}", param=param)
        if name not in self.models:
            raise APIError(404, f"model '{name}' does not exist; served models: {sorted(self.models)}",
                           param=param, code="model_not_found")
        served = self.models[name]
        if served.kind not in kinds:
            raise APIError(400, f"model '{name}' is a {served.kind} model; this route serves {' or '.join(kinds)} "
                                "models", param=param)
        return served

    def _open(self, served: ServedModel, request_id: str, gen: GenerationRequest) -> AsyncIterator[StreamResponse]:
        return self.triton.generate(served.triton_model, request_id, gen, self.settings.request_timeout_s)

    def error(self, exc: BaseException, gen: GenerationRequest | None = None) -> APIError:
        """What the client gets for `exc`: this server's deadline and Retry-After, `gen`'s names for its fields."""
        return from_exception(exc, self.settings.request_timeout_s, self.settings.retry_after_s,
                              gen.field_names if gen is not None else None)

    async def complete(self, request: Request, served: ServedModel, gen: GenerationRequest) -> Completion:
        """Run a request to its end and fold it into one Completion."""

        async def collect() -> Completion:
            completion = Completion()
            stream = self._open(served, request.state.request_id, gen)
            try:
                async for response in stream:
                    completion.add(response)
            finally:
                await stream.aclose()
            return completion

        try:
            return await until_disconnect(request, collect())
        except Exception as exc:
            raise self.error(exc, gen) from None

    async def stream(
        self, request: Request, served: ServedModel, gen: GenerationRequest
    ) -> AsyncIterator[StreamResponse]:
        """Open a stream and wait for its first response, so a refused request is still a plain 4xx."""
        stream = self._open(served, request.state.request_id, gen)
        try:
            first = await until_disconnect(request, anext(stream, None))
        except BaseException as exc:
            await stream.aclose()
            if isinstance(exc, Exception):
                raise self.error(exc, gen) from None
            raise
        return _prepend(first, stream)


async def _prepend(first: StreamResponse | None, rest: AsyncIterator[StreamResponse]) -> AsyncIterator[Any]:
    try:
        if first is not None:
            yield first
            if first.is_final:
                return
        async for response in rest:
            yield response
    finally:
        await rest.aclose()
