"""Attention for the diffusion transformers: SDPA over `[B, S, heads, D]`, with the backend order chosen on a GPU.

cuDNN's fused attention is tried first by default: on an H200 it took 60 ms of a 1024x1024 klein-4B forward where
FlashAttention-2 (torch's own pick) took 69 (docs/benchmarks.md). `MSTAR_DIT_ATTENTION` overrides the order.

The order is torch's process-wide SDPA priority, set once at the first GPU attention (`use_backend_order`). Set and
restored around each call (torch's `sdpa_kernel` context), it raced between the two threads a denoise process runs
attention on (Z-Image's caption refiner on Triton's thread, the eager steps on the denoise thread): one thread's exit
put the default order back under the other's call, and the last exit left its saved order set for good.

cuDNN builds a plan for each exact shape the first time a thread runs it (~0.4 s on the denoise thread, which every
batched request waits for) and keeps it in a thread-local cache nothing bounds; clients choose image sizes (16,384
FLUX.2 sizes pass the area rule). So a thread sends at most `CUDNN_EAGER_SHAPES` distinct uncaptured shapes to
cuDNN, and newer ones straight to FlashAttention, which builds nothing; captured steps (their shapes set at
start-up) keep cuDNN.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

_order_lock = threading.Lock()
_order_is_set = False

CUDNN_EAGER_SHAPES = 64  # distinct uncaptured attention shapes a thread may send to cuDNN (see the module's doc)
_cudnn_shapes = threading.local()


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`[B, S, heads, D]` in and out (flattened heads), SDPA (on a GPU, the backend `MSTAR_DIT_ATTENTION` names)."""
    query, key, value = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    if query.is_cuda:
        use_backend_order(query.device)
        if _flash_instead_of_cudnn(query, key, value):
            out = flash_attention(query, key, value)
            return out.permute(0, 2, 1, 3).flatten(2, 3).to(query.dtype)
    out = F.scaled_dot_product_attention(query, key, value)
    return out.permute(0, 2, 1, 3).flatten(2, 3).to(query.dtype)


def flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """FlashAttention-2 through torch's own op, `[B, heads, S, D]`: per call, without touching the process-wide
    backend order (whose per-call context raced between threads)."""
    return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value)[0]


@contextlib.contextmanager
def for_capture() -> Iterator[None]:
    """Calls on this thread inside are a graph's warm-ups and capture (`step_graphs.capture_graph`): they keep
    SDPA's order whatever the budget, so a captured step's cuDNN plan is built in its warm-up, not in the capture."""
    _cudnn_shapes.capture = getattr(_cudnn_shapes, "capture", 0) + 1
    try:
        yield
    finally:
        _cudnn_shapes.capture -= 1


def _flash_instead_of_cudnn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether this call should skip cuDNN: cuDNN is first in the order, the call is no capture (nor its warm-up),
    flash can run it, and it is a shape new to this thread after `CUDNN_EAGER_SHAPES` others."""
    if getattr(_cudnn_shapes, "capture", 0) or torch.cuda.is_current_stream_capturing() \
            or not flash_can_run(query, key, value):
        return False
    from torch.nn.attention import SDPBackend

    return torch._C._get_sdp_priority_order()[0] == int(SDPBackend.CUDNN_ATTENTION) and not cudnn_may_plan(query, key)


def flash_can_run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether FlashAttention can take the call instead (half precision, one dtype, head dims up to 256 in
    multiples of 8); where it cannot, SDPA's order stands."""
    dim = query.shape[-1]
    return (query.dtype in (torch.float16, torch.bfloat16) and key.dtype == value.dtype == query.dtype
            and dim == value.shape[-1] and dim <= 256 and dim % 8 == 0)


def cudnn_may_plan(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether this thread may send this shape to cuDNN: one it sent before, or a new one while it has sent fewer
    than `CUDNN_EAGER_SHAPES` (recorded here)."""
    seen = getattr(_cudnn_shapes, "seen", None)
    if seen is None:
        seen = _cudnn_shapes.seen = set()
    shape = (tuple(query.shape), tuple(key.shape), query.dtype, query.device)
    if shape in seen:
        return True
    if len(seen) >= CUDNN_EAGER_SHAPES:
        return False
    seen.add(shape)
    return True


def use_backend_order(device: torch.device | None = None) -> None:
    """Make `sdpa_backends()` torch's SDPA priority order for this process, once (cuDNN, flash, efficient and math
    stay enabled; torch's `overrideable` slot, which no CUDA build fills, is left off). On `device`, one tiny SDPA
    call first: torch sets its own default order at the first CUDA call, over any set before it on builds that
    prefer cuDNN."""
    global _order_is_set
    if _order_is_set:
        return
    with _order_lock:
        if not _order_is_set:
            backends = sdpa_backends()
            if backends:
                from torch.nn.attention import _sdpa_kernel  # what `sdpa_kernel` sets on entry, without the restore

                if device is not None and device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
                    probe = torch.zeros(1, 1, 1, 64, device=device, dtype=torch.bfloat16)
                    F.scaled_dot_product_attention(probe, probe, probe)
                _sdpa_kernel(backends, True)
            _order_is_set = True


_ATTENTION_CHOICES = ("auto", "cudnn", "flash", "efficient")


def sdpa_backends() -> list | None:
    """The SDPA backends to try, in order, on a GPU: `MSTAR_DIT_ATTENTION` first (default `cudnn`), then flash,
    efficient and math for what it cannot run; None for `auto` (torch's own choice)."""
    choice = os.environ.get("MSTAR_DIT_ATTENTION", "cudnn") or "cudnn"
    if choice not in _ATTENTION_CHOICES:
        raise ValueError(f"MSTAR_DIT_ATTENTION={choice!r}: expected one of {', '.join(_ATTENTION_CHOICES)}")
    if choice == "auto":
        return None
    from torch.nn.attention import SDPBackend

    first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}[choice]
    rest = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return [first] + [b for b in rest if b != first]
