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

    def __init__(self, url: str):
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
