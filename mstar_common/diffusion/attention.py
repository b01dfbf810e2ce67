"""Attention for the diffusion transformers: SDPA over `[B, S, heads, D]`, with the backend order chosen on a GPU.

cuDNN's fused attention is tried first by default: on an H200 it took 60 ms of a 1024x1024 klein-4B forward where
FlashAttention-2 (torch's own pick) took 69 (docs/benchmarks.md). `MSTAR_DIT_ATTENTION` overrides the order.

The order is torch's process-wide SDPA priority, set once at the first GPU attention (`use_backend_order`). Set and
restored around each call (torch's `sdpa_kernel` context), it raced between the two threads a denoise process runs
attention on (Z-Image's caption refiner on Triton's thread, the eager steps on the denoise thread): one thread's exit
put the default order back under the other's call, and the last exit left its saved order set for good.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F

_order_lock = threading.Lock()
_order_is_set = False


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`[B, S, heads, D]` in and out (flattened heads), SDPA (on a GPU, the backend `MSTAR_DIT_ATTENTION` names)."""
    query, key, value = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    if query.is_cuda:
        use_backend_order(query.device)
    out = F.scaled_dot_product_attention(query, key, value)
    return out.permute(0, 2, 1, 3).flatten(2, 3).to(query.dtype)


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
