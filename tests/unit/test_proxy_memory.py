"""The proxy keeps no per-request state: finished, abandoned and refused requests leave no task, async generator
or other Python object behind (the soak in docs/reliability.md watches the same thing as RSS). And an abandoned
stream never cancels a gRPC read in flight, which leaks native memory in grpc.aio (scripts/proxy_memory_probe.py
measures it)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from types import SimpleNamespace

import pytest
from tritonclient.grpc import service_pb2

from mstar_common.proxy.triton_stream import GenerationRequest, StreamResponse, TritonStreamClient
from tests.unit.proxy_fake_triton import HANG, FakeTriton, make_app, text_script

NUM_ROUNDS = 40  # each round sends the four kinds of request below


async def drive(app, path: str, body: dict, request_id: str, disconnect_after_chunks: int | None) -> None:
    """One request at the ASGI level; the client leaves after `disconnect_after_chunks` body chunks (None: never)."""
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    gone = asyncio.Event()
    num_chunks = 0

    async def receive():
        if pending:
            return pending.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal num_chunks
        num_chunks += message["type"] == "http.response.body" and bool(message.get("body"))
        if disconnect_after_chunks is not None and num_chunks >= disconnect_after_chunks:
            gone.set()

    if disconnect_after_chunks == 0:
        gone.set()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"x-request-id", request_id.encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    await asyncio.wait_for(app(scope, receive, send), 5)


async def one_round(apps: dict[str, object], round_id: int) -> None:
    chat = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    await asyncio.gather(
        drive(apps["done"], "/v1/chat/completions", {**chat, "stream": True}, f"s{round_id}", None),
        drive(apps["done"], "/v1/completions", {"model": "qwen3", "prompt": "x"}, f"n{round_id}", None),
        drive(apps["hang"], "/v1/chat/completions", {**chat, "stream": True}, f"a{round_id}", 2),  # mid-stream
        drive(apps["hang"], "/v1/completions", {"model": "qwen3", "prompt": "x"}, f"d{round_id}", 0),  # no answer
    )


def live_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


@pytest.mark.anyio
async def test_finished_and_abandoned_requests_leave_nothing_behind():
    fakes = {"done": FakeTriton(script=text_script("a", "b", "c")),
             "hang": FakeTriton(script=[StreamResponse(text="tok"), HANG])}
    apps = {kind: make_app(fake)[0] for kind, fake in fakes.items()}
    for i in range(5):  # warm-up: lazy imports, caches sized by the first requests
        await one_round(apps, i)
    for fake in fakes.values():
        fake.requests.clear()
    num_tasks, num_objects = len(asyncio.all_tasks()), live_objects()
    for i in range(NUM_ROUNDS):
        await one_round(apps, 100 + i)
        for fake in fakes.values():
            fake.requests.clear()  # the fake's own record of each request
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == num_tasks
    # A per-request entry anywhere (a dict keyed by request id, a kept callback) would add >= 4 * NUM_ROUNDS.
    assert live_objects() - num_objects < NUM_ROUNDS
    assert len(fakes["hang"].cancelled) == 2 * (NUM_ROUNDS + 5)  # every abandoned request was cancelled


class InFlightCall:
    """A gRPC stream call whose second read stays in flight until the call is cancelled."""

    def __init__(self) -> None:
        self.num_reads = 0
        self.is_cancelled = asyncio.Event()
        self.is_read_cancelled = False

    def __aiter__(self):
        return self._messages()

    async def _messages(self):
        self.num_reads += 1
        yield service_pb2.ModelStreamInferResponse()  # a data response with no outputs
        self.num_reads += 1
        try:
            await self.is_cancelled.wait()
        except asyncio.CancelledError:
            self.is_read_cancelled = True
            raise

    def cancel(self) -> bool:
        self.is_cancelled.set()
        return True


@pytest.mark.anyio
async def test_abandoned_stream_cancels_the_call_not_the_read_in_flight():
    call = InFlightCall()
    client = TritonStreamClient("fake:0")
    client._client = SimpleNamespace(_client_stub=SimpleNamespace(ModelStreamInfer=lambda requests, timeout: call))
    stream = client.generate("qwen3_llm", "r1", GenerationRequest(text="hi"))

    async def consume():
        async for _ in stream:
            pass

    task = asyncio.ensure_future(consume())
    while call.num_reads < 2:
        await asyncio.sleep(0)
    task.cancel()  # what the SSE response does when the HTTP client leaves
    with contextlib.suppress(asyncio.CancelledError):
        await task
    for _ in range(3):
        await asyncio.sleep(0)
    assert call.is_cancelled.is_set() and not call.is_read_cancelled
