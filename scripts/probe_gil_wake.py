"""How late a thread gets the GIL back after a GIL-free wait, while another thread runs Python.

The step loop of a component waits on each GPU step with the GIL released, then needs it back at once to
launch the next step; the output pump and Triton's `execute` run Python beside it. This probe stands in for
both: the main thread sleeps `--wait-ms` (the step) in a loop and records how much later than asked it ran
again; a second thread runs pure Python for `busy` ms, then sleeps `idle` ms. Run per switch interval:

    python scripts/probe_gil_wake.py [--intervals-ms 5 1 0.5 0.2] [--duty 1:0 5:6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time


def measure(interval_s: float, busy_ms: float, idle_ms: float, seconds: float, wait_ms: float) -> dict:
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    stop = threading.Event()

    def hog() -> None:
        while not stop.is_set():
            end = time.perf_counter() + busy_ms / 1e3
            x = 0
            while time.perf_counter() < end:
                for i in range(50):
                    x += i
            if idle_ms:
                time.sleep(idle_ms / 1e3)

    thread = threading.Thread(target=hog, daemon=True)
    thread.start()
    late = []
    deadline = time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            time.sleep(wait_ms / 1e3)
            late.append((time.perf_counter() - start) * 1e3 - wait_ms)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(before)
    late.sort()
    return {"interval_ms": interval_s * 1e3, "busy_ms": busy_ms, "idle_ms": idle_ms, "waits": len(late),
            **{f"late_p{q}_ms": round(late[min(len(late) - 1, int(len(late) * q / 100))], 3) for q in (50, 90, 99)}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--intervals-ms", type=float, nargs="+", default=[5.0, 1.0, 0.5, 0.2])
    p.add_argument("--duty", nargs="+", default=["1:0", "5:6"],
                   help="the other thread's BUSY:IDLE milliseconds (1:0 is always busy)")
    p.add_argument("--wait-ms", type=float, default=2.4, help="the GIL-free wait (a 64-row Qwen3 step: ~2.4 ms)")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    rows = []
    for duty in args.duty:
        busy, idle = (float(v) for v in duty.split(":"))
        for interval in args.intervals_ms:
            row = measure(interval / 1e3, busy, idle, args.seconds, args.wait_ms)
            rows.append(row)
            print(f"other thread {busy:g} ms busy / {idle:g} ms idle, switch interval {interval:g} ms: back "
                  f"{row['late_p50_ms']:.2f} / {row['late_p90_ms']:.2f} / {row['late_p99_ms']:.2f} ms late "
                  f"(p50 / p90 / p99 of {row['waits']} waits)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wait_ms": args.wait_ms, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
