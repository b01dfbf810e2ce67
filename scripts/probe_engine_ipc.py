#!/usr/bin/env python3
"""What the engine process's message path costs per step (MSTAR_ENGINE_PROCESS=1, engine/engine_process.py).

    python scripts/probe_engine_ipc.py [--rows 1 8 64] [--steps 2000]

A child process plays the engine: per step it sends one `("out", outputs, None)` message of `rows` outputs (request
id, one token, no finish), as the engine's outbox does. This process plays the stub: its receiving thread unpickles
each message and calls an `on_output` that queues, as `RemoteEngine` does for the output pump. Printed per row count:
the child's time in `send` per step (pickling and writing), and the stub's time from a message's bytes to its last
callback (unpickling and queueing: the receiving thread's Python time, i.e. what it takes of the stub's GIL), both
as means over `--steps` steps.
"""

from __future__ import annotations

import argparse
import json
import pickle
import queue
import sys
import time
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _engine_side(conn, rows: int, steps: int) -> None:
    outputs = [(f"req-{i}#{i}", [1234 + i], None, None) for i in range(rows)]
    sent = 0.0
    for _ in range(steps):
        started = time.perf_counter()
        conn.send(("out", outputs, None))
        sent += time.perf_counter() - started
        time.sleep(0.0002)  # a step's worth of pause, so the reader keeps up as the stub does
    conn.send(("bye", sent / steps))
    conn.close()


def measure(rows: int, steps: int) -> dict:
    ctx = get_context("fork")  # the child only sends: no state of this process matters to it
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_engine_side, args=(theirs, rows, steps))
    child.start()
    theirs.close()
    pump: queue.SimpleQueue = queue.SimpleQueue()
    handled, count = 0.0, 0
    while True:
        raw = ours.recv_bytes()  # waiting for bytes holds no GIL; what follows does
        started = time.perf_counter()
        message = pickle.loads(raw)
        if message[0] == "bye":
            send_s = message[1]
            break
        for request_id, token_ids, finish, error in message[1]:
            pump.put((request_id, list(token_ids), finish, error))
        handled += time.perf_counter() - started
        count += 1
    child.join()
    return {"rows": rows, "steps": count, "send_us": round(send_s * 1e6, 1),
            "dispatch_us": round(handled / max(1, count) * 1e6, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    for rows in args.rows:
        print(json.dumps(measure(rows, args.steps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
