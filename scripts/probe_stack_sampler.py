"""Run pytest with a thread that samples every other thread's stack every 0.5 s, then print where the time went.

Usage: python scripts/probe_stack_sampler.py <pytest args>. Caution (docs/benchmarks.md, 2026-12-06): with this
thread running, a test that times kernels in captured CUDA graphs failed inside the capture twice, and passed every
time without it; use it to find where start-up time goes, not for timings.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback

import pytest

INTERVAL_S = 0.5


def _where(frame) -> list[str]:
    return [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)]


def main(args: list[str]) -> int:
    inclusive: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    done = threading.Event()

    def sample() -> None:
        me = threading.get_ident()
        while not done.wait(INTERVAL_S):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                stack = _where(frame) if ident != me else []
                if not stack or any(word in stack[-1] for word in ("wait", "select", " get")):
                    continue  # this thread, or an idle one
                tag = names.get(ident, "?")[:20]
                inclusive.update(f"[{tag}] {entry}" for entry in set(stack))
                leaves[f"[{tag}] " + " <- ".join(reversed(stack[-4:]))] += 1

    threading.Thread(target=sample, daemon=True).start()
    started = time.time()
    rc = pytest.main(args)
    done.set()
    print(f"\n=== pytest rc {rc} in {time.time() - started:.1f} s; a sample every {INTERVAL_S} s")
    print("--- inclusive (top 45)")
    for entry, n in inclusive.most_common(45):
        print(f"{n * INTERVAL_S:7.1f} s  {entry}")
    print("--- leaf stacks (top 25)")
    for entry, n in leaves.most_common(25):
        print(f"{n * INTERVAL_S:7.1f} s  {entry}")
    return int(rc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
