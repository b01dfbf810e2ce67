"""The ceiling of the benchmark's Triton client: `TritonDriver` against a bare gRPC streaming server (no model).

A server process speaks Triton's GRPCInferenceService.ModelStreamInfer: per request it streams `--tokens` token
ids, `--per-response` per response (the served step coalesces: ~12.6 per response at c=64 on the H200), each with
the outputs an entry model sends, then the final flag. The driver runs a closed loop at `--concurrency`; what one
process measures here is the most it can measure of a real server.

    python scripts/probe_triton_client.py [--concurrency 64] [--requests 256] [--per-response 1 4 13]
"""

from __future__ import annotations

import argparse
import queue
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def serve(port: int, tokens: int, per_response: int) -> None:
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

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--per-response", type=int, nargs="+", default=[1, 4, 13])
    p.add_argument("--serve", type=int, nargs=2, help=argparse.SUPPRESS)  # the server process: port, per response
    args = p.parse_args()
    if args.serve:
        serve(args.serve[0], args.tokens, args.serve[1])
        return 0
    from mstar_common.bench.drivers import TritonDriver
    from mstar_common.bench.metrics import summarize

    requests = [{"input_ids": [1] * 8, "max_tokens": args.tokens, "ignore_eos": True, "temperature": 0.0}
                for _ in range(args.requests)]
    for per_response in args.per_response:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), str(per_response),
                                   "--tokens", str(args.tokens)])
        try:
            time.sleep(2.0)
            driver = TritonDriver(f"127.0.0.1:{port}", "m")
            driver.run(requests[:4], concurrency=4)
            s = summarize(driver.run(requests, concurrency=args.concurrency))
            ttft = " / ".join(f"{v:.0f}" for v in s["ttft_ms"].values())
            print(f"c={args.concurrency}, {per_response} tokens per response: {s['output_tok_per_s']:,.0f} tok/s "
                  f"({s['output_tok_per_s'] / per_response:,.0f} responses/s), TTFT p50 / p90 / p99 {ttft} ms, "
                  f"errors {s['num_errors']}", flush=True)
        finally:
            server.terminate()
            server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
