#!/usr/bin/env python3
"""What the engine's steps would be for a closed-loop workload, with no model: the engine's own scheduler
(mstar_common/engine/scheduler.py) and page allocator run the workload, and each step is put in the graph bucket
the CUDA-graph runner would replay it in (decode buckets by rows, prefill/mixed buckets by packed tokens). It
prints how many steps of each kind, how full the mixed graphs run, and the padding share of the token slots the
replays compute: what `mstar_graph_padding_tokens_total` would count (docs/metrics.md). Use it to judge a bucket
ladder before spending GPU time on it.

    python scripts/simulate_steps.py --concurrency 64 --prompt-len 512 --output-len 256 \\
        --token-buckets 512 1024 2048 --decode-buckets 1 2 4 8 16 32 64

Every request decodes exactly `--output-len` tokens (`ignore_eos`); a finished request is replaced until
`--requests` have been issued: at once, or after a number of steps drawn evenly from 0 to `--return-lag` (the
client's turnaround: the last token's trip back, the next request's trip in). With no lag the streams admitted in
one step stay in step for good, so the prefills arrive four at a time and fill the 2048 graph; a lag of a step or
two, as real clients have, spreads them out: one prefill a step, beside the decodes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mstar_common.engine.cuda_graph import DECODE, GREEDY, MIXED, CudaGraphRunner  # noqa: E402
from mstar_common.engine.kv_cache import PageAllocator  # noqa: E402
from mstar_common.engine.scheduler import Scheduler  # noqa: E402
from mstar_common.engine.sequence import Sequence  # noqa: E402
from mstar_common.engine.types import SamplingParams  # noqa: E402


class RunnerBuckets:
    """The graph runner's own bucket choice (`CudaGraphRunner.pick`) over greedy graphs of every bucket, all
    captured, with no model behind them."""

    samples_in_graph = False  # greedy steps: the choice is by rows and tokens alone
    pick = CudaGraphRunner.pick
    _shape = CudaGraphRunner._shape

    def __init__(self, decode_buckets: list[int], token_buckets: list[int], max_rows: int) -> None:
        # as the runner keeps them: decode buckets of at most max_num_seqs rows
        self.decode_buckets = sorted(b for b in set(decode_buckets) if 1 <= b <= max_rows)
        self.token_buckets = sorted(set(token_buckets))
        self.max_rows = max_rows
        self.graphs = {(DECODE, b, GREEDY) for b in self.decode_buckets} | {(MIXED, b, GREEDY)
                                                                            for b in self.token_buckets}

    def bucket_of(self, rows: int, tokens: int, decode: bool) -> tuple[str, int]:
        """(kind, size) of the graph this step would replay, or ("eager", 0)."""
        key = self.pick(SimpleNamespace(is_decode=decode, num_rows=rows, num_tokens=tokens))
        return ("eager", 0) if key is None else (key[0], key[1])


def simulate(concurrency: int, prompt_len: int, output_len: int, requests: int, max_batch_tokens: int,
             decode_buckets: list[int], token_buckets: list[int], page_size: int = 64,
             num_pages: int | None = None, return_lag: int = 0, seed: int = 0) -> dict:
    """Run the workload through the scheduler; the steps by bucket and their padding. A finished stream's next
    request arrives 0 to `return_lag` steps later (evenly drawn, `seed`)."""
    buckets = RunnerBuckets(decode_buckets, token_buckets, concurrency)
    pages_each = -(-(prompt_len + output_len) // page_size)
    allocator = PageAllocator(num_pages or pages_each * concurrency, page_size)
    scheduler = Scheduler(allocator, max_num_seqs=concurrency, max_batch_tokens=max_batch_tokens)
    params = SamplingParams(max_tokens=output_len, temperature=0.0)
    issued = finished = step = 0
    rng = random.Random(seed)
    arrivals: Counter = Counter()  # step -> requests arriving before it is scheduled

    def issue() -> None:
        nonlocal issued
        scheduler.add(Sequence(str(issued), [1] * prompt_len, prompt_len, params, lambda *_: None))
        issued += 1

    for _ in range(min(concurrency, requests)):
        issue()
    steps: Counter = Counter()
    tokens_by: Counter = Counter()
    while finished < requests:
        for _ in range(arrivals.pop(step, 0)):
            issue()
        step += 1
        plan = scheduler.schedule()
        if plan.is_empty and arrivals:
            continue  # every stream is between requests
        if plan.is_empty:
            raise RuntimeError("the scheduler made no step with requests left (too few KV pages?)")
        rows, tokens = len(plan.chunks), sum(chunk.num_tokens for chunk in plan.chunks)
        kind = buckets.bucket_of(rows, tokens, all(chunk.num_tokens == 1 for chunk in plan.chunks))
        steps[kind] += 1
        tokens_by[kind] += tokens
        done = []
        for chunk in plan.chunks:
            seq, sampling = chunk.seq, chunk.is_sampling  # (read before the tokens count as computed)
            seq.num_computed_tokens += chunk.num_tokens
            if sampling:
                seq.token_ids.append(1)
                if seq.num_output_tokens >= output_len:
                    done.append(seq)
        for seq in done:
            scheduler.finish(seq)
            finished += 1
            if issued + sum(arrivals.values()) < requests:
                arrivals[step + rng.randint(0, return_lag)] += 1
    slots = sum(count * size for (_, size), count in steps.items())
    graph_tokens = sum(tokens_by[kind] for kind in steps if kind[0] != "eager")
    return {
        "steps": sum(steps.values()),
        "by_bucket": {f"{kind} {size}" if size else kind: {"steps": count, "tokens_per_step":
                                                            round(tokens_by[kind, size] / count, 1)}
                      for (kind, size), count in sorted(steps.items(), key=lambda item: (item[0][0], item[0][1]))},
        "tokens": sum(tokens_by.values()),
        "padding_tokens": slots - graph_tokens,
        "padding_share": round((slots - graph_tokens) / (sum(tokens_by.values()) + slots - graph_tokens), 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--requests", type=int, default=0, help="requests in all (default: 6 a stream)")
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--decode-buckets", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--token-buckets", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--return-lag", type=int, default=0,
                        help="a finished stream's next request arrives 0 to this many steps later (default 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    result = simulate(args.concurrency, args.prompt_len, args.output_len, args.requests or 6 * args.concurrency,
                      args.max_batch_tokens, sorted(args.decode_buckets), sorted(args.token_buckets), args.page_size,
                      return_lag=args.return_lag, seed=args.seed)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{result['steps']:,} steps, {result['tokens']:,} tokens computed, padding {result['padding_share']:.1%} "
          "of the token slots the replays computed")
    for name, row in result["by_bucket"].items():
        size = int(name.split()[-1]) if name != "eager" else 0
        fill = f" ({row['tokens_per_step'] / size:.0%} full)" if name.startswith("mixed") else ""
        print(f"  {name:12s} {row['steps']:6,} steps, {row['tokens_per_step']:7.1f} tokens a step{fill}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
