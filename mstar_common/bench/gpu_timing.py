"""Kernel timing on a GPU as the engine runs kernels: inside a captured CUDA graph, so a microsecond kernel is
not timed as the host's launch cost (Triton's Python launcher alone takes tens of microseconds)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def graph_time_us(fn: Callable[[], object] | Sequence[Callable[[], object]], calls: int = 20,
                  replays: int = 10) -> float:
    """Mean GPU time of one call, from `replays` replays of a graph holding `calls` back-to-back calls. `fn` must
    be capturable (fixed shapes, no host syncs); a list of callables is called in turn (see `cold_copies`: the
    same kernel on different weights, so that no call finds its weights in L2 from the call before)."""
    import torch

    fns = list(fn) if isinstance(fn, Sequence) else [fn]
    calls = max(calls, len(fns))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside capture: compiles, autotunes, allocates
            for one in fns:
                one()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in range(calls):
            fns[call % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


COLD_BYTES = 256 << 20  # several times an H100/H200's 50 MB L2
MAX_COLD_COPIES = 128  # fewer than COLD_BYTES needs for a weight under 2 MiB (see cold_copies)


def cold_copies(tensor, min_bytes: int = COLD_BYTES, max_copies: int = MAX_COLD_COPIES) -> list:
    """`tensor` and enough copies of it to hold `min_bytes` together, at most `max_copies` in all: a decode step
    streams each layer's weights from HBM once, and a kernel timed back to back on one small weight would read it
    from L2 instead (an 18 MB projection fits an H200's L2 whole).

    The cap: a weight so small that `max_copies` of it fit in L2 belongs to a model whose whole step reads its
    weights from L2 too, so timing it warm is what its steps see; and `graph_time_us` captures one call per copy,
    so the bytes alone would ask for thousands of launches per timing (8,192 for a 32 KiB fp32 projection of the
    tiny Whisper checkpoint, whose decoder's GEMV tuning took ~156 s of its GPU test's 172 s on an H100 without the
    cap; the whole test took 25 s with it, 2026-12-06)."""
    import torch

    count = max(1, min(max_copies, -(-min_bytes // (tensor.numel() * tensor.element_size()))))
    copies = [tensor]
    for _ in range(count - 1):
        try:
            copies.append(tensor.clone())
        except torch.cuda.OutOfMemoryError:  # a full GPU: time on fewer copies (partly warm) rather than fail
            break
    return copies


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


def profiled(fn: Callable[[], object], calls: int, warmup: int = 3):
    """torch's CUDA profiler over `calls` back-to-back calls of `fn`, after `warmup` calls; returns the profile."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof

