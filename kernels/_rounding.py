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
