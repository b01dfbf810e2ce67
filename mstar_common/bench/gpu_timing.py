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
