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

    def __init__(self, tokens_per_chunk: int = 1, fail_after: int | None = None, text: str = " w"):
        self.tokens_per_chunk, self.fail_after, self.text = tokens_per_chunk, fail_after, text
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
                continuous = (body.get("stream_options") or {}).get("continuous_usage_stats")
                sent = 0
                while sent < body["max_tokens"]:
                    if self.fail_after is not None and sent >= self.fail_after:  # as the proxy fails a stream
                        writer.write(self._frame(b'data: {"error": {"message": "boom", "code": "x"}}\n\n')
                                     + b"0\r\n\r\n")
                        await writer.drain()
                        break
                    sent += min(self.tokens_per_chunk, body["max_tokens"] - sent)
                    chunk = {"choices": [{"index": 0, "text": self.text, "finish_reason": None}]}
                    if continuous:
                        chunk["usage"] = {"completion_tokens": sent}
                    data = json.dumps(chunk, ensure_ascii=False).encode()  # as servers do: U+2028 unescaped
                    writer.write(self._frame(b"data: " + data + b"\n\n"))
                    await writer.drain()
                else:
                    finish = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
                    if continuous:
                        finish["usage"] = {"completion_tokens": sent}
                    writer.write(self._frame(b"data: " + json.dumps(finish).encode() + b"\n\n"))
                if sent < body["max_tokens"]:
                    continue
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
        driver = OpenAIDriver(f"http://127.0.0.1:{server.port}", "m", lambda ids: " the" * len(ids),
                              processes=processes)
        assert driver.num_processes(len(requests), 4, None) == processes
        records = driver.run(requests, concurrency=4)
    assert [r.error for r in records] == [None] * 11
    assert [r.num_tokens for r in records] == [request["max_tokens"] for request in requests]
    assert all(r.start < r.chunks[0][0] <= r.end for r in records)
    assert summarize(records)["output_tokens"] == sum(request["max_tokens"] for request in requests)


def test_a_poisson_load_splits_its_rate_over_the_processes():
    requests = _requests(6)
    with SSEServer() as server:
        driver = OpenAIDriver(f"http://127.0.0.1:{server.port}", "m", lambda ids: " the" * len(ids), processes=2)
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
    driver = OpenAIDriver("http://127.0.0.1:9", "m", lambda ids: " the" * len(ids), processes=2)
    records = driver.run(_requests(2), concurrency=2, timeout_s=5)  # nothing listens: each request errs
    assert all(r.error for r in records)


@pytest.mark.parametrize("tokens_per_chunk", [1, 3])
def test_each_chunk_counts_the_tokens_the_usage_says_it_carried(tokens_per_chunk):
    """The driver asks for continuous usage, so a chunk of k tokens counts k (they were spread evenly over every
    chunk, the empty finish chunk included) and the finish chunk counts none."""
    requests = _requests(5)
    with SSEServer(tokens_per_chunk=tokens_per_chunk) as server:
        records = OpenAIDriver(f"http://127.0.0.1:{server.port}", "m", lambda ids: " the" * len(ids), processes=1).run(
            requests, concurrency=2)
    for record, request in zip(records, requests, strict=True):
        n = request["max_tokens"]
        want = [tokens_per_chunk] * (n // tokens_per_chunk) + ([n % tokens_per_chunk] if n % tokens_per_chunk else [])
        assert record.error is None and [k for _, k in record.chunks] == want


def test_a_chunk_whose_text_holds_a_unicode_line_separator_is_one_event():
    """aiter_lines splits at U+2028 inside a JSON string (str.splitlines), and json.loads raised on each half: a
    server whose JSON leaves it unescaped failed every request whose text had one."""
    with SSEServer(text="a\u2028b\x85") as server:
        records = OpenAIDriver(f"http://127.0.0.1:{server.port}", "m", lambda ids: " the" * len(ids), processes=1).run(
            _requests(3), concurrency=1)
    assert [r.error for r in records] == [None] * 3
    assert [sum(k for _, k in r.chunks) for r in records] == [r["max_tokens"] for r in _requests(3)]


def test_a_stream_failing_after_its_200_is_an_error():
    """The proxy fails a started stream with a data: {"error": ...} event; that request was counted a success."""
    with SSEServer(fail_after=2) as server:
        records = OpenAIDriver(f"http://127.0.0.1:{server.port}", "m", lambda ids: " the" * len(ids), processes=1).run(
            _requests(3), concurrency=1)
    assert all(r.error and r.error.startswith("stream error: ") and "boom" in r.error for r in records)
    assert summarize(records)["num_errors"] == 3


def test_asked_processes_never_exceed_the_concurrency():
    """--client-processes 4 at c=1 ran four requests at once, reported as c=1."""
    driver = OpenAIDriver("http://x", "m", None, processes=4)
    assert [driver.num_processes(1000, c, None) for c in (1, 2, 3, 4, 64)] == [1, 2, 3, 4, 4]
    assert driver.num_processes(1000, None, 50.0) == 4 and driver.num_processes(2, None, 50.0) == 2


def test_poisson_arrivals_keep_their_schedule_when_the_client_lags(monkeypatch):
    """Each arrival slept its interval after the previous wake-up, so a busy event loop (it also parses every
    stream) pushed every later arrival back. On a fake clock, 20 ms of loop-holding work a request at 20 req/s: on
    the absolute schedule the last of 40 arrivals starts within one request's work of its time; sleeping each
    interval anew it would start 39 x 20 ms = 0.78 s late. (Real time gave this test a margin a loaded 2-core CI
    machine could eat, and the relative schedule lost less than the work per arrival there.)"""
    import random
    import types

    from mstar_common.bench import drivers

    clock = [100.0]
    real_sleep = asyncio.sleep
    work, count, rate = 0.02, 40, 20.0

    async def fake_sleep(seconds):
        clock[0] += max(0.0, seconds)
        await real_sleep(0)  # the tasks created meanwhile run now, each holding the loop for `work`

    async def busy(client, base_url, body, rec):
        rec.start = clock[0]
        clock[0] += work

    monkeypatch.setattr(drivers, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(drivers.asyncio, "sleep", fake_sleep)
    monkeypatch.setattr(drivers, "_one", busy)
    records = asyncio.run(drivers._run_bodies("http://127.0.0.1:9", [{}] * count, None, rate, 7, 10.0))
    rng = random.Random(7)
    scheduled = sum(rng.expovariate(rate) for _ in range(count))  # the last arrival's offset after the loop starts
    starts = [r.start for r in records]
    assert starts == sorted(starts)
    late = starts[-1] - (100.0 + scheduled)
    assert -1e-9 <= late <= work + 1e-9, late


class GatedSSEServer(SSEServer):
    """Holds every request until `gate` are open at once (or `wait_s` passes), then streams each; records the most
    open at once."""

    def __init__(self, gate: int, wait_s: float = 3.0):
        super().__init__()
        self.gate, self.wait_s, self.open, self.most = gate, wait_s, 0, 0
        self.reached: asyncio.Event | None = None

    async def _handle(self, reader, writer) -> None:
        if self.reached is None:
            self.reached = asyncio.Event()
        self.open += 1
        self.most = max(self.most, self.open)
        if self.open >= self.gate:
            self.reached.set()
        try:
            await asyncio.wait_for(self.reached.wait(), self.wait_s)
        except TimeoutError:
            pass
        try:
            await super()._handle(reader, writer)
        finally:
            self.open -= 1


def test_an_open_loop_load_is_not_held_back_by_a_connection_cap():
    """A Poisson level past the server's pace must reach it as sent: the driver's pool was capped at 64
    connections, so later arrivals waited in the client (their wait counted as TTFT) and the server never saw
    more than 64 requests."""
    count = 72
    with GatedSSEServer(gate=count) as server:
        records = OpenAIDriver(f"http://127.0.0.1:{server.port}", "m", lambda ids: " the" * len(ids), processes=1).run(
            _requests(count), rate=2000.0, seed=3)
        most = server.most
    assert [r.error for r in records] == [None] * count
    assert most == count


def test_a_local_servers_load_goes_direct_on_a_host_with_a_proxy_set(monkeypatch):
    """httpx sent even a loopback request through the environment's http_proxy: `bench serve` on such a host lost
    (or measured through the proxy) every request to its own server."""
    from tests.unit.local_http import behind_unreachable_proxy

    behind_unreachable_proxy(monkeypatch)
    requests = _requests(3)
    with SSEServer() as server:
        records = OpenAIDriver(f"http://127.0.0.1:{server.port}", "m", lambda ids: " the" * len(ids)).run(
            requests, concurrency=2)
    assert [r.error for r in records] == [None] * 3
    from mstar_common.bench.drivers import is_local

    assert [is_local(u) for u in ("http://127.0.0.1:8000", "localhost:8001", "http://[::1]:80", "127.0.0.2:1",
                                  "http://example.com:8000", "10.0.0.5:8001")] == [True] * 4 + [False] * 2
