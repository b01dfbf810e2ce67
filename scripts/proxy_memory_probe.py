"""Proxy memory probe: the proxy under uvicorn against a fake Triton, driven with the soak's client mix, its memory
read at idle between rounds.

Three processes: a fake Triton gRPC server (one token response every 2 ms up to `max_tokens`, then an empty
FINAL), the proxy (`create_app` with the real gRPC client, served by uvicorn as `python -m mstar_common.proxy`
does) and this driver (scripts/soak.py's clients: chat and completions, streamed or not, one stream in ten
abandoned). After each round it waits for idle and asks the proxy, on a route outside the app, to collect garbage
(three passes: unfinished async generators are closed by tasks the collector schedules) and report RSS, glibc
`mallinfo2()`, pymalloc blocks and gc-tracked objects. A leak shows as `in_use` growing with requests while the
objects stay flat; allocator high-water shows as `arena` growing and levelling off.

    python scripts/proxy_memory_probe.py --rounds 12 --round-s 20            # the gRPC path, as served
    python scripts/proxy_memory_probe.py --http-only                          # HTTP side alone: no gRPC
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from soak import client_loop  # noqa: E402

from mstar_common.bench.drivers import is_local  # noqa: E402
from mstar_common.launcher import free_ports  # noqa: E402

TOKEN_S = 0.002  # fake decode step


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


async def idle_memory() -> dict[str, int]:
    for _ in range(3):
        gc.collect()
        await asyncio.sleep(0.2)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    status = Path("/proc/self/status").read_text().splitlines()
    rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return {"rss_kib": rss_kib, "arena_kib": info.arena // 1024, "in_use_kib": info.uordblks // 1024,
            "blocks": sys.getallocatedblocks(), "objects": len(gc.get_objects())}


def fake_triton_service():
    import numpy as np
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    from tritonclient.utils import serialize_byte_tensor

    def infer_response(request, i: int | None) -> service_pb2.ModelStreamInferResponse:
        response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
        if i is None:
            response.parameters["triton_final_response"].bool_param = True
        else:
            for name, datatype, array in (("text_output", "BYTES", np.array([f" t{i}".encode()], dtype=object)),
                                          ("token_ids", "INT32", np.array([i], dtype=np.int32))):
                response.outputs.add(name=name, datatype=datatype, shape=[1])
                response.raw_output_contents.append(
                    serialize_byte_tensor(array).item() if datatype == "BYTES" else array.tobytes())
        return service_pb2.ModelStreamInferResponse(infer_response=response)

    class Service(service_pb2_grpc.GRPCInferenceServiceServicer):
        async def ModelStreamInfer(self, request_iterator, context):
            async for request in request_iterator:
                raw = dict(zip((t.name for t in request.inputs), request.raw_input_contents, strict=True))
                for i in range(int(np.frombuffer(raw.get("max_tokens", b"\x10\0\0\0"), dtype=np.int32)[0])):
                    await asyncio.sleep(TOKEN_S)
                    yield infer_response(request, i)
                yield infer_response(request, None)

    return service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server, Service()


async def serve_triton(port: int) -> None:
    import grpc

    add, service = fake_triton_service()
    server = grpc.aio.server()
    add(service, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


class InProcessTriton:
    """--http-only: the same token stream without gRPC."""

    async def generate(self, model, request_id, gen, timeout_s=None):
        from mstar_common.proxy.triton_stream import StreamResponse

        for i in range(int(gen.sampling.get("max_tokens", 16))):
            await asyncio.sleep(TOKEN_S)
            yield StreamResponse(text=f" t{i}", token_ids=[i])
        yield StreamResponse(is_final=True)

    async def is_ready(self, models):
        return True

    async def close(self):
        pass


def serve_proxy(port: int, triton_url: str | None) -> None:
    import uvicorn

    from mstar_common.proxy.app import ProxySettings, ServedModel, create_app

    settings = ProxySettings(triton_url=triton_url or "none", models=[ServedModel("qwen3", "qwen3_llm")])
    app = create_app(settings, triton=None if triton_url else InProcessTriton())

    async def with_memory_route(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/_memory":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            return await send({"type": "http.response.body", "body": json.dumps(await idle_memory()).encode()})
        await app(scope, receive, send)

    uvicorn.run(with_memory_route, host="127.0.0.1", port=port, log_level="warning")


async def drive(url: str, args) -> list[dict]:
    counts: Counter = Counter()
    rng, rows = random.Random(args.seed), []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=args.concurrency + 4),
                                 trust_env=not is_local(url)) as client:
        for round_id in range(args.rounds + 1):
            if round_id:
                stop_at = time.monotonic() + args.round_s
                await asyncio.gather(*(client_loop(client, url, "qwen3", random.Random(rng.random()), stop_at, counts)
                                       for _ in range(args.concurrency)))
            await asyncio.sleep(1.0)
            row = {"round": round_id, "requests": counts["status_200"], "abandoned": counts["abandoned"],
                   **(await client.get(url + "/_memory")).json()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--round-s", type=float, default=20)
    parser.add_argument("-c", "--concurrency", type=int, default=32)
    parser.add_argument("--http-only", action="store_true", help="no gRPC: the proxy's Triton client is in-process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve", choices=("triton", "proxy"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--triton-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "triton":
        return asyncio.run(serve_triton(args.port))
    if args.serve == "proxy":
        return serve_proxy(args.port, args.triton_url)
    procs, (proxy_port, triton_port) = [], free_ports(2)
    proxy_cmd = [sys.executable, __file__, "--serve", "proxy", "--port", str(proxy_port)]
    try:
        if not args.http_only:
            procs.append(subprocess.Popen([sys.executable, __file__, "--serve", "triton", "--port", str(triton_port)]))
            proxy_cmd += ["--triton-url", f"127.0.0.1:{triton_port}"]
        procs.append(subprocess.Popen(proxy_cmd))
        time.sleep(3)
        rows = asyncio.run(drive(f"http://127.0.0.1:{proxy_port}", args))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    first, last = rows[1], rows[-1]
    num_requests = max(last["requests"] - first["requests"], 1)
    for key in ("rss_kib", "arena_kib", "in_use_kib"):
        print(f"{key}: {first[key]} -> {last[key]} after round 1, "
              f"{1024 * (last[key] - first[key]) / num_requests:.0f} B/request")


if __name__ == "__main__":
    main()
