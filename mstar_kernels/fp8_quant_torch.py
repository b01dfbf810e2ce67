"""Rows to float8 e4m3 with one scale per row, in eager torch: the reference of mstar_kernels/fp8_quant.py and the
path without Triton (importable without it)."""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # e4m3fn's largest finite value
MIN_SCALE = 1e-12  # an all-zero row gets this scale (its codes are zeros either way)


def quantize_rows_fp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in eager torch ops (the reference, and the path without Triton)."""
    wide = x.float()
    scale = (wide.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return (wide / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
