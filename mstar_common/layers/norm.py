"""RMSNorm with the reference numerics: normalise in fp32, cast back, then scale by the weight.

`forward(x, residual)` also does the pre-norm residual add: `residual = residual + x; return norm(residual),
residual`. With `use_kernel` set (CUDA, `enable_fused_ops`), both run as one Triton launch that updates
`residual` in place; the eager torch ops are the reference.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`weight * (x / sqrt(mean(x^2) + eps))` over the last dimension (no `1 + w` variant)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_kernel = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.use_kernel and x.is_cuda and x.dim() == 2:
            from mstar_kernels.rmsnorm import rms_norm

            out = rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        # The variance is taken in fp32 even for bf16 activations: a bf16 mean of squares loses the scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class ResidualLayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (same parameters and names) whose `forward(x, residual)` also does the pre-norm residual
    add: `residual = residual + x; return norm(residual), residual`. With `use_kernel` set (CUDA), both run
    as one Triton launch (mstar_kernels/layernorm.py) that updates `residual` in place."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__(dim, eps=eps)
        self.use_kernel = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.use_kernel and x.is_cuda and x.dim() == 2:
            from mstar_kernels.layernorm import layer_norm

            out = layer_norm(x, self.weight, self.bias, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return super().forward(x)
        residual = residual + x
        return super().forward(residual), residual
