"""The proxy keeps no per-request state: finished, abandoned and refused requests leave no task, async generator
or other Python object behind (the soak in docs/reliability.md watches the same thing as RSS)."""

from __future__ import annotations

import asyncio
import gc
import json

import pytest

from mstar_common.proxy.triton_stream import StreamResponse
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
