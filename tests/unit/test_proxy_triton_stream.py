"""The real Triton client: request tensors per wire.py, response parsing, and a gRPC round trip (in-process
fake server speaking Triton's GRPCInferenceService) including cancellation."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import serialize_byte_tensor

from mstar_common import wire
from mstar_common.proxy.triton_stream import (
    GenerationRequest,
    TritonInvalidRequest,
    TritonOverloaded,
    TritonServerError,
    TritonStreamClient,
    build_request,
    parse_response,
)
from tests.unit.proxy_fake_triton import decode_tensors


@pytest.fixture
def anyio_backend():
    return "asyncio"


def test_build_request_tensors_follow_wire():
    gen = GenerationRequest(
        messages=[{"role": "user", "content": "héllo"}],
        chat_template_kwargs={"enable_thinking": False},
        sampling={"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "min_p": 0.1,
                  "repetition_penalty": 1.1, "seed": 2**40, "ignore_eos": True},
        stop=["\n\n", "END"],
        stop_token_ids=[3, 9],
    )
    request = build_request("qwen3_llm", "req-1", gen)
    assert request.model_name == "qwen3_llm" and request.id == "req-1"
    assert request.parameters["triton_enable_empty_final_response"].bool_param is True
    tensors = decode_tensors(request)

    datatype, shape, value = tensors[wire.MESSAGES]
    assert (datatype, shape) == ("BYTES", [1])
    assert json.loads(value[0].decode()) == [{"role": "user", "content": "héllo"}]
    assert tensors[wire.CHAT_TEMPLATE_KWARGS][:2] == ("BYTES", [1])
    assert json.loads(tensors[wire.CHAT_TEMPLATE_KWARGS][2][0]) == {"enable_thinking": False}
    for name, (triton_dtype, np_dtype) in wire.SAMPLING_INPUTS.items():
        datatype, shape, value = tensors[name]
        assert (datatype, shape, value.dtype) == (triton_dtype, [1], np.dtype(np_dtype)), name
        assert value[0] == pytest.approx(gen.sampling[name], rel=1e-6)
    assert tensors[wire.STOP][:2] == ("BYTES", [2]) and list(tensors[wire.STOP][2]) == [b"\n\n", b"END"]
    assert tensors[wire.STOP_TOKEN_IDS][:2] == ("INT32", [2]) and list(tensors[wire.STOP_TOKEN_IDS][2]) == [3, 9]
    assert wire.TEXT_INPUT not in tensors and wire.INPUT_IDS not in tensors


def test_build_request_text_and_ids_only_sends_what_is_set():
    tensors = decode_tensors(build_request("m", "r", GenerationRequest(text="abc")))
    assert list(tensors) == [wire.TEXT_INPUT]
    assert tensors[wire.TEXT_INPUT][:2] == ("BYTES", [1]) and tensors[wire.TEXT_INPUT][2][0] == b"abc"
    tensors = decode_tensors(build_request("m", "r", GenerationRequest(input_ids=[1, 2, 3])))
    assert tensors[wire.INPUT_IDS][:2] == ("INT32", [3]) and list(tensors[wire.INPUT_IDS][2]) == [1, 2, 3]


def _bytes_raw(values: list[str]) -> bytes:
    return serialize_byte_tensor(np.array([v.encode() for v in values], dtype=np.object_)).item()


def data_response(text: str, ids: list[int], finish: str = "", completion: int = 1, final: bool = False):
    out = service_pb2.ModelInferResponse
    tensors = [
        (wire.TEXT_OUTPUT, "BYTES", [1], _bytes_raw([text])),
        (wire.TOKEN_IDS, "INT32", [len(ids)], np.asarray(ids, np.int32).tobytes()),
        (wire.FINISH_REASON, "BYTES", [1], _bytes_raw([finish])),
        (wire.PROMPT_TOKENS, "INT32", [1], np.asarray([4], np.int32).tobytes()),
        (wire.COMPLETION_TOKENS, "INT32", [1], np.asarray([completion], np.int32).tobytes()),
    ]
    outputs = [out.InferOutputTensor(name=n, datatype=d, shape=s) for n, d, s, _ in tensors]
    response = out(model_name="m", outputs=outputs, raw_output_contents=[raw for *_, raw in tensors])
    response.parameters["triton_final_response"].bool_param = final
    return service_pb2.ModelStreamInferResponse(infer_response=response)


def empty_final():
    response = service_pb2.ModelInferResponse(model_name="m")
    response.parameters["triton_final_response"].bool_param = True
    return service_pb2.ModelStreamInferResponse(infer_response=response)


def test_parse_response():
    parsed = parse_response(data_response("hé", [5, 6], completion=2))
    assert (parsed.text, parsed.token_ids, parsed.finish_reason) == ("hé", [5, 6], None)
    assert (parsed.prompt_tokens, parsed.completion_tokens, parsed.is_final) == (4, 2, False)
    assert parse_response(data_response("", [], finish="length", final=True)).finish_reason == "length"
    final = parse_response(empty_final())
    assert final.is_final and final.text == "" and final.token_ids == []
    with pytest.raises(TritonInvalidRequest, match=r"^top_p must be in"):
        message = "in qwen3_llm: " + wire.invalid_request_message("top_p must be in (0, 1]")
        parse_response(service_pb2.ModelStreamInferResponse(error_message=message))
    with pytest.raises(TritonServerError, match="error id"):
        parse_response(service_pb2.ModelStreamInferResponse(error_message="internal error (error id 1): x"))


def test_outputs_decode_as_tritonclient_does_for_every_wire_output():
    from tritonclient.grpc import InferResult

    from mstar_common.proxy.triton_stream import _Outputs

    out = service_pb2.ModelInferResponse
    tensors = [
        (wire.TEXT_OUTPUT, "BYTES", [1], _bytes_raw(["hé"])),
        (wire.TOKEN_IDS, "INT32", [3], np.asarray([7, 8, 9], np.int32).tobytes()),
        (wire.AUDIO_CHUNK, "INT16", [4], np.asarray([1, -2, 3, -4], np.int16).tobytes()),
        (wire.SAMPLE_RATE, "INT32", [1], np.asarray([24000], np.int32).tobytes()),
        (wire.IMAGES, "BYTES", [2], _bytes_raw(["PNG a", "PNG b"])),
        (wire.IMAGE_SEED, "INT64", [1], np.asarray([2**40], np.int64).tobytes()),
        (wire.TRANSCRIPT_DURATION, "FP32", [1], np.asarray([1.5], np.float32).tobytes()),
        (wire.TOKEN_IDS + "_2d", "INT32", [2, 2], np.arange(4, dtype=np.int32).tobytes()),
    ]
    outputs = [out.InferOutputTensor(name=n, datatype=d, shape=s) for n, d, s, _ in tensors]
    response = out(model_name="m", outputs=outputs, raw_output_contents=[raw for *_, raw in tensors])
    ours, theirs = _Outputs(response), InferResult(response)
    for name, *_ in tensors:
        mine, reference = ours.as_numpy(name), theirs.as_numpy(name)
        assert mine.dtype == reference.dtype and mine.shape == reference.shape, name
        assert mine.tolist() == reference.tolist(), name
    assert ours.as_numpy(wire.FINISH_REASON) is None and theirs.as_numpy(wire.FINISH_REASON) is None
    parsed = parse_response(service_pb2.ModelStreamInferResponse(infer_response=response))
    assert (parsed.text, parsed.token_ids, parsed.sample_rate, parsed.seed) == ("hé", [7, 8, 9], 24000, 2**40)
    assert parsed.audio.tolist() == [1, -2, 3, -4] and parsed.images == [b"PNG a", b"PNG b"]


class FakeTritonServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Streams by model name: "ok" -> two tokens + empty final; "bad" -> invalid request; "slow" -> one token
    and then waits for cancellation."""

    def __init__(self):
        self.received: list[service_pb2.ModelInferRequest] = []
        self.cancelled = asyncio.Event()
        self.half_closed = asyncio.Event()  # a client ended its side of a stream (no cancel)

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=request.name in ("ok", "bad", "slow"))

    async def ModelStreamInfer(self, request_iterator, context):
        try:
            async for request in request_iterator:  # Triton keeps a stream open until the client ends its side
                self.received.append(request)
                if request.model_name == "bad":
                    yield service_pb2.ModelStreamInferResponse(error_message=wire.invalid_request_message("no prompt"))
                elif request.model_name == "slow":
                    yield data_response("a", [1])
                    await asyncio.sleep(30)
                elif request.model_name == "refused":  # an error flagged final, as Triton sends a refusal
                    infer_response = service_pb2.ModelInferResponse()
                    infer_response.parameters["triton_final_response"].bool_param = True
                    yield service_pb2.ModelStreamInferResponse(error_message="overloaded: 4 requests running",
                                                               infer_response=infer_response)
                else:
                    yield data_response("a", [1])
                    yield data_response("b", [2], finish="stop", completion=2)
                    yield empty_final()
            self.half_closed.set()
            await asyncio.sleep(0.3)  # the server ends the call a moment after the client's side (a cancel shows)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.fixture
async def grpc_server():
    server = grpc.aio.server()
    servicer = FakeTritonServicer()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}", servicer
    await server.stop(None)


@pytest.mark.anyio
async def test_client_streams_to_final_and_checks_health(grpc_server):
    url, servicer = grpc_server
    client = TritonStreamClient(url)
    try:
        responses = [r async for r in client.generate("ok", "rid-7", GenerationRequest(text="hi"), timeout_s=10)]
        assert [r.text for r in responses] == ["a", "b", ""]
        assert responses[1].finish_reason == "stop" and responses[-1].is_final
        assert servicer.received[0].id == "rid-7" and servicer.received[0].inputs[0].name == wire.TEXT_INPUT
        assert await client.is_ready(["ok", "slow"])
        assert not await client.is_ready(["ok", "missing"])
        with pytest.raises(TritonInvalidRequest, match="no prompt"):
            async for _ in client.generate("bad", "rid-8", GenerationRequest(text="hi")):
                pass
    finally:
        await client.close()


@pytest.mark.anyio
async def test_closing_the_stream_cancels_the_grpc_call(grpc_server):
    url, servicer = grpc_server
    client = TritonStreamClient(url)
    try:
        stream = client.generate("slow", "rid-9", GenerationRequest(text="hi"))
        assert (await anext(stream)).text == "a"
        await stream.aclose()
        await asyncio.wait_for(servicer.cancelled.wait(), 5)
    finally:
        await client.close()


@pytest.mark.anyio
async def test_a_final_error_ends_the_stream_without_a_cancel(grpc_server):
    """Cancelling a gRPC stream after its final response (a refusal's error) left the request held in Triton 2.51,
    and the model then never unloaded at shutdown (docs/reliability.md): after a final error the client ends its
    side of the stream and holds the call until the server ends it, also when the client is closed."""
    url, servicer = grpc_server
    client = TritonStreamClient(url)
    try:
        with pytest.raises(TritonOverloaded, match="4 requests running"):
            async for _ in client.generate("refused", "rid-10", GenerationRequest(text="hi")):
                pass
        await asyncio.wait_for(servicer.half_closed.wait(), 5)
        await asyncio.sleep(0.6)  # past the moment the server ends the call: a cancel would have shown
        assert not servicer.cancelled.is_set()
        # closing the channel cancels the calls still open: close() first waits for them to end
        servicer.half_closed.clear()
        with pytest.raises(TritonOverloaded):
            async for _ in client.generate("refused", "rid-11", GenerationRequest(text="hi")):
                pass
        await client.close()
        await asyncio.sleep(0.6)
        assert servicer.half_closed.is_set() and not servicer.cancelled.is_set()
    finally:
        await client.close()


@pytest.mark.anyio
async def test_unreachable_triton_is_not_ready():
    client = TritonStreamClient("127.0.0.1:1", health_timeout_s=0.5)
    try:
        assert not await client.is_ready(["ok"])
    finally:
        await client.close()


@pytest.mark.anyio
async def test_the_proxy_reconnects_within_a_second_or_so_of_tritons_return():
    """A relaunched server (a GPU one compiles its kernels for a minute or two) must be reachable through the proxy
    as soon as it is back. gRPC's default backoff between connection attempts grows 1.6x up to 120 s: after 11 s of
    failures its next attempt falls 1.6-8 s after this server starts (measured: 4.6 s after 12 s). The proxy's
    channel caps it at MAX_RECONNECT_BACKOFF_MS."""
    from mstar_common.launcher import free_ports

    port = free_ports(1)[0]
    client = TritonStreamClient(f"127.0.0.1:{port}", health_timeout_s=0.5)
    server = None
    try:
        loop = asyncio.get_running_loop()
        failing_until = loop.time() + 11.0
        while loop.time() < failing_until:  # the proxy's health checks fail while the server is away
            assert not await client.is_ready(["ok"])
            await asyncio.sleep(0.1)
        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(FakeTritonServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        started = loop.time()
        while not await client.is_ready(["ok"]):
            assert loop.time() - started < 1.8, "the proxy's channel did not reconnect within 1.8 s of the server"
            await asyncio.sleep(0.05)
    finally:
        await client.close()
        if server is not None:
            await server.stop(None)


class FullOnceServicer(FakeTritonServicer):
    """Model "two" has two instances and "one" a single one (their configs' instance groups); the first request to
    either is refused as overloaded, as a full instance refuses it, and the next is served."""

    def __init__(self):
        super().__init__()
        self.refusals = 0

    async def ModelConfig(self, request, context):
        instances = {"two": [model_config_pb2.ModelInstanceGroup(count=1, gpus=[0, 1])],
                     "one": [model_config_pb2.ModelInstanceGroup(count=1)]}[request.name]
        return service_pb2.ModelConfigResponse(config=model_config_pb2.ModelConfig(name=request.name,
                                                                                   instance_group=instances))

    async def ModelStreamInfer(self, request_iterator, context):
        async for request in request_iterator:
            self.received.append(request)
            if self.refusals == 0:
                self.refusals += 1
                infer_response = service_pb2.ModelInferResponse()
                infer_response.parameters["triton_final_response"].bool_param = True
                yield service_pb2.ModelStreamInferResponse(error_message="overloaded: 2 requests running",
                                                           infer_response=infer_response)
            else:
                yield data_response("a", [1], finish="stop", completion=1)
                yield empty_final()
        self.half_closed.set()


@pytest.mark.anyio
@pytest.mark.parametrize("model, served", [("two", True), ("one", False)])
async def test_a_full_instance_refusal_is_sent_again_while_other_instances_serve(model, served):
    """Triton gives a model's instances requests in turn, not by load: with two instances a request refused by the
    full one is sent once more (and the other instance serves it); with one, the 429 goes to the client."""
    server, servicer = grpc.aio.server(), FullOnceServicer()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = TritonStreamClient(f"127.0.0.1:{port}")
    try:
        stream = client.generate(model, "rid-12", GenerationRequest(text="hi"), timeout_s=10)
        if served:
            assert [r.text for r in [r async for r in stream]] == ["a", ""]
        else:
            with pytest.raises(TritonOverloaded, match="2 requests running"):
                async for _ in stream:
                    pass
        assert [r.id for r in servicer.received] == ["rid-12"] * (2 if served else 1)
    finally:
        await client.close()
        await server.stop(None)
