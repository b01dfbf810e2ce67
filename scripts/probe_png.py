#!/usr/bin/env python
"""Where a 1024x1024 PNG's encode time goes on this machine: the figures behind mstar_common/diffusion/png.py.

    python scripts/probe_png.py [--json out.json]

Per content (noise-like, as random-weight models produce, and smooth): the Paeth filter as numpy over 64-row
strips (one thread, then the thread pool) and as torch ops over the whole image (1 thread and torch's default);
the deflate of the filtered strips with zlib and ISA-L at each level (ms on one thread, bytes); the whole
`encode_png`; and whether ISA-L's compressor lets another thread run (two threads against one: zlib releases the
GIL while it compresses, python-isal does not). Timings are the median of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mstar_common.diffusion import png  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 2)


def contents(size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size]
    smooth = np.stack([128 + 100 * np.sin(x / 50) * np.cos(y / 70), 128 + 80 * np.sin((x + y) / 90),
                       128 + 60 * np.cos(x / 30)], -1) + rng.normal(0, 6, (size, size, 3))
    return {"noise": rng.integers(0, 256, (size, size, 3), dtype=np.uint8),
            "smooth": np.clip(smooth, 0, 255).astype(np.uint8)}


def strip_filter(rows: np.ndarray) -> list[np.ndarray]:
    return [png.paeth_filter_strip(rows[s:s + png.STRIP_ROWS], rows[s - 1] if s else None, 3)
            for s in range(0, rows.shape[0], png.STRIP_ROWS)]


def deflate_ms_bytes(strips: list[np.ndarray], lib, level: int, repeats: int) -> tuple[float, int]:
    def run() -> int:
        total = 0
        for i, strip in enumerate(strips):
            extra = {"zdict": strips[i - 1][-png._WINDOW:].tobytes()} if i else {}
            compressor = lib.compressobj(level, lib.DEFLATED, -15, 9, lib.Z_DEFAULT_STRATEGY, **extra)
            total += len(compressor.compress(strip.tobytes()) + compressor.flush(lib.Z_SYNC_FLUSH))
        return total

    return median_ms(run, repeats), run()


def parallel_speedup(lib, data: bytes) -> float:
    """One thread's time for two compressions over two threads' time for the same two."""
    def work():
        compressor = lib.compressobj(2 if lib is not zlib else 6, lib.DEFLATED, -15)
        compressor.compress(data)
        compressor.flush()

    start = time.perf_counter()
    work()
    work()
    serial = time.perf_counter() - start
    threads = [threading.Thread(target=work) for _ in range(2)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return round(serial / (time.perf_counter() - start), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "deflate": png.DEFLATE,
              "size": args.size}
    for name, image in contents(args.size).items():
        rows = image.reshape(args.size, -1)
        strips = strip_filter(rows)
        row = {
            "paeth_numpy_strips_1_thread_ms": median_ms(lambda rows=rows: strip_filter(rows), args.repeats),
            "paeth_numpy_strips_pool_ms": median_ms(lambda rows=rows: png._map(
                lambda s: png.paeth_filter_strip(rows[s:s + png.STRIP_ROWS], rows[s - 1] if s else None, 3),
                range(0, args.size, png.STRIP_ROWS)), args.repeats),
            "paeth_torch_default_threads_ms": median_ms(
                lambda rows=rows: png.paeth_filter(torch.from_numpy(rows), 3), args.repeats),
            "encode_png_ms": median_ms(lambda image=image: png.encode_png(image), args.repeats),
            "encode_png_bytes": len(png.encode_png(image)),
        }
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        row["paeth_torch_1_thread_ms"] = median_ms(lambda rows=rows: png.paeth_filter(torch.from_numpy(rows), 3),
                                                   args.repeats)
        torch.set_num_threads(threads)
        for level in (1, 6, 9):
            row[f"zlib_{level}_ms"], row[f"zlib_{level}_bytes"] = deflate_ms_bytes(strips, zlib, level, args.repeats)
        if png.isal_zlib is not None:
            for level in (1, 2, 3):
                row[f"isal_{level}_ms"], row[f"isal_{level}_bytes"] = deflate_ms_bytes(strips, png.isal_zlib, level,
                                                                                       args.repeats)
        report[name] = row
        print(name, row, flush=True)
    data = contents(args.size)["noise"].tobytes() * 2
    report["two_thread_speedup"] = {"zlib": parallel_speedup(zlib, data)}
    if png.isal_zlib is not None:
        report["two_thread_speedup"]["isal"] = parallel_speedup(png.isal_zlib, data)
    print("two threads against one:", report["two_thread_speedup"], flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
