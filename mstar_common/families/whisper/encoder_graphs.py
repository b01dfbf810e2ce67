"""Captured CUDA graphs of the encoder component's forward (front end + encoder), one per batch bucket.

Every window has the same shape (30 s of PCM -> `[1500, d_model]`), so a batch of `b` windows picks the
smallest captured bucket `B >= b`, copies its rows into the bucket's static input, replays and returns a copy
of the first `b` output rows (stale rows never mix with real ones: every op is per row). Buckets are captured
largest first and share one memory pool; a batch larger than every bucket runs eager.

`capture=False` builds the same buckets with an eager "replay" over the static buffers, so the CPU tests check
the bucket plumbing against the plain path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from mstar_common.engine.capture_policy import capture_or_skip

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def buckets_up_to(max_batch: int) -> list[int]:
    sizes = [b for b in DEFAULT_BUCKETS if b < max_batch]
    return sorted({*sizes, max_batch})


class _Bucket:
    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], batch: int, sample_shape: tuple[int, ...],
                 device: torch.device, capture: bool, pool) -> None:
        self.batch = batch
        self.static = {"pcm": torch.zeros(batch, *sample_shape, dtype=torch.float32, device=device)}
        self._forward = forward
        self._graph: torch.cuda.CUDAGraph | None = None
        self.out = self._capture(pool) if capture else None

    def _capture(self, pool) -> torch.Tensor:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up the allocator and kernels off the capture
                self._forward(self.static["pcm"])
        torch.cuda.current_stream().wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, pool=pool):
            out = self._forward(self.static["pcm"])
        return out

    def run(self, pcm: torch.Tensor) -> torch.Tensor:
        rows = pcm.shape[0]
        self.static["pcm"][:rows].copy_(pcm)
        if self._graph is not None:
            self._graph.replay()
            return self.out[:rows].clone()
        return self._forward(self.static["pcm"])[:rows].clone()


class EncoderGraphs:
    """`run(pcm [b, samples])` through the smallest bucket that fits, or None (the caller runs eager)."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], sample_shape: tuple[int, ...],
                 batches: list[int], device: torch.device | str, capture: bool = True) -> None:
        device = torch.device(device)
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        pool = torch.cuda.graph_pool_handle() if capture else None
        self._buckets: dict[int, _Bucket] = {}
        self.num_replays = 0  # batches run through a bucket (the component's mstar_graph_steps_total)
        with torch.inference_mode():
            for batch in sorted(set(batches), reverse=True):  # largest first: the pool then fits the smaller
                bucket = capture_or_skip(f"[whisper/encoder] batch {batch}",
                                         lambda batch=batch: _Bucket(forward, batch, sample_shape, device, capture,
                                                                     pool))
                if bucket is not None:  # else out of GPU memory: a larger bucket or eager takes these batches
                    self._buckets[batch] = bucket
        if capture:
            logger.info("[whisper/encoder] captured CUDA graphs for batches %s", sorted(self._buckets))

    @property
    def batches(self) -> list[int]:
        return sorted(self._buckets)

    def run(self, pcm: torch.Tensor) -> torch.Tensor | None:
        fits = [b for b in self._buckets if b >= pcm.shape[0]]
        if not fits:
            return None
        self.num_replays += 1
        with torch.inference_mode():
            return self._buckets[min(fits)].run(pcm)
