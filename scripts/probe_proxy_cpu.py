#!/usr/bin/env python
"""The OpenAI proxy's CPU time per streamed SSE event, without a GPU: a fake Triton gRPC server (one token per
response every 2 ms per stream, from scripts/proxy_memory_probe.py), the proxy with its real gRPC client under
uvicorn, and `--concurrency` clients on kept-alive sockets streaming /v1/completions. It prints the events
per second and the proxy process's CPU seconds (user + system, from /proc) per event. With `--profile FILE`,
py-spy (if on PATH) samples the proxy during the timed load and the script prints the top frames by own time.

    python scripts/probe_proxy_cpu.py [--concurrency 32] [--tokens 64] [--requests-per-stream 4] [--profile raw.txt]

At one token per response this is the proxy's worst case; the served engine coalesces tokens when a stream falls
behind, so a real response usually carries several.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from mstar_common.launcher import free_ports

PROBE = Path(__file__).resolve().parent / "proxy_memory_probe.py"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_stream(port: int, tokens: int, requests: int, counts: Counter) -> None:
    body = json.dumps({"model": "qwen3", "prompt": "hi", "max_tokens": tokens, "stream": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: probe\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(requests):
            writer.write(request)
            await writer.drain()
            received = b""
            while not received.endswith(b"0\r\n\r\n"):  # the chunked body's end
                chunk = await reader.read(65536)
                if not chunk:
                    raise ConnectionError("the proxy closed the connection")
                received += chunk
            counts["events"] += received.count(b"data: ") - 1  # less the [DONE]
            counts["requests"] += 1
    finally:
        writer.close()


async def load(port: int, concurrency: int, tokens: int, requests: int) -> Counter:
    counts: Counter = Counter()
    await asyncio.gather(*(one_stream(port, tokens, requests, counts) for _ in range(concurrency)))
    return counts


def top_frames(raw: Path, count: int = 15) -> None:
    own, total = Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        own[stack.split(";")[-1]] += int(samples)
        total += int(samples)
    for frame, samples in own.most_common(count):
        print(f"  {samples / max(total, 1) * 100:5.1f}%  {frame}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64, help="tokens (= SSE events) per request")
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--profile", type=Path, help="py-spy's raw samples of the proxy during the load")
    args = parser.parse_args()

    triton_port, proxy_port = free_ports(2)
    triton = subprocess.Popen([sys.executable, str(PROBE), "--serve", "triton", "--port", str(triton_port)])
    proxy = subprocess.Popen([sys.executable, str(PROBE), "--serve", "proxy", "--port", str(proxy_port),
                              "--triton-url", f"127.0.0.1:{triton_port}"])
    spy = None
    try:
        deadline = time.monotonic() + 60
        while True:  # until the proxy answers
            try:
                asyncio.run(load(proxy_port, 2, 4, 1))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        asyncio.run(load(proxy_port, 4, 8, 2))  # warm-up
        if args.profile:
            py_spy = shutil.which("py-spy")
            if py_spy is None:
                print("py-spy is not on PATH: no profile", file=sys.stderr)
            else:
                spy = subprocess.Popen([py_spy, "record", "-p", str(proxy.pid), "-o", str(args.profile), "--format",
                                        "raw", "-r", "500"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1)
        cpu0, t0 = cpu_seconds(proxy.pid), time.perf_counter()
        counts = asyncio.run(load(proxy_port, args.concurrency, args.tokens, args.requests_per_stream))
        cpu, wall = cpu_seconds(proxy.pid) - cpu0, time.perf_counter() - t0
        print(f"c={args.concurrency}: {counts['requests']} requests, {counts['events']} events in {wall:.2f} s "
              f"({counts['events'] / wall:,.0f} events/s); proxy CPU {cpu:.2f} s = "
              f"{cpu / max(counts['events'], 1) * 1e6:.0f} us per event")
    finally:
        if spy is not None:
            spy.send_signal(2)  # py-spy writes its file on SIGINT
            spy.wait(30)
        for process in (proxy, triton):
            process.terminate()
            process.wait(30)
    if spy is not None and args.profile.is_file():
        print("proxy frames by own time:")
        top_frames(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
