"""The SNAC component's runtime: a batch of 28-token windows in, each window's played frame out.

Windows `[N, 4, 7]` (codes per frame, positions 0..6) are split into the three SNAC levels as the reference
does (level 0: position 0; level 1: positions 1, 4; level 2: positions 2, 3, 5, 6, frame by frame), decoded
together, and only the window's second frame (`samples_per_frame` samples from `LOOKBACK_FRAMES`) is
computed: the reference decodes all four frames and cuts; `SnacDecoder.decode_range` gives the same samples
from the stages' receptive fields. On a GPU the Snake activations run fused (mstar_kernels/snake.py).

On a GPU the decode of each batch bucket (1, 2, 4, 8, 16, ... up to `max_batch`) is a captured CUDA graph:
a batch is padded up to its bucket (padding rows decode code 0 and are discarded). Buckets are captured
largest first and share one memory pool.

On a GPU the codec runs on its own CUDA stream and waits only for that stream. Inside the LM component
(`codec_in_process`), the pump thread's decodes then run beside the engine's steps instead of queueing behind
them on the default stream: a `.cpu()` there would wait for the LM's queued step, and the LM's token read
would wait for the codec.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from mstar_common.config import env_switch
from mstar_common.engine.capture_policy import capture_or_skip
from mstar_common.families.orpheus.codes import LOOKBACK_FRAMES, WINDOW_FRAMES
from mstar_common.families.orpheus.snac import SnacDecoder
from mstar_common.families.orpheus.tokens import CODEBOOK_SIZE, CODES_PER_FRAME

logger = logging.getLogger(__name__)

LEVEL_POSITIONS = ((0,), (1, 4), (2, 3, 5, 6))  # frame positions feeding SNAC levels 0, 1, 2


def window_codes(windows: torch.Tensor) -> list[torch.Tensor]:
    """`[N, F, 7]` frames -> SNAC codes per level `[N, F]`, `[N, 2F]`, `[N, 4F]` (int64)."""
    windows = windows.long()
    # Stacked slices, not list indexing: a list index is a host tensor, which CUDA-graph capture refuses.
    return [torch.stack([windows[:, :, p] for p in pos], dim=-1).reshape(windows.shape[0], -1)
            for pos in LEVEL_POSITIONS]


def graph_buckets(max_batch: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(buckets) | {max_batch})


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    windows: torch.Tensor  # static input [bucket, 4, 7] int32
    audio: torch.Tensor  # static output [bucket, samples_per_frame]


@dataclass
class SnacCodec:
    """The codec contract of `backends/codec_node.py`: `decode(np [N,4,7] int32) -> np [N, S] fp32`, `check`."""

    decoder: SnacDecoder
    device: torch.device
    max_batch: int = 64  # windows per decoder run (larger batches run in slices)
    use_cuda_graphs: bool = False
    graphs: dict[int, _Graph] = field(default_factory=dict)
    stream: torch.cuda.Stream | None = None  # the codec's own stream on a GPU (see the module doc)

    def __post_init__(self) -> None:
        self.samples_per_frame = self.decoder.samples_per_code * 4  # 4 finest codes per frame
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            # mstar_kernels/snake.py: the Snake activations in one pass each (MSTAR_SNAC_RESIDUAL_KERNEL=1: the fused
            # residual head too, for measuring; it lost to cuDNN on the H200, docs/benchmarks.md)
            # MSTAR_SNAC_CUDNN_DEPTHWISE=1: fp32 depthwise convs through cuDNN (PyTorch's own kernel otherwise).
            # Alone on the H200: 18,791 against 17,177 windows/s at batch 128; beside the LM at c=256 it served
            # fewer audio-s/s (242 against 250-253, docs/benchmarks.md), so it is off.
            fp32 = next(self.decoder.parameters()).dtype == torch.float32
            self.decoder.use_fused_kernels(
                residual=env_switch("MSTAR_SNAC_RESIDUAL_KERNEL", False),
                cudnn_depthwise=fp32 and env_switch("MSTAR_SNAC_CUDNN_DEPTHWISE", False))
        if self.use_cuda_graphs:
            self.capture()

    @property
    def sample_rate(self) -> int:
        return self.decoder.sampling_rate

    def check(self, windows: np.ndarray) -> None:
        check_windows(windows)

    def decode(self, windows: np.ndarray) -> np.ndarray:
        check_windows(windows)
        on_gpu = self.stream is not None
        parts = []
        with torch.cuda.stream(self.stream) if on_gpu else contextlib.nullcontext():
            for start in range(0, windows.shape[0], self.max_batch):
                part = torch.from_numpy(np.ascontiguousarray(windows[start:start + self.max_batch]))
                # to the host in stream order (a graph's output buffer is reused by the next run); pinned on a GPU
                parts.append(self._run(part).float().to("cpu", non_blocking=on_gpu))
        if on_gpu:
            self.stream.synchronize()
        if not parts:
            return np.empty((0, self.samples_per_frame), dtype=np.float32)
        return torch.cat(parts).numpy() if len(parts) > 1 else parts[0].numpy()

    @torch.inference_mode()
    def _run(self, windows: torch.Tensor) -> torch.Tensor:
        num = windows.shape[0]
        bucket = next((b for b in sorted(self.graphs) if b >= num), None)
        if bucket is None:  # eager
            return self.played_frames(windows.to(self.device))
        graph = self.graphs[bucket]
        graph.windows[:num].copy_(windows, non_blocking=True)
        graph.windows[num:].zero_()
        graph.graph.replay()
        return graph.audio[:num]

    def played_frames(self, windows: torch.Tensor) -> torch.Tensor:
        """`[N, 4, 7]` windows on the device -> `[N, samples_per_frame]`: each window's second frame.

        Only the samples that frame depends on are computed (`SnacDecoder.decode_range`), not the window's
        four frames: the same values as decoding the window and cutting, for about half the work.
        """
        start = LOOKBACK_FRAMES * self.samples_per_frame
        return self.decoder.decode_range(window_codes(windows), start, start + self.samples_per_frame)[:, 0]

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket, largest first, sharing one memory pool."""
        pool = None
        for bucket in sorted(graph_buckets(self.max_batch), reverse=True):
            captured = capture_or_skip(f"[orpheus/snac] batch {bucket}",
                                       lambda bucket=bucket, pool=pool: self._capture_bucket(bucket, pool))
            if captured is not None:  # else out of GPU memory: a larger bucket, or eager, takes these batches
                self.graphs[bucket] = captured
                pool = captured.graph.pool()
        logger.info("[orpheus/snac] captured CUDA graphs for batch buckets %s", sorted(self.graphs))

    def _capture_bucket(self, bucket: int, pool) -> _Graph:
        windows = torch.zeros((bucket, WINDOW_FRAMES, CODES_PER_FRAME), dtype=torch.int32, device=self.device)
        for _ in range(2):  # warm up (cuDNN algorithm choice, allocator) outside the graph
            self.played_frames(windows)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()  # captured on torch's side stream; replayed on `self.stream`
        with torch.cuda.graph(graph, pool=pool):
            audio = self.played_frames(windows)
        return _Graph(graph, windows, audio)


def check_windows(windows: np.ndarray) -> None:
    """Refuse what the decoder must never see (a caller bug, not a client error: the LM node builds windows)."""
    if windows.ndim != 3 or windows.shape[1:] != (WINDOW_FRAMES, CODES_PER_FRAME):
        raise ValueError(f"codes: expected [N, {WINDOW_FRAMES}, {CODES_PER_FRAME}] windows, got {windows.shape}")
    if windows.size and (windows.min() < 0 or windows.max() >= CODEBOOK_SIZE):
        raise ValueError(f"codes: SNAC codes must be in [0, {CODEBOOK_SIZE}), got [{windows.min()}, {windows.max()}]")
