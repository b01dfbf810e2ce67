"""Cancel N streams at random points and check that the server holds nothing afterwards.

Half the streams go through the proxy and are cancelled by disconnecting (before any output, after k SSE
events, or after a random delay); the other half go straight to Triton over gRPC and are cancelled by
closing the stream. Afterwards the component's metrics must show 0 KV pages used or reserved, 0 state slots
and no running or waiting request. Prints a JSON summary; exits 1 on any leak or server error.

    python scripts/cancel_fuzz.py --proxy http://127.0.0.1:8000 --grpc 127.0.0.1:8001 \\
        --metrics http://127.0.0.1:8002/metrics --model qwen3-tiny --entry qwen3_llm -n 1000 -c 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from mstar_common.bench.drivers import is_local, open_url

HELD = ("mstar_kv_pages_used", "mstar_kv_pages_reserved", "mstar_state_slots_used", "mstar_requests_running",
        "mstar_requests_waiting")


def read_metrics(url: str, names=HELD) -> dict[str, float]:
    """Sum of each named series over its label sets (a missing series is an error: it must be exported)."""
    with open_url(url, timeout=5) as response:
        text = response.read().decode()
    out = {}
    for name in names:
        values = [float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)]
        if not values:
            raise RuntimeError(f"metric {name} is not exported at {url}")
        out[name] = sum(values)
    return out


def wait_until_released(metrics_url: str, timeout_s: float = 10.0) -> tuple[dict[str, float], float]:
    start = time.monotonic()
    while True:
        held = read_metrics(metrics_url)
        if not any(held.values()) or time.monotonic() - start > timeout_s:
            return held, time.monotonic() - start
        time.sleep(0.05)


@dataclass
class FuzzResult:
    num_streams: int
    elapsed_s: float
    outcomes: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    held_after: dict[str, float] = field(default_factory=dict)
    release_s: float = 0.0

    @property
    def is_clean(self) -> bool:
        return not self.errors and not any(self.held_after.values())


async def _via_proxy(client: httpx.AsyncClient, proxy: str, model: str, rng: random.Random, res: FuzzResult):
    body = {"model": model, "prompt": f"fuzz {rng.random()}", "max_tokens": rng.randint(16, 200),
            "temperature": 0.8, "ignore_eos": True, "stream": True}
    mode, stop_after = rng.choice(("events", "events", "delay")), rng.randint(0, 8)
    outcome = None  # counted once in `finally`: the delay timeout can also fire while an ended stream closes
    try:
        async with asyncio.timeout(rng.uniform(0.0, 0.2) if mode == "delay" else None):
            async with client.stream("POST", f"{proxy}/v1/completions", json=body) as response:
                if response.status_code == 429:  # cancelled streams not yet released still hold their places
                    outcome = "proxy_refused_overloaded"
                    return
                if response.status_code != 200:
                    res.errors.append(f"proxy status {response.status_code}: {(await response.aread())[:200]!r}")
                    return
                num_events = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: {\"error\""):
                        res.errors.append(f"proxy stream error: {line[:200]}")
                        return
                    num_events += line.startswith("data: ")
                    if mode == "events" and num_events >= stop_after:
                        outcome = "proxy_disconnect_after_events"
                        return  # leaving the context closes the connection mid-stream
                outcome = "proxy_finished"
    except TimeoutError:
        outcome = outcome or "proxy_disconnect_after_delay"
    finally:
        if outcome is not None:
            res.outcomes[outcome] += 1


async def _via_grpc(triton, entry: str, rng: random.Random, res: FuzzResult, index: int, cancel: bool = True):
    """One gRPC stream, cancelled after 0-8 responses (read to its final with `cancel` false)."""
    from mstar_common.proxy.triton_stream import GenerationRequest, TritonError, TritonOverloaded

    gen = GenerationRequest(text=f"fuzz {rng.random()}", sampling={"max_tokens": rng.randint(16, 200),
                                                                    "ignore_eos": True, "temperature": 0.8})
    stop_after = rng.randint(0, 8)
    stream = triton.generate(entry, f"fuzz-grpc-{index}", gen, 120.0)
    try:
        num = 0
        async for response in stream:
            num += 1
            if cancel and num > stop_after:
                res.outcomes["grpc_cancel_after_responses"] += 1
                return
            if response.is_final:
                res.outcomes["grpc_finished"] += 1
                return
        res.outcomes["grpc_cancel_before_output"] += 1
    except TritonOverloaded:
        res.outcomes["grpc_refused_overloaded"] += 1
    except TritonError as error:
        res.errors.append(f"grpc: {type(error).__name__}: {error}")
    finally:
        await stream.aclose()  # cancels the gRPC call if it is still open


async def fuzz(proxy: str, grpc_url: str, metrics: str, model: str, entry: str, n: int, concurrency: int,
               seed: int = 0) -> FuzzResult:
    from mstar_common.proxy.triton_stream import TritonStreamClient

    rng = random.Random(seed)
    res = FuzzResult(num_streams=n, elapsed_s=0.0)
    gate = asyncio.Semaphore(concurrency)
    triton = TritonStreamClient(grpc_url)
    limits = httpx.Limits(max_connections=concurrency + 8)

    async def one(index: int, client: httpx.AsyncClient) -> None:
        async with gate:
            if index % 2:
                await _via_grpc(triton, entry, random.Random(rng.random()), res, index)
            else:
                await _via_proxy(client, proxy, model, random.Random(rng.random()), res)

    start = time.monotonic()
    async with httpx.AsyncClient(timeout=60, limits=limits, trust_env=not is_local(proxy)) as client:
        await asyncio.gather(*(one(i, client) for i in range(n)))
    res.elapsed_s = time.monotonic() - start
    await triton.close()
    res.held_after, res.release_s = wait_until_released(metrics)
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--proxy", required=True)
    parser.add_argument("--grpc", required=True)
    parser.add_argument("--metrics", required=True)
    parser.add_argument("--model", required=True, help="the OpenAI model name the proxy serves")
    parser.add_argument("--entry", required=True, help="the Triton entry model")
    parser.add_argument("-n", type=int, default=1000)
    parser.add_argument("-c", "--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    res = asyncio.run(fuzz(args.proxy, args.grpc, args.metrics, args.model, args.entry, args.n, args.concurrency,
                           args.seed))
    print(json.dumps({"streams": res.num_streams, "elapsed_s": round(res.elapsed_s, 2),
                      "outcomes": dict(res.outcomes), "errors": res.errors[:10], "num_errors": len(res.errors),
                      "held_after": res.held_after, "released_within_s": round(res.release_s, 2),
                      "clean": res.is_clean}, indent=2))
    return 0 if res.is_clean else 1


if __name__ == "__main__":
    sys.exit(main())
