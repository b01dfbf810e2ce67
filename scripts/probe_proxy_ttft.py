"""Where the OpenAI proxy's time to first token goes, at one stream: the same server, three ways in.

- ids direct: tritonclient gRPC streaming with token ids (what `bench.py serve` sends to Triton);
- text direct: the same with the prompt as text, so the entry model tokenizes it (as for every proxy request);
- proxy: streaming /v1/completions through the proxy (httpx, as `bench.py serve` drives it), prompt as text;
- proxy, raw client: the same request written on a kept-alive socket by a minimal asyncio HTTP/1.1 client, timed
  to the first SSE event, which separates the proxy's share from the benchmark client's (httpx) own.

The proxy logs its own view per request ("POST /v1/completions -> 200 in X ms": arrival to the first Triton
response); with MSTAR_BENCH_LOG_DIR set, bench.py copies it (proxy-probe.log) and the server's log there. Usage (a
checkpoint with a tokenizer that knows " the", e.g. one from mstar_common.bench.checkpoints, or the builtin
qwen3-tiny with --prompt-len 256 --max-model-len 512):

    python scripts/probe_proxy_ttft.py --checkpoint DIR [--device gpu] [--prompt-len 512] [--requests 16]
        [--concurrency 1] [--output-len 4] [bench.py serve options, e.g. --decode-buckets 1 2 4 8 16 32 64]

At a concurrency above one each way also prints its output tok/s (the raw client only times the first event).
"""

import argparse
import asyncio
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mstar_common import wire  # noqa: E402
from mstar_common.bench import cli as bench  # noqa: E402
from mstar_common.bench.drivers import OpenAIDriver, TritonDriver  # noqa: E402
from mstar_common.bench.metrics import summarize  # noqa: E402
from mstar_common.bench.workload import Workload  # noqa: E402


def ttfts_ms(records) -> list[float]:
    return sorted((r.chunks[0][0] - r.start) * 1e3 for r in records if r.chunks)


def as_text(requests: list[dict], prompt_len: int) -> list[dict]:
    """The same requests with the prompt as text (" the" is one token of the benchmark tokenizers)."""
    out = []
    for request in requests:
        request = {k: v for k, v in request.items() if k != wire.INPUT_IDS}
        request[wire.TEXT_INPUT] = " the" * prompt_len
        out.append(request)
    return out


async def _raw_ttfts(proxy_url: str, bodies: list[dict], concurrency: int = 1) -> list[float]:
    """Time to the first SSE event per request: `concurrency` kept-alive HTTP/1.1 connections, each sending its
    share of the requests one after another and reading each stream to its end."""
    url = urlsplit(proxy_url)

    async def connection(share: list[dict]) -> list[float]:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        ttfts = []
        try:
            for body in share:
                payload = json.dumps(body).encode()
                start = time.perf_counter()
                writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (url.netloc.encode(), len(payload), payload))
                await writer.drain()
                first = None
                while True:  # chunked transfer: size line, data, CRLF; the stream ends with a 0-size chunk
                    line = await reader.readline()
                    if not line:
                        raise ConnectionError("the proxy closed the connection mid-response")
                    if first is None and b"data: {" in line:
                        first = time.perf_counter() - start
                    if line == b"0\r\n":
                        await reader.readline()
                        break
                ttfts.append(first * 1e3)
        finally:
            writer.close()
        return ttfts

    shares = await asyncio.gather(*(connection(bodies[i::concurrency]) for i in range(concurrency)))
    return sorted(t for share in shares for t in share)


def four_ways(args, grpc_url, entry, proxy_url, checkpoint, *, count: int, concurrency: int) -> list:
    """Stands in for bench.sweep: two rounds of the four ways in, after a warm-up of each."""
    workload = Workload("fixed", args.prompt_len, args.output_len)
    triton = TritonDriver(grpc_url, entry)
    openai = OpenAIDriver(proxy_url, args.name, bench.prompt_text_for(checkpoint))
    issued = 0

    def requests(num: int) -> list[dict]:
        nonlocal issued
        issued += num
        return workload.requests(num, first=issued - num)

    def raw(num: int) -> tuple[list[float], None]:
        bodies = [openai.body(r) for r in requests(num)]
        return asyncio.run(_raw_ttfts(proxy_url, bodies, min(concurrency, num))), None

    def driven(driver, batch: list[dict]) -> tuple[list[float], float]:
        records = driver.run(batch, concurrency=concurrency)
        return ttfts_ms(records), summarize(records)["output_tok_per_s"]

    triton.run(requests(2), concurrency=1)
    openai.run(requests(2), concurrency=1)
    raw(2)
    ways = (("ids direct", lambda: driven(triton, requests(count))),
            ("text direct", lambda: driven(triton, as_text(requests(count), args.prompt_len))),
            ("proxy", lambda: driven(openai, requests(count))),
            ("proxy, raw", lambda: raw(count)))
    for _ in range(2):
        for name, run in ways:
            t, tok_s = run()
            rate = "" if tok_s is None else f", {tok_s:,.0f} tok/s"
            print(f"{name:12s} c={concurrency} TTFT p50 {statistics.median(t):.2f} ms (min {t[0]:.2f}, "
                  f"p90 {t[int(0.9 * (len(t) - 1))]:.2f}, {len(t)} requests){rate}", flush=True)
    return []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--family", default="qwen3")
    p.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--requests", type=int, default=16, help="per way in, per round (two rounds)")
    p.add_argument("--concurrency", type=int, default=1, help="closed-loop streams per way in")
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=1024)
    args, serve_args = p.parse_known_args()  # the rest goes to `bench.py serve` (e.g. --decode-buckets ...)
    bench.sweep = functools.partial(four_ways, count=args.requests, concurrency=args.concurrency)
    return bench.main(["serve", "--family", args.family, "--checkpoint", args.checkpoint, "--name", "probe",
                       "--device", args.device, "--prompt-len", str(args.prompt_len),
                       "--output-len", str(args.output_len), "--max-model-len", str(args.max_model_len),
                       "--out", "/tmp/probe_proxy_ttft.json", "--proxy-concurrency", "1", *serve_args])


if __name__ == "__main__":
    sys.exit(main())
