"""The benchmark's OpenAI driver: one or several client processes, every request's record in request order."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from mstar_common.bench.drivers import CLIENT_STREAMS_PER_PROCESS, OpenAIDriver
from mstar_common.bench.metrics import summarize


class SSEServer:
    """A bare HTTP/1.1 server on 127.0.0.1 that streams `max_tokens` completion chunks per POST, then usage."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.port = 0
        self.server = None

    def __enter__(self) -> SSEServer:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _shutdown(self) -> None:
        self.server.close()
        handlers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await self.server.wait_closed()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    @staticmethod
    def _frame(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def _handle(self, reader, writer) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = json.loads(await reader.readexactly(length))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for _ in range(body["max_tokens"]):
                    chunk = {"choices": [{"index": 0, "text": " w", "finish_reason": None}]}
                    writer.write(self._frame(b"data: " + json.dumps(chunk).encode() + b"\n\n"))
                    await writer.drain()
                usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
                writer.write(self._frame(b"data: " + json.dumps(usage).encode() + b"\n\n")
                             + self._frame(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _requests(count: int) -> list[dict]:
    return [{"input_ids": [1] * 8, "max_tokens": 3 + index % 5, "ignore_eos": True, "temperature": 0.0}
            for index in range(count)]


@pytest.mark.parametrize("processes", [1, 2])
def test_every_request_is_recorded_in_order_by_one_or_several_processes(processes):
    requests = _requests(11)
    with SSEServer() as server:
        driver = OpenAIDriver(f"http://127.0.0.1:{server.port}", "m", lambda n: " the" * n, processes=processes)
        assert driver.num_processes(len(requests), 4, None) == processes
        records = driver.run(requests, concurrency=4)
    assert [r.error for r in records] == [None] * 11
    assert [r.num_tokens for r in records] == [request["max_tokens"] for request in requests]
    assert all(r.start < r.chunks[0][0] <= r.end for r in records)
    assert summarize(records)["output_tokens"] == sum(request["max_tokens"] for request in requests)


def test_a_poisson_load_splits_its_rate_over_the_processes():
    requests = _requests(6)
    with SSEServer() as server:
        driver = OpenAIDriver(f"http://127.0.0.1:{server.port}", "m", lambda n: " the" * n, processes=2)
        records = driver.run(requests, rate=200.0)
    assert [r.num_tokens for r in records] == [request["max_tokens"] for request in requests]


def test_auto_uses_a_process_per_streams_share_within_half_the_cpus(monkeypatch):
    driver = OpenAIDriver("http://x", "m", None)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert driver.num_processes(1000, 1, None) == 1
    assert driver.num_processes(1000, CLIENT_STREAMS_PER_PROCESS, None) == 1
    assert driver.num_processes(1000, 64, None) == 64 // CLIENT_STREAMS_PER_PROCESS
    assert driver.num_processes(1000, 512, None) == 8  # half of 16 CPUs
    assert driver.num_processes(2, 64, None) == 1  # no more processes than requests need
    assert driver.num_processes(1000, None, 50.0) == 1  # Poisson: one unless asked
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert driver.num_processes(1000, 64, None) == 1


def test_requests_failing_in_client_processes_come_back_as_errors():
    driver = OpenAIDriver("http://127.0.0.1:9", "m", lambda n: " the" * n, processes=2)
    records = driver.run(_requests(2), concurrency=2, timeout_s=5)  # nothing listens: each request errs
    assert all(r.error for r in records)
