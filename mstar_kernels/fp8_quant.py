"""Rows to float8 e4m3 with one scale per row: `x [M, K]` -> (`q [M, K]` e4m3fn, `scale [M, 1]` fp32), where
`q * scale` approximates `x` and `scale = max|row| / 448` (e4m3's largest finite value).

The activations' half of a row-wise scaled fp8 GEMM (`torch._scaled_mm`; the weights are quantised once, per
output channel, at load: `mstar_common/layers/fp8_linear.py`). One program per row reads the row twice (its
absolute maximum, then the scaled cast), so the quantisation costs about one read and a half-size write of the
activations; the eager torch version (`mstar_kernels/fp8_quant_torch.py`, also the reference of the tests) launches
five kernels and materialises an fp32 copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round_to_e4m3(v):
    """`v` (fp32) rounded half to even onto e4m3's grid, in fp32 arithmetic, so that the cast after it is exact:
    the conversion's own rounding is then never relied on (Triton's interpreter does not carry a rounded-up
    mantissa into the exponent). The grid step is 2^(exponent - 3) for normal values, 2^-9 below 2^-6."""
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds |y| < 2^22 to an integer, half to even
    return ((v / step + magic) - magic) * step


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, n_cols, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    peak = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(x))
    scale = tl.maximum(tl.max(peak, axis=0) / 448.0, 1e-12)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(_round_to_e4m3(x / scale), -448.0), 448.0)
        tl.store(q_ptr + row * stride_q + cols, q.to(tl.float8e4nv), mask=mask)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` (unit column stride) -> (`q [M, K]` float8_e4m3fn, contiguous; `scale [M, 1]` float32)."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [M, K] with unit column stride"
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    block = min(4096, triton.next_power_of_2(cols))
    _quantize_rows_kernel[(rows,)](x, q, scale, cols, x.stride(0), q.stride(0), BLOCK=block,
                                   num_warps=8 if block >= 2048 else 4)
    return q, scale
