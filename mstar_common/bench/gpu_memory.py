"""GPU memory around a served run (spec/ENGINE.md §14.2 "cold start": memory after start-up and at peak).

Read with `nvidia-smi`, which needs no CUDA context in the benchmark's own process (a context holds memory of its own on
the GPU it measures) and counts every process on the GPU: the server's stubs, their CUDA graphs' pools, the KV
pools. `mstar bench serve` records the memory used before the server starts, once it is ready and the peak of a
background sample every `SAMPLE_S` through the sweep (the pools and graphs are allocated at start-up, so the peak
moves little and a sparse sample keeps the driver queries away from the measured run); the report prints them. Where
`nvidia-smi` is missing or fails (the CPU) every reading is None and the report leaves the line out.
"""

from __future__ import annotations

import shutil
import subprocess
import threading

SAMPLE_S = 2.0  # seconds between two readings during a sweep


def used_mib() -> int | None:
    """MiB in use over every GPU `nvidia-smi` lists, or None where it cannot be read."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    try:
        out = subprocess.run([binary, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return sum(int(line.strip()) for line in out.splitlines() if line.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class PeakSampler:
    """The most memory in use seen by a sample every `interval_s` (default `SAMPLE_S`), from `start()` until `stop()`
    (which returns it, or None if no sample could be read)."""

    def __init__(self, interval_s: float | None = None, read=used_mib) -> None:
        self.interval_s, self._read = SAMPLE_S if interval_s is None else interval_s, read
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-memory", daemon=True)

    def start(self) -> PeakSampler:
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> int | None:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peak

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        value = self._read()
        if value is not None and (self.peak is None or value > self.peak):
            self.peak = value


def report_line(memory: dict | None) -> str | None:
    """The report's sentence for `memory` (`before_start`, `after_start`, `peak`, MiB), or None when nothing was
    read."""
    if not memory or memory.get("after_start") is None:
        return None
    parts = [f"{memory['after_start']:,} MiB once ready"]
    if memory.get("before_start") is not None:
        parts.append(f"{memory['after_start'] - memory['before_start']:,} MiB of it taken by the server's start")
    if memory.get("peak") is not None:
        parts.append(f"{memory['peak']:,} MiB at the sweep's peak")
    return "GPU memory in use (nvidia-smi, every process on the GPU): " + "; ".join(parts) + "."
