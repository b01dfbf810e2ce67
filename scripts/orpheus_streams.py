#!/usr/bin/env python
"""Reads bench_orpheus.py results (--out JSON, whose runs carry per-stream records) and shows, per run, where
the stalled streams sit: how many stalled in each tenth of the streams ordered by first audio (0 = the first to
start playing), when their first gap began, and the worst ones.

    python scripts/orpheus_streams.py results.json [--worst 10]

A stream's record: [first audio s, total stall ms, first stall s or null, last audio s, responses, and (since
the client sends at one common instant) request sent s after that instant] (null for a stream that failed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STALL_MS = 10.0  # bench_orpheus.py's MAX_STALL_S: below this a stream counts as real time


def describe(run: dict, worst: int = 10) -> list[str]:
    streams = [s for s in run.get("streams") or [] if s is not None]
    head = f"{run['system']} c={run['concurrency']}"
    if not streams:
        return [f"{head}: no per-stream records"]
    order = sorted(range(len(streams)), key=lambda i: streams[i][0])
    stalled = {i for i, s in enumerate(streams) if s[1] >= STALL_MS}
    tenths = [0] * 10
    for rank, i in enumerate(order):
        if i in stalled:
            tenths[min(9, rank * 10 // len(order))] += 1
    lines = [f"{head}: {len(stalled)}/{len(streams)} streams stalled; by first-audio tenth (earliest first): "
             + " ".join(str(n) for n in tenths)]
    if stalled:
        gaps = sorted(streams[i][2] for i in stalled if streams[i][2] is not None)
        if gaps:
            lines.append(f"  first gap began {gaps[0]:.2f}-{gaps[-1]:.2f} s into the request "
                         f"(median {gaps[len(gaps) // 2]:.2f})")
        for i in sorted(stalled, key=lambda i: -streams[i][1])[:worst]:
            first, total, at, last, responses = streams[i][:5]
            sent = streams[i][5] if len(streams[i]) > 5 and streams[i][5] is not None else None
            lines.append(f"  stream {i:4d}: first audio {first:6.3f} s, stall {total:7.1f} ms from "
                         f"{at if at is None else round(at, 3)} s, last audio {last:6.2f} s, {responses} responses"
                         + ("" if sent is None else f", sent at +{sent * 1e3:.1f} ms"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--worst", type=int, default=10)
    args = parser.parse_args(argv)
    for run in json.loads(args.results.read_text())["results"]:
        print("\n".join(describe(run, args.worst)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
