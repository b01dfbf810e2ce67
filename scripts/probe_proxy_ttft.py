"""Where the OpenAI proxy's time to first token goes, at one stream: the same server, three ways in.

- ids direct: tritonclient gRPC streaming with token ids (what `bench.py serve` sends to Triton);
- text direct: the same with the prompt as text, so the entry model tokenizes it (as for every proxy request);
- proxy: streaming /v1/completions through the proxy (httpx), prompt as text.

The proxy logs its own view per request ("POST /v1/completions -> 200 in X ms": arrival to the first Triton
response); that log stays in the printed server directory. Usage (a checkpoint with a tokenizer that knows
" the", e.g. one from mstar_common.bench.checkpoints):

    python scripts/probe_proxy_ttft.py --checkpoint DIR [--device gpu] [--prompt-len 512] [--requests 16]
"""

import argparse
import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402

from mstar_common import wire  # noqa: E402
from mstar_common.bench.drivers import OpenAIDriver, TritonDriver  # noqa: E402
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


def three_ways(args, grpc_url, entry, proxy_url, checkpoint, *, count: int) -> list:
    """Stands in for bench.sweep: two rounds of the three ways in, after a warm-up of each."""
    workload = Workload("fixed", args.prompt_len, args.output_len)
    triton = TritonDriver(grpc_url, entry)
    openai = OpenAIDriver(proxy_url, args.name, bench.prompt_text_for(checkpoint))
    issued = 0

    def requests(num: int) -> list[dict]:
        nonlocal issued
        issued += num
        return workload.requests(num, first=issued - num)

    triton.run(requests(2), concurrency=1)
    openai.run(requests(2), concurrency=1)
    ways = (("ids direct", lambda: triton.run(requests(count), concurrency=1)),
            ("text direct", lambda: triton.run(as_text(requests(count), args.prompt_len), concurrency=1)),
            ("proxy", lambda: openai.run(requests(count), concurrency=1)))
    for _ in range(2):
        for name, run in ways:
            t = ttfts_ms(run())
            print(f"{name:12s} TTFT p50 {statistics.median(t):.2f} ms (min {t[0]:.2f}, {len(t)} requests)", flush=True)
    return []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--family", default="qwen3")
    p.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--requests", type=int, default=16, help="per way in, per round (two rounds)")
    p.add_argument("--max-model-len", type=int, default=1024)
    args = p.parse_args()
    bench.sweep = functools.partial(three_ways, count=args.requests)
    return bench.main(["serve", "--family", args.family, "--checkpoint", args.checkpoint, "--name", "probe",
                       "--device", args.device, "--prompt-len", str(args.prompt_len), "--output-len", "4",
                       "--max-model-len", str(args.max_model_len), "--out", "/tmp/probe_proxy_ttft.json",
                       "--proxy-concurrency", "1"])


if __name__ == "__main__":
    sys.exit(main())
