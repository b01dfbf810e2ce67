"""SwiGLU activation on a packed gate/up projection: `[T, 2I]` (gate | up) -> `silu(gate) * up` `[T, I]`.

Rounded like the reference's two eager ops (silu rounded to the dtype, then the product rounded). Launched with PDL
(mstar_kernels/_pdl.py) at the row counts it allows: it waits for the gate/up projection before its first load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mstar_kernels._pdl import gdc_enter, pdl_launch
from mstar_kernels._rounding import round_to


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = round_to(g / (1.0 + tl.exp(-g)), gate.dtype)
    out = act * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(gate.dtype), mask=mask)


def silu_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x` `[T, 2I]` -> `[T, I]`, into `out` when given (any row stride: e.g. a column slice of a wider buffer)."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(-1) == 1, "x must be [T, 2I], unit stride"
    num_tokens, n_cols = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_tokens, n_cols), dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, n_cols) and out.stride(-1) == 1 and out.dtype == x.dtype, \
        "out must be [T, I] in x's dtype, unit stride"
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(n_cols))
    grid = (num_tokens, triton.cdiv(n_cols, block))
    _silu_mul_kernel[grid](x, out, x.stride(0), out.stride(0), n_cols, BLOCK=block, num_warps=4,
                           **pdl_launch(x, num_tokens, grid[0] * grid[1]))
    return out


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_pair_kernel(gate_ptr, up_ptr, out_ptr, stride_g, stride_u, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = round_to(g / (1.0 + tl.exp(-g)), gate.dtype)
    tl.store(out_ptr + row * n_cols + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_mul_pair(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for two separate `[T, I]` projections (rounded as `silu_mul`)."""
    assert gate.dim() == 2 and gate.shape == up.shape and gate.dtype == up.dtype, "gate and up must be [T, I] alike"
    assert gate.stride(-1) == 1 and up.stride(-1) == 1, "unit stride on I"
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel():
        block = min(1024, triton.next_power_of_2(gate.shape[1]))
        _silu_mul_pair_kernel[(gate.shape[0], triton.cdiv(gate.shape[1], block))](
            gate, up, out, gate.stride(0), up.stride(0), gate.shape[1], BLOCK=block, num_warps=4)
    return out


def silu_mul_pair_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
