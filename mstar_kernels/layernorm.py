"""LayerNorm with an optional fused residual add: `residual += x; out = weight * (r - mean) / std + bias`.

Numerics follow eager torch op for op: the add is rounded to the activation dtype (as `residual + x` is), the
mean and variance are taken in fp32 over the rounded sum, and the affine result is rounded once at the end
(as torch's CUDA LayerNorm does). One program per token; the whole row sits in registers. Whisper's decoder
runs three of these per layer, each replacing a separate add and LayerNorm launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar_kernels._rounding import load_row_add_residual


@triton.jit
def _layer_norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, stride_x, stride_r, stride_o, n_cols, eps,
                       HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x32 = load_row_add_residual(x_ptr, res_ptr, row, stride_x, stride_r, cols, mask, HAS_RESIDUAL)
    mean = tl.sum(x32, axis=0) / n_cols
    centered = tl.where(mask, x32 - mean, 0.0)
    var = tl.sum(centered * centered, axis=0) / n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = centered * tl.rsqrt(var + eps) * w + b
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """`x` `[T, H]` -> `[T, H]`. With `residual` (same shape), it is updated in place to `residual + x` first."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [T, H] with unit stride on H"
    assert weight.shape == bias.shape == (x.shape[1],) and weight.is_contiguous() and bias.is_contiguous()
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1 and residual.dtype == x.dtype
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    block = triton.next_power_of_2(x.shape[1])
    res = residual if residual is not None else x
    _layer_norm_kernel[(x.shape[0],)](
        x, res, weight, bias, out, x.stride(0), res.stride(0), out.stride(0), x.shape[1], eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return out


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        residual.copy_(residual + x)
        x = residual
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)
