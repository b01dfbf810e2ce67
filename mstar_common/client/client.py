"""`MStarClient`: a small synchronous client for the proxy's native `/generate` route (httpx).

    client = MStarClient("http://localhost:8000")
    client.chat("What is the capital of France?").text
    for event in client.chat("Tell me a story", stream=True):
        print(event.text, end="")
"""

from __future__ import annotations

import email.utils
import math
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any, TypeVar

import httpx

from mstar_common.client.images import ImageMethods
from mstar_common.client.speech import SpeechMethods
from mstar_common.client.transcription import TranscriptionMethods
from mstar_common.client.types import (
    TIMEOUT_ERRORS,
    TRANSPORT_ERRORS,
    ChatEvent,
    ChatResult,
    EventStream,
    MStarConnectionError,
    MStarError,
    set_knobs,
    sse_events,
)

R = TypeVar("R")
# A whole image or a long clip can take minutes at full load. A minute past the server's default deadline
# (admission.request_timeout_s, 600 s): a request the server ends there reaches the caller as its 504 (MStarError,
# code deadline_exceeded), not as this client giving up first (an MStarConnectionError that says less).
DEFAULT_TIMEOUT_S = 660.0


class _Unset:
    """The default of `timeout`: DEFAULT_TIMEOUT_S on a client of the SDK's own, an http_client's own timeout on
    that one."""

    def __repr__(self) -> str:
        return f"{DEFAULT_TIMEOUT_S:.0f} s, or the http_client's own"


UNSET = _Unset()


class MStarClient(ImageMethods, SpeechMethods, TranscriptionMethods):
    def __init__(
        self,
        base_url: str = "http://localhost:8000",
        timeout: float | None | _Unset = UNSET,
        *,
        model: str | None = None,
        http_client: httpx.Client | None = None,
    ):
        """`timeout`: seconds to wait for an answer, and between two reads of a stream (None: no limit; unset:
        660 s, past the server's default deadline). `model`: default model name (optional when the server serves
        one). `http_client`: use this httpx.Client (e.g. a Starlette TestClient) instead of opening one to
        `base_url`; it keeps its own timeout unless `timeout` is given, which then applies to this client's
        requests on it (the http_client itself is left as it is, for its other users)."""
        self.model = model
        self._is_owner = http_client is None
        # per request, and only when given: an http_client may be another httpx-like client (Starlette's TestClient
        # is httpx2's), which takes a number or None but not httpx's own "use the client's default" marker
        self._timeout: dict[str, float | None] = {} if isinstance(timeout, _Unset) else {"timeout": timeout}
        if http_client is None:
            own = DEFAULT_TIMEOUT_S if isinstance(timeout, _Unset) else timeout
            http_client = httpx.Client(base_url=base_url, timeout=own)
        self._http = http_client

    def chat(
        self, prompt_or_messages: str | list[dict[str, Any]], stream: bool = False, *, model: str | None = None,
        **knobs: Any,
    ) -> ChatResult | EventStream[ChatEvent]:
        """Chat with the model (its chat template applies). `knobs` are generation knobs (max_tokens,
        temperature, top_p, top_k, min_p, repetition_penalty, seed, stop, ignore_eos, enable_thinking,
        chat_template_kwargs, return_token_ids)."""
        if "messages" in knobs:
            raise TypeError("chat() takes the conversation as its first argument (a string or a list of messages); "
                            "'messages' is not a knob")
        if isinstance(prompt_or_messages, str):
            messages = [{"role": "user", "content": prompt_or_messages}]
        else:
            messages = list(prompt_or_messages)
        return self._generate({"model_kwargs": {**set_knobs(knobs), "messages": messages}}, stream, model)

    def generate(
        self, text: str, stream: bool = False, *, model: str | None = None, **model_kwargs: Any
    ) -> ChatResult | EventStream[ChatEvent]:
        """Native /generate with `text` and `model_kwargs`. On a text model `text` is the user's message: the chat
        template applies as in `chat` (so do `enable_thinking` and `chat_template_kwargs`)."""
        return self._generate({"text": text, "model_kwargs": set_knobs(model_kwargs)}, stream, model)

    def models(self) -> list[str]:
        response = self._call(self._http.build_request("GET", "/v1/models", **self._timeout))
        return self._json(response, lambda data: [card["id"] for card in data["data"]])

    def health(self) -> bool:
        """True when the proxy reports Triton live and every served model ready: a 200 whose JSON body says
        `{"status": "ok"}` (another server's 200 at that address is False, as is no answer)."""
        self._check_open()
        try:
            response = self._http.get("/health", **self._timeout)
        except TRANSPORT_ERRORS:
            return False
        if response.status_code != 200:
            return False
        try:
            body = response.json()
        except ValueError:
            return False
        return isinstance(body, dict) and body.get("status") == "ok"

    def close(self) -> None:
        """Close the connections this client opened (an `http_client` given to it stays open: its owner closes it);
        a call on a closed client is an MStarConnectionError."""
        if self._is_owner:
            self._http.close()

    def __enter__(self) -> MStarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # internals

    def _generate(self, payload: dict[str, Any], stream: bool, model: str | None
                  ) -> ChatResult | EventStream[ChatEvent]:
        body = {**payload, "streaming": stream, "output_modalities": ["text"]}
        if (name := self._model(model)) is not None:
            body["model"] = name
        if stream:
            return self._stream(body)
        return self._json(self._post(json=body), _chat_result)

    def _stream(self, body: dict[str, Any]) -> EventStream[ChatEvent]:
        response = self._open_stream(json=body)
        return EventStream(response, _events(response))

    def _model(self, model: str | None) -> str | None:
        """The model a call names: its own `model`, else the client's default, else None (the server's only one)."""
        for name, given in (("model", model), ("MStarClient.model", self.model)):
            if given is not None and (not isinstance(given, str) or not given):
                raise ValueError(f"{name}: must be a non-empty model name, or None, got {given!r}")
        return model if model is not None else self.model

    def _post(self, **content: Any) -> httpx.Response:
        """POST /generate (`content`: httpx's json=, or data= and files=)."""
        return self._call(self._build(content))

    def _open_stream(self, **content: Any) -> httpx.Response:
        """POST /generate and return the response once its status says it streams (else its MStarError)."""
        response = self._call(self._build(content), stream=True)
        if response.status_code != 200:
            try:
                response.read()
            except TRANSPORT_ERRORS as exc:
                raise MStarConnectionError(f"{response.request.url}: [{response.status_code}] the connection was lost "
                                           f"before the error's message ({exc!r})") from None
            finally:
                response.close()
            raise _error(response)
        return response

    def _build(self, content: dict[str, Any]) -> httpx.Request:
        try:
            return self._http.build_request("POST", "/generate", **self._timeout, **content)
        except (ValueError, TypeError) as exc:  # e.g. a NaN knob (not JSON), a lone surrogate, an odd file object
            raise MStarError(400, f"the request cannot be encoded: {exc}") from None

    def _call(self, request: httpx.Request, stream: bool = False) -> httpx.Response:
        self._check_open()
        try:
            return self._http.send(request, stream=stream)
        except TIMEOUT_ERRORS as exc:
            raise MStarConnectionError(f"{request.url}: no answer within the client's timeout ({exc!r})") from None
        except TRANSPORT_ERRORS as exc:
            raise MStarConnectionError(f"{request.url}: could not reach the server ({exc})") from None

    def _check_open(self) -> None:
        """httpx raises a bare RuntimeError for a request on a closed client: say which client, and what to do."""
        if self._http.is_closed:
            raise MStarConnectionError("the client is closed (by close(), the end of its `with` block, or its "
                                       "http_client's owner): make a new MStarClient")

    @staticmethod
    def _json(response: httpx.Response, parse: Callable[[Any], R]) -> R:
        """`parse` of a 200 JSON answer (else its MStarError): the one place an answer is read, so one that lacks
        what `parse` reads is a 502 MStarError naming it, never a bare KeyError from deep inside a method."""
        if response.status_code != 200:
            raise _error(response)
        try:
            data = response.json()
        except ValueError:
            raise MStarError(502, f"{response.request.url}: the answer is not JSON (is this an M* proxy?)") from None
        try:
            return parse(data)
        except KeyError as exc:
            raise MStarError(502, f"{response.request.url}: the answer has no {exc.args[0]!r} "
                                  f"(is this an M* proxy of the same version?)") from None
        except (IndexError, TypeError, ValueError) as exc:  # an empty list, a list for an object, a bad base64
            raise MStarError(502, f"{response.request.url}: the answer is not in the shape the SDK reads "
                                  f"({type(exc).__name__}: {exc})") from None


def _chat_result(data: dict[str, Any]) -> ChatResult:
    return ChatResult(text="".join(data["outputs"]["text"]), finish_reason=data["finish_reason"],
                      usage=data.get("usage", {}), token_ids=data.get("token_ids"))


def _events(response: httpx.Response) -> Iterator[ChatEvent]:
    return sse_events(response, lambda event: ChatEvent(
        text=event.get("text", ""), finish_reason=event.get("finish_reason"), token_ids=event.get("token_ids"),
        usage=event.get("usage")))


def _error(response: httpx.Response) -> MStarError:
    try:
        error = response.json()["error"]
        message, param, code = error["message"], error.get("param"), error.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, param, code = response.text or response.reason_phrase, None, None
    return MStarError(response.status_code, message, _retry_after(response.headers.get("retry-after")),
                      param=param if isinstance(param, str) else None, code=code if isinstance(code, str) else None)


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds: delay-seconds (what the proxy sends) or an HTTP date; None if absent or unreadable."""
    if value is None:
        return None
    try:
        seconds = float(value)
        return max(0.0, seconds) if math.isfinite(seconds) else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds()) if when.tzinfo else None
