"""Shared BLS settings for the nodes that call other components."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils


def cpu_output_memory() -> dict:
    """`InferenceRequest` keyword asking for BLS outputs in host memory, where this Python backend has the knob.

    Every caller reads outputs with `as_numpy()`: asking for CPU memory keeps GPU buffers (CUDA IPC between
    stubs) out of the hop whatever instance kinds the two components have.
    """
    if hasattr(pb_utils, "PreferredMemory"):
        return {"preferred_memory": pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)}
    return {}
