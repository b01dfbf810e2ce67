"""The OpenAI-compatible proxy: `create_app(settings)` builds the FastAPI app in front of Triton.

Request path: RequestContext middleware (request id, body cap, last-resort 500) -> route (validate, build
the GenerationRequest, refuse what cannot be honoured) -> ServingContext (one Triton gRPC stream) -> JSON
or SSE.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mstar_common import wire
from mstar_common.config import MAX_TIMEOUT_S
from mstar_common.proxy import (
    protocol,
    serving_chat,
    serving_completions,
    serving_generate,
    serving_images,
    serving_speech,
    serving_transcriptions,
)
from mstar_common.proxy.errors import (
    REQUEST_ID,
    SURROGATE_ESCAPE,
    APIError,
    BodyTooLarge,
    NotUnicodeText,
    NotUTF8Body,
    install_error_handlers,
    non_text_path,
    server_error,
)
from mstar_common.proxy.serving_common import ServingContext, TritonClient
from mstar_common.proxy.triton_stream import TritonStreamClient

logger = logging.getLogger(__name__)

MODEL_KINDS = ("text", "speech", "image", "transcription")
REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


@dataclass(slots=True)
class ServedModel:
    name: str  # the OpenAI `model` clients send
    triton_model: str  # the Triton entry model, e.g. "qwen3_llm"
    kind: str = "text"  # family kind; decides which routes and fields apply


@dataclass(slots=True)
class ProxySettings:
    triton_url: str = "127.0.0.1:8001"  # Triton gRPC endpoint
    models: list[ServedModel] = field(default_factory=list)
    request_timeout_s: float | None = 600.0  # whole-request deadline on the Triton stream; None: none
    max_body_bytes: int = 16 * 1024 * 1024
    health_timeout_s: float = 2.0  # per Triton health RPC
    retry_after_s: int = 1  # Retry-After of a 429 (queue full) or 503 (not ready, queue wait too long)
    allow_remote_urls: bool = False  # fetch media given as http(s) URLs; never file paths (proxy/limits.py)
    created: int | None = None  # the model cards' `created` (unix s); None: when the app is built. One value for
    # every worker process of a multi-worker proxy, so that /v1/models answers alike whichever worker serves it

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("ProxySettings.models: serve at least one model")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"ProxySettings.models: duplicate model names in {names}")
        for m in self.models:
            if m.kind not in MODEL_KINDS:
                raise ValueError(f"ProxySettings.models[{m.name!r}].kind must be one of {MODEL_KINDS}, got {m.kind!r}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"ProxySettings.max_body_bytes must be > 0, got {self.max_body_bytes}")
        # finite and at most a week, as the deployment's keys: an inf or nan deadline passed here and failed every
        # request at its conversion to microseconds (a 500)
        if self.request_timeout_s is not None and not 0 < self.request_timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"ProxySettings.request_timeout_s must be seconds in (0, {MAX_TIMEOUT_S}] or None (no "
                             f"limit), got {self.request_timeout_s}")
        if self.retry_after_s < 1:
            raise ValueError(f"ProxySettings.retry_after_s must be >= 1, got {self.retry_after_s}")


class RequestContext:
    """ASGI middleware: request id (honoured or generated, echoed), body size cap, last-resort 500."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, retry_after_s: int = 1):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers: dict[str, str] = {}
        codings = []  # Content-Encoding's lines, all of them (RFC 9110: repeated lines are one list)
        for key, value in scope["headers"]:  # a header sent twice: its first value, which Starlette's routes read
            name = key.decode("latin-1").lower()
            headers.setdefault(name, value.decode("latin-1"))
            if name == "content-encoding":
                codings += [c.strip().lower() for c in value.decode("latin-1").split(",") if c.strip()]
        request_id = headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        id_header = (REQUEST_ID_HEADER.encode(), request_id.encode("latin-1"))
        is_started = False
        start = time.monotonic()
        # the path as the client sent it (percent-encoded: ASGI's `path` is decoded, so a %0A in it wrote a line of
        # the client's into the log), bounded
        raw_path = scope.get("raw_path")
        path = raw_path.decode("latin-1") if raw_path else scope["path"]
        target = f"{scope.get('method')} {wire.loggable(path, 200)}"

        async def send_with_id(message: Message) -> None:
            nonlocal is_started
            if message["type"] == "http.response.start":
                is_started = True
                message = {**message, "headers": [*message.get("headers", []), id_header]}
                # One line per request, keyed by the id that Triton and the component logs also carry.
                logger.info("[%s] %s -> %d in %.1f ms", request_id, target, message["status"],
                            1e3 * (time.monotonic() - start))
            await send(message)

        async def reply(error: APIError) -> None:
            await error.response()(scope, receive, send_with_id)

        if not _REQUEST_ID.fullmatch(request_id):
            id_header = (REQUEST_ID_HEADER.encode(), b"invalid")
            request_id = "invalid"  # the client's text stays out of the log line (it could forge one)
            return await reply(APIError(400, f"header '{REQUEST_ID_HEADER}' must be 1-128 characters of "
                                             "[A-Za-z0-9._:-]", param=REQUEST_ID_HEADER))
        if _content_length(headers) > self.max_body_bytes:
            return await reply(APIError(413, str(BodyTooLarge(self.max_body_bytes).detail)))
        encoding = ", ".join(c for c in codings if c != "identity")
        if encoding:  # a compressed body was parsed as it came: a 400 blaming its bytes
            return await reply(APIError(415, f"Content-Encoding '{wire.loggable(encoding, 40)}' is not accepted: send "
                                             "the body uncompressed", param="content-encoding",
                                        headers={"Accept-Encoding": "identity"}))
        scope.setdefault("state", {})["request_id"] = request_id
        context = REQUEST_ID.set(request_id)  # the fault lines logged while this request is served carry its id
        is_json = headers.get("content-type", "application/json").split(";", 1)[0].strip().lower()
        is_json = is_json == "application/json" or is_json.endswith("+json")
        try:
            await self.app(scope, self._capped(receive, check_text=is_json), send_with_id)
        except ClientDisconnect:  # the client left while its body was being read: nobody to answer
            logger.info("[%s] %s -> client disconnected (499) in %.1f ms", request_id, target,
                        1e3 * (time.monotonic() - start))
        except asyncio.CancelledError:
            # the server stopping: uvicorn cancels what still runs when its drain ends, and answered a request not
            # yet answered with its own text 500; it gets the 503 docs/reliability.md promises instead
            if not is_started:
                with contextlib.suppress(Exception):
                    await reply(APIError(503, "the server stopped before this request finished; retry it",
                                         headers={"Retry-After": str(self.retry_after_s)}))
            raise
        except Exception as exc:  # noqa: BLE001 - a bug must still answer with an error id
            if is_started:
                raise
            await reply(server_error(f"unhandled {type(exc).__name__} in {target}: {exc}", exc_info=exc))
        finally:
            REQUEST_ID.reset(context)

    def _capped(self, receive: Receive, check_text: bool = False) -> Receive:
        """`receive`, refusing a body over the cap (413) and, with `check_text`, a JSON body whose strings are
        not Unicode text (a lone surrogate escape such as \\ud800: 400 naming the field)."""
        num_bytes = 0
        chunks: list[bytes] = []

        async def capped() -> Message:
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                num_bytes += len(body)
                if num_bytes > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
                if check_text:
                    chunks.append(body)
                    if not message.get("more_body", False):
                        check_json_text(b"".join(chunks))
                        chunks.clear()
            return message

        return capped


def check_json_text(body: bytes) -> None:
    """Raise NotUTF8Body unless this JSON body is UTF-8 text, and NotUnicodeText if a string (or key) of it holds
    a lone UTF-16 surrogate: JSON allows the escape, but no text encoding can carry it on to the server. Cheap unless
    the body has a surrogate escape. A NUL byte is no UTF-8 JSON's (its strings escape control characters): it
    marks UTF-16 or UTF-32, which json.loads would read, escapes and all, past the surrogate search."""
    if b"\x00" in body:
        raise NotUTF8Body(body.index(b"\x00"))
    if not body.isascii():
        try:
            body.decode("utf-8")  # strict: refuses CESU-8's encoded surrogates (ED A0..BF ..) as well
        except UnicodeDecodeError as exc:
            raise NotUTF8Body(exc.start) from None
    if not SURROGATE_ESCAPE.search(body):
        return
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return  # not JSON: the route's own parsing says so
    if (found := non_text_path(parsed)) is not None:
        raise NotUnicodeText(found[0], key=found[1])


def _content_length(headers: dict[str, str]) -> int:
    try:
        return int(headers.get("content-length") or 0)
    except ValueError:
        return 0  # malformed: the server's parser refuses it; the receive cap still applies


def create_app(settings: ProxySettings, triton: TritonClient | None = None) -> FastAPI:
    """The proxy app. `triton` replaces the real gRPC client (tests pass a fake)."""
    client: TritonClient = triton or TritonStreamClient(settings.triton_url, health_timeout_s=settings.health_timeout_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await client.close()

    app = FastAPI(title="M* on Triton", lifespan=lifespan)
    app.state.serving = ServingContext(settings, client)
    install_error_handlers(app)
    app.add_middleware(RequestContext, max_body_bytes=settings.max_body_bytes, retry_after_s=settings.retry_after_s)
    for module in (serving_chat, serving_completions, serving_generate, serving_speech, serving_images,
                   serving_transcriptions):
        app.include_router(module.router)
    _add_info_routes(app)
    return app


def _add_info_routes(app: FastAPI) -> None:
    # GET and HEAD (RFC 9110: a general-purpose server supports both; `curl -I` and HEAD readiness probes got 405)
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request):
        ctx: ServingContext = request.app.state.serving
        if await ctx.triton.is_ready([m.triton_model for m in ctx.models.values()]):
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def list_models(request: Request):
        ctx: ServingContext = request.app.state.serving
        return {"object": "list", "data": [protocol.model_card(name, ctx.created) for name in ctx.models]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def get_model(model_id: str, request: Request):
        if not model_id:  # `/v1/models/`: the list (it was "model '' does not exist")
            return await list_models(request)
        ctx: ServingContext = request.app.state.serving
        return protocol.model_card(ctx.resolve(model_id, kinds=MODEL_KINDS).name, ctx.created)
