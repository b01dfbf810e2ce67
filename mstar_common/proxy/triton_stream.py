"""The proxy's only path to Triton: one request per gRPC stream, responses parsed per `mstar_common.wire`.

`TritonStreamClient.generate()` is an async generator. Closing it early (the HTTP client went away, or the
task was cancelled) cancels the gRPC call, which Triton turns into a cancellation of the request, so the
entry model frees its resources. All requests share one gRPC channel, opened lazily inside the event loop.

Tests substitute any object with the same `generate`, `is_ready` and `close` coroutines.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, KeepAliveOptions, service_pb2
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import (
    InferenceServerException,
    deserialize_bytes_tensor,
    serialize_byte_tensor,
    triton_to_np_dtype,
)

from mstar_common import wire

logger = logging.getLogger(__name__)

_FINAL_PARAM = "triton_final_response"
_EMPTY_FINAL_PARAM = "triton_enable_empty_final_response"
_TIMEOUT_PARAM = "timeout"  # microseconds, as tritonclient's `timeout=` sets it
END_AFTER_FINAL_S = 2.0  # how long a stream whose final response came may take to end before it is cancelled
DEADLINE_GRACE_S = 5.0  # the gRPC deadline trails the server-side one, so the server's clean 504 comes first
# gRPC waits 1 s, then 1.6x longer after each failed connection attempt, up to 120 s by default: after a relaunch of
# a minute or two (a GPU server compiling its kernels) the proxy would answer 503 for up to two minutes more. With
# this ceiling it reconnects within about a second of Triton's return.
MAX_RECONNECT_BACKOFF_MS = 1000


def channel_args() -> list[tuple[str, int]]:
    """tritonclient's own channel options (message sizes unbounded, its keepalive defaults) and the ceiling above."""
    keepalive = KeepAliveOptions()
    return [("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
            ("grpc.enable_http_proxy", 0)]  # Triton is ours to reach directly, whatever http_proxy says


@dataclass(slots=True)
class GenerationRequest:
    """What the proxy asks an entry model for; exactly one of text / messages / input_ids is set."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    sampling: dict[str, int | float | bool] = field(default_factory=dict)  # keys from wire.SAMPLING_INPUTS
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    voice: str | None = None  # speech entry models only
    tensors: list[tuple[str, str, np.ndarray]] = field(default_factory=list)  # image entry models: (name, dtype, array)
    # the client's name for an entry-model input that a refusal may name (e.g. text_input -> prompt); not sent
    field_names: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class StreamResponse:
    """One streamed response: the new text and tokens since the previous one."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # set on the last data response only
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    is_final: bool = False
    audio: np.ndarray | None = None  # speech: PCM16 samples since the previous response
    sample_rate: int | None = None
    images: list[bytes] = field(default_factory=list)  # image entry models: encoded images
    seed: int | None = None  # image entry models: the seed used
    transcript: dict[str, Any] | None = None  # transcription entry models, last response: language, duration, segments


class TritonError(Exception):
    """Base of the errors `generate` raises; the message is what Triton (or gRPC) said."""


class TritonInvalidRequest(TritonError):
    """The entry model refused the request (the client's fault); the message has the prefix removed."""


class TritonServerError(TritonError):
    pass


class TritonUnavailable(TritonError):
    """The server, the model or its component cannot take requests now (503 with Retry-After)."""


class TritonRefusedNow(TritonUnavailable):
    """The component said it cannot take the request now (queue wait limit, draining); the message is public."""


class TritonOverloaded(TritonError):
    """The component's queue is full (429 with Retry-After)."""


class TritonTimeout(TritonError):
    """The request's deadline passed (504)."""


# Triton's own words for a model that cannot serve now (loading, unloading, its stub gone).
_UNAVAILABLE_MARKERS = ("is not ready", "unknown model", "Stub process", "is not healthy")


def classify_error(message: str) -> TritonError:
    """The error a Triton error message stands for, per the prefixes in `mstar_common.wire`."""
    kind = wire.error_class(message)
    if kind == wire.INVALID_REQUEST_PREFIX:
        return TritonInvalidRequest(wire.strip_prefix(message, kind))
    if kind == wire.OVERLOADED_PREFIX:
        return TritonOverloaded(wire.strip_prefix(message, kind))
    if kind == wire.UNAVAILABLE_PREFIX:
        return TritonRefusedNow(wire.strip_prefix(message, kind))
    if kind == wire.DEADLINE_PREFIX:
        return TritonTimeout(wire.strip_prefix(message, kind))
    if any(marker in message for marker in _UNAVAILABLE_MARKERS):
        return TritonUnavailable(message)
    return TritonServerError(message)


# request building


def _bytes_tensor(values: list[str]) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_)


def build_inputs(gen: GenerationRequest) -> list[tuple[str, str, np.ndarray]]:
    """The request's input tensors as (name, Triton datatype, array), per `wire`: scalars are shape [1]."""
    inputs: list[tuple[str, str, np.ndarray]] = []
    if gen.text is not None:
        inputs.append((wire.TEXT_INPUT, "BYTES", _bytes_tensor([gen.text])))
    if gen.messages is not None:
        inputs.append((wire.MESSAGES, "BYTES", _bytes_tensor([json.dumps(gen.messages, ensure_ascii=False)])))
    if gen.input_ids is not None:
        inputs.append((wire.INPUT_IDS, "INT32", np.asarray(gen.input_ids, dtype=np.int32)))
    if gen.chat_template_kwargs:
        kwargs_json = json.dumps(gen.chat_template_kwargs, ensure_ascii=False)
        inputs.append((wire.CHAT_TEMPLATE_KWARGS, "BYTES", _bytes_tensor([kwargs_json])))
    for name, value in gen.sampling.items():
        datatype, np_dtype = wire.SAMPLING_INPUTS[name]
        inputs.append((name, datatype, np.asarray([value], dtype=np_dtype)))
    if gen.stop:
        inputs.append((wire.STOP, "BYTES", _bytes_tensor(gen.stop)))
    if gen.stop_token_ids:
        inputs.append((wire.STOP_TOKEN_IDS, "INT32", np.asarray(gen.stop_token_ids, dtype=np.int32)))
    if gen.voice is not None:
        inputs.append((wire.VOICE, "BYTES", _bytes_tensor([gen.voice])))
    inputs.extend(gen.tensors)
    return inputs


def _raw_contents(datatype: str, array: np.ndarray) -> bytes:
    if datatype == "BYTES":
        serialized = serialize_byte_tensor(array)
        return serialized.item() if serialized.size > 0 else b""
    return np.ascontiguousarray(array).tobytes()


def build_request(
    model: str, request_id: str, gen: GenerationRequest, timeout_s: float | None = None
) -> service_pb2.ModelInferRequest:
    """`timeout_s` becomes the request's Triton `timeout`, which the component enforces as its deadline."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    if timeout_s:  # at least 1 us: a shorter one truncated to 0, which Triton and the components read as none
        request.parameters[_TIMEOUT_PARAM].int64_param = max(1, round(timeout_s * 1e6))
    for name, datatype, array in build_inputs(gen):
        request.inputs.append(
            service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=list(array.shape))
        )
        request.raw_input_contents.append(_raw_contents(datatype, array))
    # The entry model may end a stream with a flags-only FINAL; ask Triton to forward it as an empty response.
    request.parameters[_EMPTY_FINAL_PARAM].bool_param = True
    return request


# response parsing


class _Outputs:
    """A response's output tensors by name, each decoded when asked for. The names are indexed once per response:
    a response is asked for ~11 outputs it may hold, and tritonclient's `InferResult.as_numpy` scans the output
    list for each (42 -> 25 us per text response on a CPU machine, at ~2,000 responses/s through the proxy)."""

    __slots__ = ("_response", "_index")

    def __init__(self, response: service_pb2.ModelInferResponse):
        self._response = response
        self._index = {output.name: i for i, output in enumerate(response.outputs)}

    def as_numpy(self, name: str) -> np.ndarray | None:
        i = self._index.get(name)
        if i is None:
            return None
        output, raw = self._response.outputs[i], self._response.raw_output_contents
        if i < len(raw):  # what Triton sends: every output's bytes in raw_output_contents
            if output.datatype == "BYTES":
                array = deserialize_bytes_tensor(raw[i])
            else:
                array = np.frombuffer(raw[i], dtype=triton_to_np_dtype(output.datatype))
        elif output.contents.bytes_contents:
            array = np.array(list(output.contents.bytes_contents), dtype=np.object_)
        else:
            array = np.empty(0, dtype=triton_to_np_dtype(output.datatype))
        return array.reshape(list(output.shape))


def _scalar(result: _Outputs, name: str) -> Any:
    array = result.as_numpy(name)
    if array is None or array.size == 0:
        return None
    return array.reshape(-1)[0]


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def is_final_message(message: service_pb2.ModelStreamInferResponse) -> bool:
    """Whether Triton marked this stream message as the request's last, an error's included."""
    params = message.infer_response.parameters
    return _FINAL_PARAM in params and params[_FINAL_PARAM].bool_param


def parse_response(message: service_pb2.ModelStreamInferResponse) -> StreamResponse:
    if message.error_message:
        raise classify_error(message.error_message)
    response = message.infer_response
    is_final = is_final_message(message)
    if not response.outputs:
        return StreamResponse(is_final=is_final)
    result = _Outputs(response)
    token_ids = result.as_numpy(wire.TOKEN_IDS)
    prompt_tokens = _scalar(result, wire.PROMPT_TOKENS)
    completion_tokens = _scalar(result, wire.COMPLETION_TOKENS)
    sample_rate = _scalar(result, wire.SAMPLE_RATE)
    return StreamResponse(
        text=_text(_scalar(result, wire.TEXT_OUTPUT)),
        token_ids=[] if token_ids is None else [int(t) for t in token_ids.reshape(-1)],
        finish_reason=_text(_scalar(result, wire.FINISH_REASON)) or None,
        prompt_tokens=None if prompt_tokens is None else int(prompt_tokens),
        completion_tokens=None if completion_tokens is None else int(completion_tokens),
        is_final=is_final,
        audio=result.as_numpy(wire.AUDIO_CHUNK),
        sample_rate=None if sample_rate is None else int(sample_rate),
        images=_image_list(result),
        seed=None if _scalar(result, wire.IMAGE_SEED) is None else int(_scalar(result, wire.IMAGE_SEED)),
        transcript=_transcript(result),
    )


def _transcript(result: _Outputs) -> dict[str, Any] | None:
    """The metadata a transcription entry model sends with its last response (see `wire`), else None."""
    segments = _text(_scalar(result, wire.TRANSCRIPT_SEGMENTS))
    if not segments:
        return None
    duration = _scalar(result, wire.TRANSCRIPT_DURATION)
    return {"language": _text(_scalar(result, wire.TRANSCRIPT_LANGUAGE)),
            "duration": 0.0 if duration is None else float(duration), "segments": json.loads(segments)}


def _image_list(result: _Outputs) -> list[bytes]:
    images = result.as_numpy(wire.IMAGES)
    return [] if images is None else [bytes(image) for image in images.reshape(-1)]


def _from_rpc_error(error: grpc.aio.AioRpcError, is_started: bool = False) -> TritonError:
    code, details = error.code(), error.details() or str(error.code())
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TritonTimeout(details)
    if code == grpc.StatusCode.UNAVAILABLE:
        if is_started:  # the server went away while serving this request: a fault, not "try later"
            return TritonServerError(f"the inference server failed mid-request: {details}")
        return TritonUnavailable(details)
    classified = classify_error(details)
    if isinstance(classified, TritonServerError):
        return TritonServerError(f"gRPC {code.name}: {details}")
    return classified


# the client


async def _next_message(call: grpc.aio.StreamStreamCall, messages: AsyncIterator[Any]) -> Any:
    """The call's next message, None at its end. The read runs in a task of its own, so cancelling the caller
    (the HTTP client left mid-stream) cancels the call and lets the read end by itself: a grpc.aio read that is
    cancelled while in flight leaks its batch's native memory, ~1.6 KiB per abandoned stream
    (docs/reliability.md, "The proxy's growth, investigated")."""
    read = asyncio.ensure_future(anext(messages, None))
    try:
        return await asyncio.shield(read)
    except asyncio.CancelledError:
        call.cancel()  # the read ends at once with the call's CANCELLED error
        read.add_done_callback(_consume_result)
        raise


def _let_end(call, ending: set[asyncio.Task]) -> None:
    """Let a stream whose final response came end on its own: our side is closed, and Triton then ends the call.

    A gRPC call dropped before its end may be cancelled (grpc.aio cancels a call it collects unfinished), and
    cancelling a stream after its final response, a refusal's error in particular, left the request held in Triton
    2.51: the model stayed "live" and a stopping server waited its whole exit timeout (docs/reliability.md). So a
    task in `ending` holds the call until it ends, and cancels it only if it is still open END_AFTER_FINAL_S later.
    (Closing the channel cancels its open calls too: `TritonStreamClient.close` waits for these tasks first.)"""
    if call.done():
        return
    try:
        task = asyncio.get_running_loop().create_task(_await_end(call))
    except RuntimeError:  # no loop running (a generator finalized late): the call goes as grpc lets it
        return
    ending.add(task)
    task.add_done_callback(ending.discard)


async def _await_end(call) -> None:
    try:
        async with asyncio.timeout(END_AFTER_FINAL_S):
            await call.code()
    except TimeoutError:
        call.cancel()


def _consume_result(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log "exception was never retrieved"


class TritonStreamClient:
    def __init__(self, url: str, *, health_timeout_s: float = 2.0):
        self.url = url
        self.health_timeout_s = health_timeout_s
        self._client: InferenceServerClient | None = None
        self._ending: set[asyncio.Task] = set()  # streams past their final response, until Triton ends them
        self._instance_counts: dict[str, int] = {}  # Triton instances per model, read at its first request

    def _connection(self) -> InferenceServerClient:
        if self._client is None:  # grpc.aio binds a channel to the running loop, so open it from inside one
            self._client = InferenceServerClient(self.url, channel_args=channel_args())
        return self._client

    async def generate(
        self, model: str, request_id: str, gen: GenerationRequest, timeout_s: float | None = None
    ) -> AsyncIterator[StreamResponse]:
        """Send one request and yield its responses up to and including the final one. `timeout_s` is the
        request's deadline: the component enforces it (a clean `deadline_exceeded` error), and the gRPC call
        is abandoned DEADLINE_GRACE_S later should the server not answer at all.

        A model served by several Triton instances is sent a request its instance refused as overloaded (a full
        queue, answered at once) again, up to once per other instance: Triton hands requests to the instances in
        turn, not by load, so the next one may have room while this one is full (docs/deployment.md)."""
        tries = await self._instances(model)
        for attempt in range(tries):
            is_answered = False
            try:
                async with aclosing(self._stream(model, request_id, gen, timeout_s)) as stream:  # a consumer that
                    async for response in stream:  # leaves closes it at once, so Triton cancels the request
                        is_answered = True
                        yield response
                return
            except TritonOverloaded:
                if is_answered or attempt == tries - 1:
                    raise
                logger.info("[proxy] request %s: %s's instance was full; sending it again (try %d of %d)",
                            request_id, model, attempt + 2, tries)

    async def _instances(self, model: str) -> int:
        """How many Triton instances serve `model` (its config's instance groups; 1 if it cannot be read)."""
        if model not in self._instance_counts:
            try:
                config = await self._connection().get_model_config(model, as_json=True,
                                                                   client_timeout=self.health_timeout_s)
                groups = config.get("config", {}).get("instance_group", [])
                count = sum(int(g.get("count", 1)) * max(1, len(g.get("gpus", []))) for g in groups)
            except Exception as error:  # noqa: BLE001 - a best-effort count must never fail the request itself
                logger.warning("[proxy] the instance count of %s could not be read (%r); no retries", model, error)
                return 1  # not cached: the next request asks again
            self._instance_counts[model] = max(1, count)
        return self._instance_counts[model]

    async def _stream(
        self, model: str, request_id: str, gen: GenerationRequest, timeout_s: float | None
    ) -> AsyncIterator[StreamResponse]:
        request = build_request(model, request_id, gen, timeout_s)
        is_done = asyncio.Event()

        async def requests():
            yield request
            await is_done.wait()  # keep our side open until the final response: no early half-close

        # aio's public stream_infer refuses the reserved `triton_*` request parameters that
        # build_request sets, so call the stub of the client's (shared) channel directly.
        grpc_timeout = timeout_s + DEADLINE_GRACE_S if timeout_s else None
        call = self._connection()._client_stub.ModelStreamInfer(requests(), timeout=grpc_timeout)
        messages = call.__aiter__()
        is_finished = is_started = False
        try:
            while (message := await _next_message(call, messages)) is not None:
                is_started = True
                is_finished = is_final_message(message)  # an error's too: a refusal is final
                response = parse_response(message)
                yield response
                if is_finished:
                    return
            raise TritonServerError(f"stream for request {request_id} ended without a final response")
        except grpc.aio.AioRpcError as error:
            is_finished = True
            raise _from_rpc_error(error, is_started) from None
        finally:
            is_done.set()
            if not is_finished:
                call.cancel()  # the consumer left or failed: Triton cancels the request
            else:
                _let_end(call, self._ending)

    async def is_ready(self, models: list[str]) -> bool:
        """True when the server is live and every given model is ready."""
        client, timeout = self._connection(), self.health_timeout_s
        try:
            if not await client.is_server_live(client_timeout=timeout):
                return False
            for model in models:
                if not await client.is_model_ready(model, client_timeout=timeout):
                    return False
        except (InferenceServerException, grpc.aio.AioRpcError) as error:
            logger.warning("[proxy] triton health check failed: %s", error)
            return False
        return True

    async def model_parameters(self, model: str) -> dict[str, str]:
        """The `parameters` of a model's config.pbtxt (e.g. the generated `deployment` JSON)."""
        try:
            config = await self._connection().get_model_config(model, as_json=True,
                                                               client_timeout=self.health_timeout_s)
        except (InferenceServerException, grpc.aio.AioRpcError) as error:
            raise TritonUnavailable(f"model config of {model}: {error}") from None
        params = config.get("config", {}).get("parameters", {})
        return {key: value.get("string_value", "") for key, value in params.items()}

    async def close(self) -> None:
        """Close the channel once every stream whose final response came has ended (`_let_end`)."""
        if self._ending:
            await asyncio.wait(list(self._ending), timeout=END_AFTER_FINAL_S + 1.0)
        if self._client is not None:
            await self._client.close()
            self._client = None
