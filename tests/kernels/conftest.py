"""Kernel tests: each kernel against its torch reference over a sweep of shapes.

They run on a CUDA GPU (marker `gpu`). With `TRITON_INTERPRET=1` they also run on the CPU through Triton's
interpreter, on the smaller sweep (`SWEEP`), which is how the kernels are checked on a machine with no GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

IS_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if IS_INTERPRETED else "cuda"
GPU_ONLY = [] if IS_INTERPRETED else [pytest.mark.gpu]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def sweep(full: list, small: list) -> list:
    return small if IS_INTERPRETED else full
