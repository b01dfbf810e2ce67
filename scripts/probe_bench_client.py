"""The ceiling of the benchmark's OpenAI client: its driver against a bare SSE server (no proxy, no model).

A server process streams `--tokens` completion chunks per POST as fast as the client reads them (yielding every
8 chunks); the driver (mstar_common.bench.drivers.OpenAIDriver) runs a closed loop at `--concurrency` with 1, 2,
... client processes. Whatever tok/s and TTFT tail one process shows here is the most it can measure of a real
proxy.

    python scripts/probe_bench_client.py [--concurrency 64] [--requests 256] [--processes 1 2 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def serve(port: int, tokens: int) -> None:
    chunk = json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": " w1", "finish_reason": None}]})
    usage = json.dumps({"object": "text_completion", "choices": [], "usage": {"completion_tokens": tokens}})

    def frame(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    chunk_frame, tail = frame(f"data: {chunk}\n\n".encode()), frame(f"data: {usage}\n\n".encode())
    tail += frame(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    async def handle(reader, writer) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for i in range(tokens):
                    writer.write(chunk_frame)
                    if i % 8 == 7:
                        await writer.drain()
                        await asyncio.sleep(0)
                writer.write(tail)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server process's port
    args = p.parse_args()
    if args.serve:
        serve(args.serve, args.tokens)
        return 0
    from mstar_common.bench.drivers import OpenAIDriver
    from mstar_common.bench.metrics import summarize

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--tokens", str(args.tokens)])
    try:
        time.sleep(1.5)
        requests = [{"input_ids": [1] * 8, "max_tokens": args.tokens, "ignore_eos": True, "temperature": 0.0}
                    for _ in range(args.requests)]
        for processes in args.processes:
            driver = OpenAIDriver(f"http://127.0.0.1:{port}", "m", lambda n: " the" * n, processes=processes)
            driver.run(requests[:4], concurrency=4)
            s = summarize(driver.run(requests, concurrency=args.concurrency))
            ttft = " / ".join(f"{v:.0f}" for v in s["ttft_ms"].values())
            print(f"c={args.concurrency}, {processes} client process(es): {s['output_tok_per_s']:,.0f} tok/s, "
                  f"TTFT p50 / p90 / p99 {ttft} ms, errors {s['num_errors']}", flush=True)
    finally:
        server.terminate()
        server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
