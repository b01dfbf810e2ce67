"""The instance's GPU as each thread's current CUDA device.

Tensors placed with an explicit `cuda:N` go to GPU N, but much of the GPU work uses the calling thread's *current*
device instead: Triton-language kernels launch on it, `torch.cuda.Stream()` and `torch.cuda.graph`'s capture stream
are made on it, `torch.cuda.synchronize()` and `Event.record()` without a device or stream act on it, and
FlashInfer sizes its buffers for it. CUDA keeps the current device per host thread and a new thread starts on
device 0, and Triton's Python backend does not set it for an instance on another GPU. So an instance placed on
`gpus: [1]` sets it in the stub's thread before it builds anything (`backends/node_setup.py`), and every thread
that runs GPU work starts with `on_device(target)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def use_device(device: torch.device | str) -> None:
    """Make `device` (a `cuda:N`) the calling thread's current CUDA device; the CPU, or `cuda` without an index,
    leaves it as it is."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def current_device() -> torch.device | None:
    """The calling thread's current CUDA device, or None where this process has not started CUDA (a CPU component
    must not open a CUDA context on GPU 0 just by asking)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.device("cuda", torch.cuda.current_device())


def on_device(target: Callable[..., Any], device: torch.device | str | None = None) -> Callable[..., Any]:
    """`target`, made to run with `device` as its thread's current device: a thread's target. Without `device`,
    the caller's current device (where it has one), which `use_device` set for the instance's threads at load."""
    device = current_device() if device is None else torch.device(device)
    if device is None or device.type != "cuda":
        return target

    def run(*args: Any, **kwargs: Any) -> Any:
        use_device(device)
        return target(*args, **kwargs)

    return run
