"""Stub health under 256 concurrent streams (a GPU run): no stub may be declared unhealthy, none may die.

Starts the deployment (default: configs/qwen3_0_6b_gpu.yaml) under the supervisor, or targets a running one
with --grpc/--metrics/--server-pid, then keeps 256 native gRPC streams open for --duration-s (each stream
sends its next request when the last ends; fixed-length decodes with ignore_eos). It reports responses/s,
tokens/s, every error by kind, stub restarts, and what the component still holds once the load stops.
Passes when there is no "not healthy"/stub error, no relaunch, and nothing is held afterwards.

    python scripts/stub_health_256.py --deployment configs/qwen3_0_6b_gpu.yaml -c 256 --duration-s 300

The deployment must hold C streams: `max_concurrent_requests + admission.max_queue >= C` (the GPU config has
32 + 224), or the excess is refused with 429s, which count as errors here.

The shared-memory and stub-timeout settings it exercises are `server.shm_default_byte_size`,
`server.shm_growth_byte_size` and `server.stub_timeout_seconds` (docs/reliability.md sizes them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from cancel_fuzz import HELD, wait_until_released  # noqa: E402
from soak import start_deployment  # noqa: E402


async def stream_loop(triton, entry: str, index: int, stop_at: float, max_tokens: int, counts: Counter) -> None:
    from mstar_common.proxy.triton_stream import GenerationRequest, TritonError

    rng = random.Random(index)
    num = 0
    while time.monotonic() < stop_at:
        gen = GenerationRequest(text=f"stream {index} request {num} {rng.random()}",
                                sampling={"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0})
        num += 1
        try:
            async for response in triton.generate(entry, f"h{index}-{num}", gen, 600.0):
                counts["responses"] += 1
                counts["tokens"] += len(response.token_ids)
            counts["requests_ok"] += 1
        except TritonError as error:
            text = str(error)
            kind = "stub_unhealthy" if ("not healthy" in text or "Stub" in text) else type(error).__name__
            counts[f"error_{kind}"] += 1
            await asyncio.sleep(0.5)


async def run(args, grpc_url: str, entry: str) -> Counter:
    from mstar_common.proxy.triton_stream import TritonStreamClient

    counts: Counter = Counter()
    triton = TritonStreamClient(grpc_url)
    stop_at = time.monotonic() + args.duration_s
    start = time.monotonic()
    await asyncio.gather(*(stream_loop(triton, entry, i, stop_at, args.max_tokens, counts)
                           for i in range(args.concurrency)))
    counts["elapsed_ms"] = int(1e3 * (time.monotonic() - start))
    await triton.close()
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deployment", default="configs/qwen3_0_6b_gpu.yaml")
    parser.add_argument("-c", "--concurrency", type=int, default=256)
    parser.add_argument("--duration-s", type=float, default=300)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--grpc", help="target a running Triton instead of starting one")
    parser.add_argument("--metrics")
    parser.add_argument("--entry", default="qwen3_llm")
    parser.add_argument("--checkpoint", help="override the deployment's checkpoint (a local dir, e.g. random weights)")
    parser.add_argument("--out", default="runs/stub_health_256.json")
    args = parser.parse_args()
    if args.checkpoint:  # the same deployment on another checkpoint: a copy of the YAML beside the run
        import yaml

        raw = yaml.safe_load(Path(args.deployment).read_text())
        raw["checkpoint"] = args.checkpoint
        copy = Path(tempfile.mkdtemp()) / Path(args.deployment).name
        copy.write_text(yaml.safe_dump(raw, sort_keys=False))
        args.deployment = str(copy)
    supervisor = proxy = None
    try:
        if args.grpc:
            grpc_url, metrics = args.grpc, args.metrics
        else:
            supervisor, proxy, _, _, metrics = start_deployment(args.deployment, Path(tempfile.mkdtemp()))
            grpc_url = f"127.0.0.1:{supervisor.ports.grpc}"
        counts = asyncio.run(run(args, grpc_url, args.entry))
        held, _ = wait_until_released(metrics, 30)
        restarts = supervisor.num_restarts if supervisor is not None else None
    finally:
        if proxy is not None:
            from mstar_common.launcher import stop_process

            stop_process(proxy)
        if supervisor is not None:
            supervisor.stop(drain_s=10)
    seconds = counts["elapsed_ms"] / 1e3
    summary = {"concurrency": args.concurrency, "duration_s": seconds, "counts": dict(counts),
               "responses_per_s": round(counts["responses"] / seconds, 1),
               "tokens_per_s": round(counts["tokens"] / seconds, 1), "server_restarts": restarts,
               "held_after": {k: held[k] for k in HELD}}
    ok = not any(k.startswith("error_") for k in counts) and not restarts and not any(held.values())
    summary["pass"] = ok
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
