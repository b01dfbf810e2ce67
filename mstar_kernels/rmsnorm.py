"""RMSNorm with an optional fused residual add: `residual += x; out = weight * norm(residual)`.

Numerics follow the reference layer (`mstar_common/layers/norm.py`) op for op: the add is rounded to the
activation dtype (as `residual + x` is in eager torch), the variance is taken in fp32, the normalised value is
rounded before the weight multiply. One program per token; the whole row sits in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar_kernels._pdl import gdc_enter, pdl_launch
from mstar_kernels._rounding import load_row_add_residual, round_to


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x32 = load_row_add_residual(x_ptr, res_ptr, row, stride_x, stride_r, cols, mask, HAS_RESIDUAL)
    dtype = x_ptr.dtype.element_ty
    var = tl.sum(x32 * x32, axis=0) / n_cols
    y = round_to(x32 * tl.rsqrt(var + eps), dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = y * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`x` `[T, H]` -> `[T, H]`. With `residual` (same shape), it is updated in place to `residual + x` first."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [T, H] with unit stride on H"
    assert weight.shape == (x.shape[1],) and weight.is_contiguous()
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1 and residual.dtype == x.dtype
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x.shape[0] == 0:
        return out
    block = triton.next_power_of_2(x.shape[1])
    res = residual if residual is not None else x
    _rms_norm_kernel[(x.shape[0],)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), x.shape[1], eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        **pdl_launch(x, x.shape[0], x.shape[0]),
    )
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        residual.copy_(residual + x)
        x = residual
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * y
