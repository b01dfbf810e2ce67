"""The benchmark's Triton driver: a stream per request in flight, so an error is charged to its own request."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from mstar_common import wire
from mstar_common.bench.drivers import TritonDriver
from mstar_common.bench.metrics import summarize


class _Result:
    def __init__(self, rid: str, tokens: int | None, final: bool):
        self.rid, self.tokens, self.final = rid, tokens, final

    def get_response(self):
        flag = SimpleNamespace(bool_param=self.final)
        return SimpleNamespace(id=self.rid, parameters={"triton_final_response": flag})

    def as_numpy(self, name):
        return np.zeros(self.tokens, np.int32) if name == wire.TOKEN_IDS and self.tokens else None


class FakeClient:
    """tritonclient's stream as the driver sees it: responses on a thread of their own, an error without an id.
    r1 fails at once (in-band, as Triton sends a request's error; with `broken`, as a gRPC status that ends the
    whole stream, after which the stream refuses to send); every other request streams two responses of 2 tokens,
    then an empty final one."""

    opened: list[FakeClient] = []
    broken = False

    def __init__(self, url: str, channel_args=None):
        self.callback, self.sent, self.dead = None, [], False
        FakeClient.opened.append(self)

    def start_stream(self, callback):
        self.callback = callback

    def async_stream_infer(self, model, inputs, request_id, outputs=None, enable_empty_final_response=False):
        if self.dead:
            raise InferenceServerException(msg="The stream is no longer in valid state")
        self.sent.append(request_id)
        threading.Thread(target=self._respond, args=(request_id,), daemon=True).start()

    def _respond(self, rid: str) -> None:
        if rid == "r1":
            time.sleep(0.01)
            if FakeClient.broken:
                self.dead = True
                self.callback(None, InferenceServerException(msg="stream reset", status="StatusCode.INTERNAL"))
            else:
                self.callback(None, InferenceServerException(msg="overloaded: 3 requests in m already"))
            return
        for _ in range(2):
            time.sleep(0.03)
            self.callback(_Result(rid, 2, False), None)
        self.callback(_Result(rid, None, True), None)

    def stop_stream(self, cancel_requests=False):
        pass

    def close(self):
        pass


@pytest.fixture
def fake_tritonclient(monkeypatch):
    import tritonclient.grpc as grpcclient

    FakeClient.opened, FakeClient.broken = [], False
    monkeypatch.setattr(grpcclient, "InferenceServerClient", FakeClient)
    return FakeClient


def _requests(count: int) -> list[dict]:
    return [{wire.INPUT_IDS: [1, 2, 3], "max_tokens": 4} for _ in range(count)]


def test_an_error_is_charged_to_the_request_it_ends(fake_tritonclient):
    """With several requests on one stream the error went to the oldest open request (r0, which then finished as
    well and was counted twice), and r1 stayed open until the level timed out."""
    records = TritonDriver("x:1", "m").run(_requests(3), concurrency=3, timeout_s=10)
    assert [r.error for r in records] == [None, "overloaded: 3 requests in m already", None]
    assert [r.num_tokens for r in records] == [4, 0, 4]
    assert summarize(records)["num_errors"] == 1
    assert sorted(len(c.sent) for c in fake_tritonclient.opened) == [1, 1, 1]  # one stream per request in flight


def test_a_closed_loop_reuses_its_streams(fake_tritonclient):
    records = TritonDriver("x:1", "m").run(_requests(7), concurrency=2, timeout_s=10)
    assert len(fake_tritonclient.opened) == 2 and sum(len(c.sent) for c in fake_tritonclient.opened) == 7
    assert sum(r.error is not None for r in records) == 1 and all(r.end >= r.start for r in records)


def test_a_stream_its_grpc_status_ended_is_not_used_again(fake_tritonclient):
    """A stream a gRPC status ended went back to the pool, and the next send on it raised out of the level, losing
    every record."""
    fake_tritonclient.broken = True
    records = TritonDriver("x:1", "m").run(_requests(6), concurrency=2, timeout_s=10)
    assert [r.error for r in records] == [None, "[StatusCode.INTERNAL] stream reset", None, None, None, None]
    assert [r.num_tokens for r in records] == [4, 0, 4, 4, 4, 4]
    assert len(fake_tritonclient.opened) == 3 and fake_tritonclient.opened[1].sent == ["r1"]


class _GrpcServer:
    """Triton's ModelStreamInfer on a real gRPC port (this process): each request gets its `max_tokens` token ids,
    two to a response, then an empty final one; a request whose max_tokens is 0 gets an in-band error."""

    def __enter__(self):
        from concurrent import futures

        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        def response(request_id: str, n: int, final: bool, error: str = ""):
            out = service_pb2.ModelInferResponse
            message = out(model_name="m", id=request_id)
            if n:
                message.outputs.append(out.InferOutputTensor(name=wire.TOKEN_IDS, datatype="INT32", shape=[n]))
                message.raw_output_contents.append(np.arange(n, dtype=np.int32).tobytes())
            message.parameters["triton_final_response"].bool_param = final
            return service_pb2.ModelStreamInferResponse(infer_response=message, error_message=error)

        class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
            def ModelStreamInfer(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
                for request in request_iterator:
                    names = [tensor.name for tensor in request.inputs]
                    raw = request.raw_input_contents[names.index("max_tokens")]
                    tokens = int(np.frombuffer(raw, np.int32)[0])
                    if tokens == 0:
                        yield response(request.id, 0, True, error="max_tokens: must be at least 1")
                        continue
                    for sent in range(0, tokens, 2):
                        yield response(request.id, min(2, tokens - sent), False)
                    yield response(request.id, 0, True)

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.stop(0)


def test_client_processes_record_every_request_in_order():
    """Two client processes (spawned, each with its own streams) against a real gRPC server: every record comes
    back in request order, an error charged to its own request."""
    requests = [{wire.INPUT_IDS: [1, 2, 3], "max_tokens": 3 + index % 4} for index in range(9)]
    requests[5]["max_tokens"] = 0
    with _GrpcServer() as server:
        driver = TritonDriver(f"127.0.0.1:{server.port}", "m", processes=2)
        assert driver.num_processes(len(requests), 4, None) == 2
        records = driver.run(requests, concurrency=4, timeout_s=60)
    assert [r.num_tokens for r in records] == [request["max_tokens"] for request in requests]
    assert [r.error is not None for r in records] == [index == 5 for index in range(9)]
    assert "max_tokens: must be at least 1" in records[5].error
    assert all(r.start <= r.end for r in records)


def test_auto_spreads_a_large_closed_loop_over_processes(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert TritonDriver("x:1", "m").num_processes(1000, 64, None) == 1  # the default: one
    driver = TritonDriver("x:1", "m", processes="auto")
    assert [driver.num_processes(1000, c, None) for c in (1, 8, 16, 17, 64)] == [1, 1, 1, 2, 4]
    assert driver.num_processes(1000, None, 8.0) == 1  # Poisson: one unless asked
    assert TritonDriver("x:1", "m", processes=3).num_processes(1000, 2, None) == 2  # no more than the streams


def test_a_local_servers_triton_load_goes_direct_on_a_host_with_a_proxy_set(monkeypatch):
    """gRPC reads http_proxy and has no loopback exemption: the Triton arm's streams to the bench's own server went
    to the proxy."""
    from tests.unit.local_http import behind_unreachable_proxy

    behind_unreachable_proxy(monkeypatch)
    requests = [{wire.INPUT_IDS: [1, 2, 3], "max_tokens": 3} for _ in range(3)]
    with _GrpcServer() as server:
        records = TritonDriver(f"127.0.0.1:{server.port}", "m").run(requests, concurrency=2, timeout_s=30)
    assert [r.error for r in records] == [None] * 3 and [r.num_tokens for r in records] == [3] * 3
