"""What the engine probes (scripts/probe_*.py) record of one run: when each request ended, and one watched
request's output times (its step-to-step gaps)."""

from __future__ import annotations

import threading
import time


class RunTracker:
    """Counts `num_requests` down to zero as they finish; `stamps` holds the watched request's output times."""

    def __init__(self, num_requests: int, watched_suffix: str = "#0") -> None:
        self._left = num_requests
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._watched_suffix = watched_suffix
        self.stamps: list[float] = []

    def on_output(self, request_id: str, tokens: list[int], finish, error) -> None:
        """The engine's output callback."""
        if error:
            print("error", request_id, error, flush=True)
        if request_id.endswith(self._watched_suffix) and tokens:
            self.stamps.append(time.perf_counter())
        if finish is not None:
            self.end_one()

    def end_one(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self._done.set()

    def wait(self) -> None:
        self._done.wait()
