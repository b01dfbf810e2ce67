"""Captured CUDA graphs of one denoise step (transformer forward + Euler update), one per (layout, batch) bucket.

A bucket owns static input buffers (latents, prompt embeddings, reference tokens, timesteps, step sizes) in one
named dict and the output the captured graph writes. A step of `b` rows picks the smallest captured batch
`B >= b` of its layout, copies its rows into the first `b` slots (the other slots keep stale, finite data:
rows never mix, so they cannot leak into real rows), replays, and returns a copy of the first `b` rows.
Buckets are captured largest first and share one memory pool. Layouts or batches without a bucket run eager.

`capture=False` builds the same buckets with an eager "replay" over the static buffers, which lets the CPU
tests check the bucket plumbing against the eager path.

Padding is not free: at 1024x1024 a step costs about the same per row at any batch (klein-4B, H200, captured
with dit_fp8: 41.3 ms at batch 1, 342 ms at 8, 666 ms at 16), so 9 rows replayed in a batch-16 graph waste 7/16
of it (served at c=16: 3.80 img/s padded, 4.30 exact; docs/benchmarks.md). Each captured bucket's
replay is timed once at capture (`costs`), and `rows_to_run` tells the engine how many of the rows waiting to
step to take this time: all of them (padded to the bucket above), or only as many as the bucket below holds,
whichever steps more rows per second. The rows left out go first on the next step. `MSTAR_DENOISE_EXACT_BATCHES=0`
skips the timing, and every step pads as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from mstar_common.bench.gpu_timing import event_time_ms
from mstar_common.config import env_switch
from mstar_common.engine.capture_policy import capture_or_skip

logger = logging.getLogger(__name__)

StepFn = Callable[..., torch.Tensor]  # step_fn(latents, prompt_embeds, ref_tokens, timesteps, dts) -> latents


def capture_graph(fn: Callable[[], torch.Tensor], pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`fn()` (over static buffers) warmed up twice on a side stream, then captured into `pool`: (graph, the
    output tensor each replay rewrites). The DiT attention keeps cuDNN throughout, past its eager shape budget."""
    from mstar_common.diffusion.attention import for_capture

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with for_capture():
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up allocator and kernels off the capture
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    return graph, out


def exact_batches() -> bool:
    """`MSTAR_DENOISE_EXACT_BATCHES` (default 1): time the buckets so that steps may take a smaller one exactly."""
    return env_switch("MSTAR_DENOISE_EXACT_BATCHES", True)


@dataclass(frozen=True, slots=True)
class StepShapes:
    """Per-row shapes of one layout's step inputs."""

    num_tokens: int  # output image tokens
    channels: int  # latent token channels
    num_text: int  # text tokens
    text_dim: int  # prompt-embedding width
    num_ref_tokens: int = 0


class _Bucket:
    def __init__(self, step_fn: StepFn, shapes: StepShapes, batch: int, dtype: torch.dtype, device: torch.device,
                 capture: bool, pool) -> None:
        self.batch = batch
        zeros = lambda *shape, dt=dtype: torch.zeros(*shape, dtype=dt, device=device)  # noqa: E731
        self.static = {
            "latents": zeros(batch, shapes.num_tokens, shapes.channels),
            "prompt_embeds": zeros(batch, shapes.num_text, shapes.text_dim),
            "ref_tokens": zeros(batch, shapes.num_ref_tokens, shapes.channels) if shapes.num_ref_tokens else None,
            "timesteps": torch.full((batch,), 1000.0, dtype=torch.float32, device=device),
            "dts": torch.zeros(batch, dtype=torch.float32, device=device),
        }
        self._step_fn = step_fn
        self._graph, self.out = capture_graph(lambda: step_fn(**self.static), pool) if capture else (None, None)

    def time_replay(self) -> float:
        """Seconds one replay takes on the GPU (after one warm-up replay, between CUDA events)."""
        return event_time_ms(self._graph.replay, repeats=1, warmup=1) / 1e3

    def run(self, latents: torch.Tensor, prompt_embeds: torch.Tensor, ref_tokens: torch.Tensor | None,
            timesteps: torch.Tensor, dts: torch.Tensor) -> torch.Tensor:
        rows = latents.shape[0]
        for name, value in (("latents", latents), ("prompt_embeds", prompt_embeds), ("ref_tokens", ref_tokens),
                            ("timesteps", timesteps), ("dts", dts)):
            if value is not None:
                self.static[name][:rows].copy_(value)
        if self._graph is not None:
            self._graph.replay()
            return self.out[:rows].clone()
        return self._step_fn(**self.static)[:rows].clone()


class StepGraphs:
    """Buckets keyed by layout; `run` returns None when no bucket fits (the caller then runs eager)."""

    def __init__(self) -> None:
        self._buckets: dict[Hashable, list[_Bucket]] = {}
        self.costs: dict[Hashable, dict[int, float]] = {}  # layout -> batch -> seconds per replay (captured only)
        self.num_replays = 0

    def capture(self, step_fns: dict[Hashable, tuple[StepFn, StepShapes]], batches: list[int], *,
                dtype: torch.dtype, device: torch.device, capture: bool = True) -> None:
        """Build a bucket per layout × batch size, largest batches first, sharing one graph memory pool. A bucket
        that runs out of GPU memory is dropped (a larger one, or eager, takes its steps; capture_policy.py)."""
        pool = torch.cuda.graph_pool_handle() if capture else None
        for layout, (step_fn, shapes) in step_fns.items():
            buckets = [capture_or_skip(f"[cuda graphs] denoise step {layout} batch {batch}",
                                       lambda batch=batch, step_fn=step_fn, shapes=shapes: _Bucket(
                                           step_fn, shapes, batch, dtype, device, capture, pool))
                       for batch in sorted(set(batches), reverse=True)]
            self._buckets[layout] = sorted((b for b in buckets if b is not None), key=lambda b: b.batch)
            logger.info("denoise step %s for layout %s, batch sizes %s", "captured" if capture else "bucketed",
                        layout, [b.batch for b in self._buckets[layout]])
            if capture and exact_batches():
                self.costs[layout] = {b.batch: b.time_replay() for b in self._buckets[layout]}
                logger.info("denoise step replay ms for layout %s: %s", layout,
                            {batch: round(t * 1e3, 1) for batch, t in self.costs[layout].items()})

    def rows_to_run(self, layout: Hashable, rows: int) -> int:
        """How many of `rows` waiting rows of `layout` to step now: `rows` (padded to the smallest bucket above),
        or the largest bucket below if that steps more rows per second of measured replay time. `rows` where
        nothing was timed, or no bucket is above (that step runs eager)."""
        costs = self.costs.get(layout)
        above = min((b for b in costs or () if b >= rows), default=None)
        below = max((b for b in costs or () if b < rows), default=None)
        if above is None or below is None or above == rows:
            return rows
        return below if below / costs[below] > rows / costs[above] else rows

    def bucket_for(self, layout: Hashable, rows: int) -> _Bucket | None:
        return next((b for b in self._buckets.get(layout, ()) if b.batch >= rows), None)

    def run(self, layout: Hashable, latents: torch.Tensor, prompt_embeds: torch.Tensor,
            ref_tokens: torch.Tensor | None, timesteps: torch.Tensor, dts: torch.Tensor) -> torch.Tensor | None:
        bucket = self.bucket_for(layout, latents.shape[0])
        if bucket is None:
            return None
        self.num_replays += 1
        return bucket.run(latents, prompt_embeds, ref_tokens, timesteps, dts)

    @property
    def layouts(self) -> list[Hashable]:
        return list(self._buckets)
