"""Kernel timing on a GPU as the engine runs kernels: inside a captured CUDA graph, so a microsecond kernel is
not timed as the host's launch cost (Triton's Python launcher alone takes tens of microseconds)."""

from __future__ import annotations

from collections.abc import Callable


def graph_time_us(fn: Callable[[], object], calls: int = 20, replays: int = 10) -> float:
    """Mean GPU time of one `fn()` (which must be capturable: fixed shapes, no host syncs), from `replays`
    replays of a graph holding `calls` back-to-back calls."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside capture: compiles, autotunes, allocates
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def event_time_ms(fn: Callable[[], object], repeats: int = 50, warmup: int = 5) -> float:
    """Median GPU time in ms of `fn()` called eagerly, each call bracketed by CUDA events (for calls long enough
    that the host's launch cost does not matter: a whole forward, a large GEMM)."""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)
