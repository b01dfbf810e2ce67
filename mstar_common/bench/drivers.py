"""Load generators: closed-loop concurrency and Poisson open-loop arrivals.

`TritonDriver` streams to the entry model over tritonclient gRPC (a bidirectional stream for each request in
flight); `OpenAIDriver` posts streaming `/v1/completions` to the proxy. Both
record, per request, the send time and each response's arrival time and token count, and both can spread a
closed loop over client processes (`client_processes`), so that the client's own queueing does not show up as
latency (the proxy's driver does by default; one Triton client process measured as several).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import multiprocessing
import os
import queue
import random
import threading
import time
import urllib.parse
import urllib.request

import numpy as np

from mstar_common import wire
from mstar_common.bench.metrics import RequestRecord
from mstar_common.client.types import SSELines


def _triton_inputs(request: dict):
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in request.items():
        if name in (wire.INPUT_IDS, wire.STOP_TOKEN_IDS):
            arr, dtype = np.asarray(value, dtype=np.int32), "INT32"
        elif name == wire.STOP:  # stop strings: one BYTES tensor of them all
            arr, dtype = np.asarray([str(s).encode() for s in value], dtype=np.object_), "BYTES"
        elif name in wire.SAMPLING_INPUTS:
            dtype, np_dtype = wire.SAMPLING_INPUTS[name]
            arr = np.asarray([value], dtype=np_dtype)
        else:
            arr, dtype = np.asarray([str(value).encode()], dtype=np.object_), "BYTES"
        tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
        tensor.set_data_from_numpy(arr)
        inputs.append(tensor)
    return inputs


CLIENT_STREAMS_PER_PROCESS = 16  # closed-loop streams one client process drives (processes="auto")


def client_processes(setting: int | str, count: int, concurrency: int | None, rate: float | None) -> int:
    """The client processes a level of `count` requests runs in. A number is taken as given, within what the load
    can use (each process drives at least one stream, so no more than the concurrency of a closed loop or the
    requests). "auto": one per CLIENT_STREAMS_PER_PROCESS closed-loop streams, at most half the CPUs (the server
    under test has the rest); one for a Poisson load."""
    if setting != "auto":
        return max(1, min(int(setting), count, concurrency or count if rate is None else count))
    if rate is not None or not concurrency:
        return 1
    cap = max(1, (os.cpu_count() or 2) // 2)
    return max(1, min(cap, -(-min(concurrency, count) // CLIENT_STREAMS_PER_PROCESS)))


class TritonDriver:
    """`outputs`: the output names every request asks for (None: none named, so Triton returns them all).

    Each request in flight has a gRPC stream of its own, reused by the next request once it ends (a closed loop at
    c opens c streams; a Poisson load as many as it ever has in flight): tritonclient's stream callback gives an
    error without the id of the request it ends, so a stream carrying one request is the only way to tell whose
    error it was. Each stream's responses arrive on a thread of its own, and every thread takes the GIL to
    timestamp and read its response; `processes` spreads a closed loop over client processes as OpenAIDriver's
    does (`client_processes`). One is the default: on an H100 serving Qwen3-0.6B, 4 processes at c=64 and 8 at
    c=256 measured the same tok/s and ITL percentiles as one, alternated on one server (docs/benchmarks.md,
    2026-12-06 late night)."""

    def __init__(self, url: str, model: str, outputs: list[str] | None = None, processes: int | str = 1,
                 inputs=None, counts=None) -> None:
        """`inputs(request)`: its tensors (default: a text-LM request's, `_triton_inputs`); `counts(result)`: what a
        response carries, as the records count it (default: its token ids). Other than the defaults, one process."""
        self.url, self.model, self.outputs, self.processes = url, model, outputs, processes
        self.inputs, self.counts = inputs or _triton_inputs, counts
        if (inputs or counts) and processes != 1:
            raise ValueError("a driver with its own inputs or counts runs in one client process")

    def num_processes(self, count: int, concurrency: int | None, rate: float | None) -> int:
        return client_processes(self.processes, count, concurrency, rate)

    def run(self, requests: list[dict], concurrency: int | None = None, rate: float | None = None,
            seed: int = 0, timeout_s: float = 600.0) -> list[RequestRecord]:
        """Closed loop with `concurrency` in flight, or Poisson arrivals at `rate` requests/s."""
        num = self.num_processes(len(requests), concurrency, rate)
        if num <= 1:
            return self.run_here(requests, concurrency, rate, seed, timeout_s)
        return _run_in_processes(_TritonJob(self.url, self.model, self.outputs), requests, num, concurrency, rate,
                                 seed, timeout_s)

    def run_here(self, requests: list[dict], concurrency: int | None = None, rate: float | None = None,
                 seed: int = 0, timeout_s: float = 600.0, ready=None) -> list[RequestRecord]:
        """`run` in this process. `ready()`, when given, is called once the first streams are open, just before
        the first request is sent (a client process waits there for the others)."""
        import tritonclient.grpc as grpcclient

        records: dict[str, RequestRecord] = {}
        done: queue.Queue = queue.Queue()
        lock = threading.Lock()
        clients: list = []
        carrying: list[str | None | bool] = []  # the request each stream carries now (None: free; False: dead)

        def on_response(k: int, result, error) -> None:
            now = time.perf_counter()
            with lock:
                rid = carrying[k]
            if not rid:  # nothing of ours on this stream (a response after its request's final, a dead stream)
                return
            rec = records[rid]
            broken = False
            if error is not None:  # in-band (the request's own error) or the whole gRPC stream failing (a status)
                rec.error, is_final, broken = str(error), True, getattr(error, "status", lambda: None)() is not None
            else:
                response = result.get_response()
                if self.counts is not None:
                    if count := self.counts(result):
                        rec.chunks.append((now, count))
                elif (ids := result.as_numpy(wire.TOKEN_IDS)) is not None:
                    rec.chunks.append((now, int(ids.size)))
                is_final = response.parameters["triton_final_response"].bool_param
            if is_final:
                rec.end = now
                with lock:  # free before the driver hears, so its next send can take it; a broken one never again
                    carrying[k] = False if broken else None
                done.put(rid)

        def open_stream(rid: str | None) -> int:
            client = triton_grpc_client(self.url)
            with lock:
                k = len(clients)
                clients.append(client)
                carrying.append(rid)
            client.start_stream(callback=functools.partial(on_response, k))
            return k

        def stream_for(rid: str) -> int:
            with lock:
                k = next((i for i, r in enumerate(carrying) if r is None), None)
                if k is not None:
                    carrying[k] = rid
                    return k
            return open_stream(rid)

        outputs = [grpcclient.InferRequestedOutput(name) for name in self.outputs] if self.outputs else None
        finished = False
        try:
            for _ in range(min(concurrency or 1, len(requests))):  # connected before the clock starts
                open_stream(None)
            if ready is not None:
                ready()

            def send(index: int) -> None:
                rid = f"r{index}"
                inputs = self.inputs(requests[index])
                k = stream_for(rid)
                with lock:
                    records[rid] = RequestRecord(start=time.perf_counter())
                clients[k].async_stream_infer(self.model, inputs, request_id=rid, outputs=outputs,
                                              enable_empty_final_response=True)

            _drive(len(requests), send, done, concurrency, rate, seed, timeout_s)
            finished = True
        finally:
            for client in clients:
                client.stop_stream(cancel_requests=not finished)  # leaving on an error: nothing left to wait for
                client.close()
        return [records[f"r{i}"] for i in range(len(requests)) if f"r{i}" in records]


class _TritonJob:
    """A client process's share of a TritonDriver level (picklable: it crosses to a spawned process)."""

    def __init__(self, url: str, model: str, outputs: list[str] | None) -> None:
        self.url, self.model, self.outputs = url, model, outputs

    def __call__(self, items: list[dict], concurrency, rate, seed, timeout_s, ready) -> list[RequestRecord]:
        driver = TritonDriver(self.url, self.model, self.outputs, processes=1)
        return driver.run_here(items, concurrency, rate, seed, timeout_s, ready=ready)


class _OpenAIJob:
    """A client process's share of an OpenAIDriver level: the request bodies, on one event loop."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def __call__(self, items: list[dict], concurrency, rate, seed, timeout_s, ready) -> list[RequestRecord]:
        import httpx  # noqa: F401 - imported before the barrier, so no process starts late

        ready()
        return asyncio.run(_run_bodies(self.base_url, items, concurrency, rate, seed, timeout_s))


def _drive(count: int, send, done: queue.Queue, concurrency: int | None, rate: float | None, seed: int,
           timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    num_done = 0
    if rate is not None:
        rng = random.Random(seed)
        next_at = time.perf_counter()
        for index in range(count):
            delay = next_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            send(index)
            next_at += rng.expovariate(rate)
    else:
        for index in range(min(concurrency or 1, count)):
            send(index)
    num_sent = count if rate is not None else min(concurrency or 1, count)
    while num_done < count:
        try:
            done.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"{count - num_done} requests unfinished after {timeout_s:.0f} s") from None
        num_done += 1
        if num_sent < count:
            send(num_sent)
            num_sent += 1


class OpenAIDriver:
    """Streaming `/v1/completions` against the proxy; prompts are text (`prompt_text(input_ids)`, as
    `mstar_common.bench.cli.prompt_text_for` makes it: the request's token length, and as distinct as its ids).

    One client process (httpx on one event loop) saturates a core at ~17,000 SSE events/s on a CPU machine, and
    its own queueing then shows up as TTFT and lost throughput (docs/benchmarks.md, "The OpenAI proxy under
    load"). So `run` spreads a load over `processes` client processes (`client_processes`, `_run_in_processes`).
    """

    def __init__(self, base_url: str, model: str, prompt_text, processes: int | str = "auto") -> None:
        self.base_url, self.model, self.prompt_text = base_url.rstrip("/"), model, prompt_text
        self.processes = processes

    def run(self, requests: list[dict], concurrency: int | None = None, rate: float | None = None,
            seed: int = 0, timeout_s: float = 600.0) -> list[RequestRecord]:
        bodies = [self.body(request) for request in requests]
        num = self.num_processes(len(bodies), concurrency, rate)
        if num <= 1:
            return asyncio.run(_run_bodies(self.base_url, bodies, concurrency, rate, seed, timeout_s))
        return _run_in_processes(_OpenAIJob(self.base_url), bodies, num, concurrency, rate, seed, timeout_s)

    def num_processes(self, count: int, concurrency: int | None, rate: float | None) -> int:
        return client_processes(self.processes, count, concurrency, rate)

    def body(self, request: dict) -> dict:
        """The /v1/completions body of one request: its prompt as text and every knob it holds, the same knobs
        the Triton driver sends as tensors (one it leaves out takes the server's default on both routes)."""
        return {"model": self.model, "prompt": self.prompt_text(request["input_ids"]), "stream": True,
                # the tokens so far on every chunk, so each chunk's count is exact (as the Triton driver's)
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                **{name: request[name] for name in (*wire.SAMPLING_INPUTS, wire.STOP, wire.STOP_TOKEN_IDS)
                   if name in request}}


def _share(total: int, num: int, index: int) -> int:
    return total // num + (1 if index < total % num else 0)


def _run_in_processes(job, items: list[dict], num: int, concurrency: int | None, rate: float | None,
                      seed: int, timeout_s: float) -> list[RequestRecord]:
    """`job(share, concurrency, rate, seed, timeout_s, ready)` in `num` client processes: request i goes to process
    i % num, each process drives its share of the concurrency (or rate / num Poisson arrivals: a split Poisson
    stream is Poisson), and all start together at a barrier (`ready`). Timestamps are `time.perf_counter`, one
    monotonic clock for every process on Linux. The records come back in request order."""
    context = multiprocessing.get_context("spawn")  # no forked event loops, sockets or gRPC channels
    barrier, results = context.Barrier(num), context.Queue()
    workers = []
    for index in range(num):
        share = items[index::num]
        args = (job, share, None if concurrency is None else max(1, _share(concurrency, num, index)),
                None if rate is None else rate / num, seed + index, timeout_s, barrier, results, index)
        workers.append(context.Process(target=_client_process, args=args, daemon=True))
    for worker in workers:
        worker.start()
    parts: dict[int, list[RequestRecord] | str] = {}
    deadline = time.monotonic() + timeout_s + 120
    try:
        while len(parts) < num:
            try:
                index, part = results.get(timeout=1.0)
            except queue.Empty:
                dead = [w.exitcode for i, w in enumerate(workers) if i not in parts and w.exitcode is not None]
                if dead:  # a report flushed just before its sender exited may still be in the pipe: one last look
                    try:
                        index, part = results.get(timeout=5.0)
                    except queue.Empty:
                        raise RuntimeError(f"a client process exited with code {dead[0]} without results") from None
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"client processes unfinished after {timeout_s:.0f} s") from None
                else:
                    continue
            parts[index] = part
    finally:
        for worker in workers:
            worker.join(5)
            if worker.is_alive():
                worker.terminate()
    failed = [part for part in parts.values() if isinstance(part, str)]
    if failed:
        raise RuntimeError(f"a client process failed: {failed[0]}")
    records: list[RequestRecord] = [None] * len(items)  # type: ignore[list-item]
    for index, part in parts.items():
        records[index::num] = part
    return records


def _client_process(job, items, concurrency, rate, seed, timeout_s, barrier, results, index) -> None:
    try:
        results.put((index, job(items, concurrency, rate, seed, timeout_s, lambda: barrier.wait(timeout=120))))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        barrier.abort()  # a process failing before the start must not leave the others waiting out the barrier
        results.put((index, f"{type(exc).__name__}: {exc}"))


def is_local(url: str) -> bool:
    """Whether `url` (`host:port` or an http URL) names this host. The load sent there goes direct: httpx, urllib and
    gRPC send even a loopback request through the environment's http_proxy, and `bench serve` on a host with one set
    measured (or lost) its own server's load through that proxy."""
    host = urllib.parse.urlsplit(url if "://" in url else f"//{url}").hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return False


def open_url(url: str, timeout: float):
    """`urllib.request.urlopen(url, timeout)`, direct (not through the environment's http_proxy) where `url` is on
    this host."""
    if is_local(url):
        from mstar_common.launcher import open_direct

        return open_direct(url, timeout)
    return urllib.request.urlopen(url, timeout=timeout)


def triton_grpc_client(url: str):
    """A tritonclient gRPC client for `url`, with the proxy's channel options (no http_proxy) where it is local."""
    import tritonclient.grpc as grpcclient

    from mstar_common.proxy.triton_stream import channel_args

    return grpcclient.InferenceServerClient(url, channel_args=channel_args() if is_local(url) else None)


async def _run_bodies(base_url: str, bodies: list[dict], concurrency: int | None, rate: float | None, seed: int,
                      timeout_s: float) -> list[RequestRecord]:
    import httpx

    records = [RequestRecord(start=0.0) for _ in bodies]
    # closed loop: one connection per stream; open loop: one per request, so that arrivals past the server's
    # pace are sent as they come (a pool cap would hold them in the client, and count that wait as their TTFT)
    limits = httpx.Limits(max_connections=max(len(bodies), 1) if rate is not None else max(concurrency or 1, 1),
                          max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, trust_env=not is_local(base_url)) as client:
        if rate is not None:  # arrivals on an absolute schedule: a late wake-up sends at once and does not shift
            rng = random.Random(seed)  # the arrivals after it (the event loop also parses every stream's events)
            tasks = []
            next_at = time.perf_counter()
            for index in range(len(bodies)):
                tasks.append(asyncio.create_task(_one(client, base_url, bodies[index], records[index])))
                next_at += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            await asyncio.gather(*tasks)
        else:
            cursor = iter(range(len(bodies)))

            async def worker() -> None:
                for index in cursor:
                    await _one(client, base_url, bodies[index], records[index])

            await asyncio.gather(*(worker() for _ in range(min(concurrency or 1, len(bodies)))))
    return records


async def _sse_lines(response):
    """The stream's lines split the SSE way (aiter_lines also splits inside a JSON string at U+2028 ...)."""
    lines = SSELines()
    async for chunk in response.aiter_bytes():
        for line in lines.feed(chunk):
            yield line
    for line in lines.close():
        yield line


async def _one(client, base_url: str, body: dict, rec: RequestRecord) -> None:
    rec.start = time.perf_counter()
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                rec.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            counted, finished, final = 0, False, None
            untimed: list[float] = []  # content chunks without usage (a server with no continuous_usage_stats)
            async for line in _sse_lines(response):
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    finished = True
                    break
                now, chunk = time.perf_counter(), json.loads(line[6:])
                if "error" in chunk:  # the proxy's way to fail a stream after its 200
                    rec.error = f"stream error: {str(chunk['error'])[:200]}"
                    return
                usage = chunk.get("usage")
                if not chunk.get("choices"):
                    final = usage["completion_tokens"] if usage else final
                elif usage:  # a chunk's tokens: what the usage so far grew by (a finish chunk may add none)
                    if usage["completion_tokens"] > counted:
                        rec.chunks.append((now, usage["completion_tokens"] - counted))
                        counted = usage["completion_tokens"]
                elif any(c.get("text") or (c.get("delta") or {}).get("content") for c in chunk["choices"]):
                    untimed.append(now)
            if not finished:
                rec.error = "stream ended without data: [DONE]"
            elif untimed and not rec.chunks and final:  # spread the final count over the chunks with text
                rec.chunks = _spread(untimed, final)
    except Exception as exc:  # noqa: BLE001 - recorded per request
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        rec.end = time.perf_counter()


def _spread(times: list[float], total: int) -> list[tuple[float, int]]:
    """`total` tokens over chunks at `times`, as evenly as whole numbers allow (the last takes the remainder)."""
    out, given = [], 0
    for i, t in enumerate(times):
        n = round(total * (i + 1) / len(times)) - given
        out.append((t, n))
        given += n
    return out
