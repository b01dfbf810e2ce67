"""Snake activation, fused: `x + sin(alpha x)^2 / (alpha + 1e-9)` per channel of `[B, C, T]`, in one pass;
and SNAC's residual-unit head `snake -> depthwise dilated conv (k=7) -> snake` in one pass.

The eager form is five elementwise kernels over the activation (SNAC's decoder applies it 29 times per
decode, over tensors of up to 64 x 8192 samples per window), so the codec was bound by their memory traffic.
Computed in float32, rounded once to the input dtype (the eager form rounds after each op: the two agree to
the dtype's precision, not bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _snake_kernel(x_ptr, alpha_ptr, out_ptr, num_channels, length, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (batch, channel) row of `length` samples
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < length
    x = tl.load(x_ptr + row * length + cols, mask=mask, other=0.0)
    alpha = tl.load(alpha_ptr + row % num_channels).to(tl.float32)
    xf = x.to(tl.float32)
    s = tl.sin(alpha * xf)
    out = xf + s * s / (alpha + 1e-9)
    tl.store(out_ptr + row * length + cols, out.to(x.dtype), mask=mask)


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """`x` `[B, C, T]`, `alpha` `[1, C, 1]` (the module's parameter)."""
    assert x.dim() == 3 and alpha.numel() == x.shape[1], "x must be [B, C, T] and alpha [1, C, 1]"
    x = x.contiguous()
    out = torch.empty_like(x)
    batch, channels, length = x.shape
    if x.numel() == 0:
        return out
    block = min(2048, triton.next_power_of_2(length))
    _snake_kernel[(batch * channels, triton.cdiv(length, block))](x, alpha.reshape(-1).contiguous(), out, channels,
                                                                  length, BLOCK=block, num_warps=4)
    return out


def snake_ref(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


@triton.jit
def _snake_f32(x, alpha):
    s = tl.sin(alpha * x)
    return x + s * s / (alpha + 1e-9)


@triton.jit
def _snake_dwconv_snake_kernel(x_ptr, alpha1_ptr, w_ptr, b_ptr, alpha2_ptr, out_ptr, num_channels, length,
                               dilation, KERNEL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    channel = row % num_channels
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    alpha1 = tl.load(alpha1_ptr + channel).to(tl.float32)
    alpha2 = tl.load(alpha2_ptr + channel).to(tl.float32)
    acc = tl.zeros((BLOCK,), dtype=tl.float32) + tl.load(b_ptr + channel).to(tl.float32)
    for k in tl.static_range(KERNEL):
        pos = cols + (k - KERNEL // 2) * dilation
        inside = (pos >= 0) & (pos < length)
        x = tl.load(x_ptr + row * length + pos, mask=inside, other=0.0).to(tl.float32)
        tap = tl.where(inside, _snake_f32(x, alpha1), 0.0)  # the conv's zero padding is outside the signal
        acc += tl.load(w_ptr + channel * KERNEL + k).to(tl.float32) * tap
    tl.store(out_ptr + row * length + cols, _snake_f32(acc, alpha2).to(out_ptr.dtype.element_ty), mask=cols < length)


def snake_dwconv_snake(x: torch.Tensor, alpha1: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       dilation: int, alpha2: torch.Tensor) -> torch.Tensor:
    """`snake2(depthwise_conv(snake1(x)))`: `x` `[B, C, T]`, `weight` `[C, 1, K]` (odd K, "same" padding
    `dilation * (K - 1) / 2`), `bias` `[C]`, alphas `[1, C, 1]`. Each output reads K dilated taps of `x`
    (cached), so the two activations and the conv cost one read and one write instead of three of each."""
    batch, channels, length = x.shape
    kernel = weight.shape[-1]
    assert weight.shape == (channels, 1, kernel) and kernel % 2 == 1, "weight must be [C, 1, K], K odd"
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    block = min(1024, triton.next_power_of_2(length))
    _snake_dwconv_snake_kernel[(batch * channels, triton.cdiv(length, block))](
        x, alpha1.reshape(-1).contiguous(), weight.reshape(-1).contiguous(), bias.contiguous(),
        alpha2.reshape(-1).contiguous(), out, channels, length, dilation, KERNEL=kernel, BLOCK=block, num_warps=4)
    return out


def snake_dwconv_snake_ref(x, alpha1, weight, bias, dilation, alpha2):
    pad = dilation * (weight.shape[-1] - 1) // 2
    h = torch.nn.functional.conv1d(snake_ref(x, alpha1), weight, bias, padding=pad, dilation=dilation,
                                   groups=x.shape[1])
    return snake_ref(h, alpha2)
