"""The ceilings of the benchmark's own clients, against bare servers (no proxy, no model, no Triton).

- `--driver openai`: `OpenAIDriver` against an SSE server process that streams `--tokens` completion chunks per
  POST as fast as the client reads them, with 1, 2, ... client processes (`--processes`);
- `--driver triton`: `TritonDriver` against a gRPC server process speaking Triton's ModelStreamInfer, `--tokens`
  token ids per request at `--per-response` per response (the served step coalesces: ~12.6 per response at c=64
  on the H200), with the outputs an entry model sends.

Whatever tok/s and TTFT tail a setting shows here is the most that client can measure of a real server.

    python scripts/probe_bench_client.py --driver openai [--concurrency 64] [--requests 256] [--processes 1 2 4]
    python scripts/probe_bench_client.py --driver triton [--per-response 1 4 13]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mstar_common.launcher import free_port  # noqa: E402


def serve_sse(port: int, tokens: int) -> None:
    """Streaming /v1/completions: `tokens` chunks per POST, then usage and [DONE] (HTTP/1.1, chunked)."""
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


def serve_grpc(port: int, tokens: int, per_response: int, streams: int) -> None:
    """Triton's ModelStreamInfer: `per_response` token ids per response, round-robin over the live requests."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    from tritonclient.utils import serialize_byte_tensor

    from mstar_common import wire

    def response(request_id: str, n: int, done: int, final: bool) -> service_pb2.ModelStreamInferResponse:
        tensors = [(wire.TEXT_OUTPUT, "BYTES", [1], serialize_byte_tensor(np.array([b" w1" * n], np.object_)).item()),
                   (wire.TOKEN_IDS, "INT32", [n], np.arange(n, dtype=np.int32).tobytes()),
                   (wire.FINISH_REASON, "BYTES", [1],
                    serialize_byte_tensor(np.array([b"length" if final else b""], np.object_)).item()),
                   (wire.PROMPT_TOKENS, "INT32", [1], np.array([512], np.int32).tobytes()),
                   (wire.COMPLETION_TOKENS, "INT32", [1], np.array([done], np.int32).tobytes())]
        out = service_pb2.ModelInferResponse
        message = out(model_name="m", id=request_id,
                      outputs=[out.InferOutputTensor(name=a, datatype=b, shape=c) for a, b, c, _ in tensors],
                      raw_output_contents=[t[3] for t in tensors])
        message.parameters["triton_final_response"].bool_param = final
        return service_pb2.ModelStreamInferResponse(infer_response=message)

    class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
        def ModelStreamInfer(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
            out: queue.Queue = queue.Queue()
            live = {}  # request id -> tokens sent

            def read() -> None:
                for request in request_iterator:
                    out.put(("new", request.id))
                out.put(("end", None))

            threading.Thread(target=read, daemon=True).start()
            while True:  # round-robin over the live requests, as a step loop serves its rows
                try:
                    while True:
                        kind, request_id = out.get(block=not live)
                        if kind == "end":
                            return
                        live[request_id] = 0
                except queue.Empty:
                    pass
                for request_id in list(live):
                    n = min(per_response, tokens - live[request_id])
                    live[request_id] += n
                    final = live[request_id] == tokens
                    yield response(request_id, n, live[request_id], final)
                    if final:
                        del live[request_id]

    # a stream holds a worker for its life, and the driver opens one per request in flight
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=streams + 4))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--driver", choices=("openai", "triton"), default="openai")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4], help="openai: client processes")
    p.add_argument("--per-response", type=int, nargs="+", default=[1, 4, 13], help="triton: tokens per response")
    p.add_argument("--serve", type=int, nargs=2, help=argparse.SUPPRESS)  # a server process: port, per response
    args = p.parse_args()
    if args.serve:
        port, per_response = args.serve
        if args.driver == "openai":
            serve_sse(port, args.tokens)
        else:
            serve_grpc(port, args.tokens, per_response, args.concurrency)
        return 0
    from mstar_common.bench.drivers import OpenAIDriver, TritonDriver
    from mstar_common.bench.metrics import summarize

    requests = [{"input_ids": [1] * 8, "max_tokens": args.tokens, "ignore_eos": True, "temperature": 0.0}
                for _ in range(args.requests)]
    settings = args.processes if args.driver == "openai" else args.per_response
    for setting in settings:
        port = free_port()
        per_response = 1 if args.driver == "openai" else setting
        server = subprocess.Popen([sys.executable, __file__, "--driver", args.driver, "--tokens", str(args.tokens),
                                   "--serve", str(port), str(per_response)])
        try:
            time.sleep(2.0)
            if args.driver == "openai":
                driver = OpenAIDriver(f"http://127.0.0.1:{port}", "m", lambda ids: " the" * len(ids), processes=setting)
                label = f"{setting} client process(es)"
            else:
                driver, label = TritonDriver(f"127.0.0.1:{port}", "m"), f"{setting} tokens per response"
            driver.run(requests[:4], concurrency=4)
            s = summarize(driver.run(requests, concurrency=args.concurrency))
            ttft = " / ".join(f"{v:.0f}" for v in s["ttft_ms"].values())
            print(f"{args.driver}, c={args.concurrency}, {label}: {s['output_tok_per_s']:,.0f} tok/s, TTFT p50 / p90 / "
                  f"p99 {ttft} ms, errors {s['num_errors']}", flush=True)
        finally:
            server.terminate()
            server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
