"""Rounding to the activation dtype inside a kernel, exactly as an eager torch op rounds its result.

`x.to(tl.bfloat16).to(tl.float32)` may be folded away by the compiler, which then fuses the next multiply or
add (one rounding instead of two, different bits from eager torch). Rounding bf16 through the bit pattern
(round to nearest, ties to even) cannot be folded.
"""

import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 `x` rounded to `DTYPE` (bf16, fp16 or fp32), returned as fp32."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def load_row_add_residual(x_ptr, res_ptr, row, stride_x, stride_r, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """One row of `x` as fp32; with `HAS_RESIDUAL`, `residual + x` rounded to x's dtype as the eager add rounds
    it, also stored back into the residual row (the pre-norm residual stream the fused norms update)."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x32 = round_to(x32 + r.to(tl.float32), x.dtype)
        tl.store(res_ptr + row * stride_r + cols, x32.to(x.dtype), mask=mask)
    return x32
