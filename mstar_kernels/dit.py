"""The diffusion transformers' elementwise glue, fused: AdaLN modulation, gated residuals, per-head q/k RMSNorm + RoPE.

Each kernel rounds to the activation dtype exactly where the eager ops it replaces round their results, so a
fused block differs from the eager one only where a reduction's summation order moves a value across a rounding
boundary (mean/variance here, against torch's Welford). Eager, one FLUX.2 single-stream block at 1024x1024 makes
about 120 passes of its activation size through memory (the fp32 RoPE alone makes ~25 per tensor); fused, ~20.

- `ada_layer_norm`: `(1 + scale) * layer_norm(x) + shift` (no affine), one row per program; optionally the
  gated residual in front of it, `x = x + gate * y`, stored back as the new residual stream.
- `gated_residual`: `x + gate * y`.
- `qk_norm_rope`: `rope(rms_norm(x) * weight)` per head, interleaved (real, imag) pairs, fp32 tables; written
  at a sequence offset of its output, so the image and text halves of a joint sequence need no concatenation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar_kernels._rounding import round_to


@triton.jit
def _load_row(ptr, b, s, stride_b, stride_s, cols, mask):
    """Row `s` of batch entry `b` of a `[B, S, D]` tensor with unit stride on D."""
    return tl.load(ptr + b * stride_b + s * stride_s + cols, mask=mask, other=0.0)


@triton.jit
def _ada_layer_norm_kernel(x_ptr, y_ptr, gate_ptr, shift_ptr, scale_ptr, res_ptr, out_ptr, seq_len,
                           stride_xb, stride_xs, stride_yb, stride_ys, stride_mod_b, n_cols, eps,
                           HAS_GATE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b, s = row // seq_len, row % seq_len
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = _load_row(x_ptr, b, s, stride_xb, stride_xs, cols, mask)
    dtype = x.dtype
    x32 = x.to(tl.float32)
    if HAS_GATE:
        y = _load_row(y_ptr, b, s, stride_yb, stride_ys, cols, mask).to(tl.float32)
        gate = tl.load(gate_ptr + b * stride_mod_b + cols, mask=mask, other=0.0).to(tl.float32)
        x32 = round_to(x32 + round_to(gate * y, dtype), dtype)
        tl.store(res_ptr + row * n_cols + cols, x32.to(dtype), mask=mask)
    mean = tl.sum(x32, axis=0) / n_cols
    centered = tl.where(mask, x32 - mean, 0.0)
    var = tl.sum(centered * centered, axis=0) / n_cols
    normed = round_to(centered * tl.rsqrt(var + eps), dtype)
    scale = tl.load(scale_ptr + b * stride_mod_b + cols, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + b * stride_mod_b + cols, mask=mask, other=0.0).to(tl.float32)
    out = round_to(round_to(1.0 + scale, dtype) * normed, dtype) + shift
    tl.store(out_ptr + row * n_cols + cols, out.to(dtype), mask=mask)


def _check_rows(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    assert t.shape == like.shape and t.dtype == like.dtype and t.stride(-1) == 1, \
        f"{name} must be [B, S, D] like x, unit stride on D"


def _check_mod(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    assert t.shape == (x.shape[0], 1, x.shape[2]) and t.dtype == x.dtype and t.stride(-1) == 1, \
        f"{name} must be [B, 1, D] in x's dtype, unit stride on D"


def ada_layer_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                   gate: torch.Tensor | None = None, y: torch.Tensor | None = None):
    """`x` `[B, S, D]`, `shift`/`scale`/`gate` `[B, 1, D]` (views of one modulation tensor: the same batch stride).

    Without `gate`: `(1 + scale) * layer_norm(x) + shift`. With `gate` and `y`: `x = x + gate * y` first, and
    returns `(x, modulated)`.
    """
    _check_rows("x", x, x)
    for name, t in (("shift", shift), ("scale", scale)) + ((("gate", gate),) if gate is not None else ()):
        _check_mod(name, t, x)
    assert shift.stride(0) == scale.stride(0) and (gate is None or gate.stride(0) == shift.stride(0)), \
        "shift, scale and gate must share a batch stride"
    batch, seq_len, n_cols = x.shape
    out = torch.empty((batch, seq_len, n_cols), dtype=x.dtype, device=x.device)
    res = out
    if gate is not None:
        assert y is not None
        _check_rows("y", y, x)
        res = torch.empty_like(out)
    if out.numel():
        block = triton.next_power_of_2(n_cols)
        y_ = y if y is not None else x
        _ada_layer_norm_kernel[(batch * seq_len,)](
            x, y_, gate if gate is not None else shift, shift, scale, res, out, seq_len,
            x.stride(0), x.stride(1), y_.stride(0), y_.stride(1), shift.stride(0), n_cols, eps,
            HAS_GATE=gate is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )
    return (res, out) if gate is not None else out


def ada_layer_norm_ref(x, shift, scale, eps, gate=None, y=None):
    if gate is not None:
        x = x + gate * y
    out = (1 + scale) * torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=eps) + shift
    return (x, out) if gate is not None else out


@triton.jit
def _gated_residual_kernel(x_ptr, y_ptr, gate_ptr, out_ptr, seq_len, stride_xb, stride_xs, stride_yb, stride_ys,
                           stride_gb, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b, s = row // seq_len, row % seq_len
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = _load_row(x_ptr, b, s, stride_xb, stride_xs, cols, mask)
    y = _load_row(y_ptr, b, s, stride_yb, stride_ys, cols, mask).to(tl.float32)
    gate = tl.load(gate_ptr + b * stride_gb + cols, mask=mask, other=0.0).to(tl.float32)
    out = x.to(tl.float32) + round_to(gate * y, x.dtype)
    tl.store(out_ptr + row * n_cols + cols, out.to(x.dtype), mask=mask)


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`x + gate * y`: `x`, `y` `[B, S, D]`, `gate` `[B, 1, D]`."""
    _check_rows("x", x, x)
    _check_rows("y", y, x)
    _check_mod("gate", gate, x)
    batch, seq_len, n_cols = x.shape
    out = torch.empty((batch, seq_len, n_cols), dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(2048, triton.next_power_of_2(n_cols))
        _gated_residual_kernel[(batch * seq_len, triton.cdiv(n_cols, block))](
            x, y, gate, out, seq_len, x.stride(0), x.stride(1), y.stride(0), y.stride(1), gate.stride(0), n_cols,
            BLOCK=block, num_warps=4,
        )
    return out


def gated_residual_ref(x, gate, y):
    return x + gate * y


@triton.jit
def _qk_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, seq_len, seq_offset, n_heads,
                         stride_xb, stride_xs, stride_xh, stride_ob, stride_os, stride_oh, eps,
                         HEAD_DIM: tl.constexpr, HEADS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b, s = row // seq_len, row % seq_len
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    dims = tl.arange(0, HEAD_DIM)
    partner = dims ^ 1  # the other half of each interleaved (real, imag) pair
    mask = (heads < n_heads)[:, None]
    base = x_ptr + b * stride_xb + s * stride_xs + heads[:, None] * stride_xh
    x = tl.load(base + dims[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    x32 = x.to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=1) / HEAD_DIM + eps)[:, None]
    w = tl.load(w_ptr + dims).to(tl.float32)[None, :]
    wp = tl.load(w_ptr + partner).to(tl.float32)[None, :]
    normed = round_to(round_to(x32 * rstd, dtype) * w, dtype)
    normed_p = round_to(round_to(xp * rstd, dtype) * wp, dtype)
    pos = seq_offset + s
    cos = tl.load(cos_ptr + pos * HEAD_DIM + dims)[None, :]
    sin = tl.load(sin_ptr + pos * HEAD_DIM + dims)[None, :]
    rotated = tl.where((dims % 2 == 0)[None, :], -normed_p, normed_p)
    out = normed * cos + rotated * sin
    tl.store(out_ptr + b * stride_ob + pos * stride_os + heads[:, None] * stride_oh + dims[None, :], out.to(dtype),
             mask=mask)


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 out: torch.Tensor | None = None, seq_offset: int = 0) -> torch.Tensor:
    """`x` `[B, S, H, D]` (any strides, unit on D) -> `rope(rms_norm(x) * weight)` written to
    `out[:, seq_offset : seq_offset + S]` (`out` `[B, S_total, H, D]`, unit stride on D; new `[B, S, H, D]` when
    None). `cos`/`sin` `[S_total, D]` fp32 contiguous, indexed by the position in `out`."""
    batch, seq_len, heads, head_dim = x.shape
    assert x.stride(-1) == 1, "x must have unit stride on the head dim"
    assert weight.shape == (head_dim,) and weight.is_contiguous()
    assert head_dim % 2 == 0 and head_dim == triton.next_power_of_2(head_dim), "head_dim must be a power of two"
    if out is None:
        out = torch.empty((batch, seq_len, heads, head_dim), dtype=x.dtype, device=x.device)
    assert out.shape[0] == batch and out.shape[2:] == x.shape[2:] and out.stride(-1) == 1 and out.dtype == x.dtype
    assert 0 <= seq_offset and seq_offset + seq_len <= out.shape[1]
    assert cos.shape == sin.shape and cos.shape[0] >= out.shape[1] and cos.shape[1] == head_dim
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    if x.numel():
        block_heads = min(8, triton.next_power_of_2(heads))
        _qk_norm_rope_kernel[(batch * seq_len, triton.cdiv(heads, block_heads))](
            x, weight, cos, sin, out, seq_len, seq_offset, heads, x.stride(0), x.stride(1), x.stride(2),
            out.stride(0), out.stride(1), out.stride(2), eps, HEAD_DIM=head_dim, HEADS=block_heads, num_warps=4,
        )
    return out


def qk_norm_rope_ref(x, weight, eps, cos, sin):
    """The eager composition (RMSNorm's composite rounding: normalise in fp32, round, multiply the weight)."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    cos, sin = cos[None, : x.shape[1], None, :], sin[None, : x.shape[1], None, :]
    real, imag = normed.reshape(*normed.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (normed.float() * cos + rotated.float() * sin).to(x.dtype)


# Z-Image's sandwich-normed blocks: RMSNorm (weight * round(x * rstd)), `1 + scale` inputs, tanh-gated residuals


@triton.jit
def _rms_modulate_kernel(x_ptr, y_ptr, gate_ptr, y_w_ptr, w_ptr, scale_ptr, res_ptr, out_ptr, seq_len,
                         stride_xb, stride_xs, stride_yb, stride_ys, stride_gate_b, stride_scale_b, n_cols,
                         y_eps, eps, HAS_GATE: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b, s = row // seq_len, row % seq_len
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = _load_row(x_ptr, b, s, stride_xb, stride_xs, cols, mask)
    dtype = x.dtype
    x32 = x.to(tl.float32)
    if HAS_GATE:  # x = x + gate * rms_norm(y) * y_weight
        y = _load_row(y_ptr, b, s, stride_yb, stride_ys, cols, mask).to(tl.float32)
        y_rstd = tl.rsqrt(tl.sum(y * y, axis=0) / n_cols + y_eps)
        y_w = tl.load(y_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        normed_y = round_to(y_w * round_to(y * y_rstd, dtype), dtype)
        gate = tl.load(gate_ptr + b * stride_gate_b + cols, mask=mask, other=0.0).to(tl.float32)
        x32 = round_to(x32 + round_to(gate * normed_y, dtype), dtype)
        tl.store(res_ptr + row * n_cols + cols, x32.to(dtype), mask=mask)
    if HAS_OUT:  # out = rms_norm(x) * weight * scale
        rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + b * stride_scale_b + cols, mask=mask, other=0.0).to(tl.float32)
        out = round_to(w * round_to(x32 * rstd, dtype), dtype) * scale
        tl.store(out_ptr + row * n_cols + cols, out.to(dtype), mask=mask)


def _rms_modulate(x, y=None, y_weight=None, y_eps=0.0, gate=None, weight=None, eps=0.0, scale=None):
    _check_rows("x", x, x)
    has_gate, has_out = gate is not None, scale is not None
    if has_gate:
        _check_rows("y", y, x)
        _check_mod("gate", gate, x)
        assert y_weight is not None and y_weight.shape == (x.shape[2],) and y_weight.is_contiguous()
    if has_out:
        _check_mod("scale", scale, x)
        assert weight is not None and weight.shape == (x.shape[2],) and weight.is_contiguous()
    batch, seq_len, n_cols = x.shape
    res = torch.empty((batch, seq_len, n_cols), dtype=x.dtype, device=x.device) if has_gate else x
    out = torch.empty((batch, seq_len, n_cols), dtype=x.dtype, device=x.device) if has_out else x
    if x.numel():
        block = triton.next_power_of_2(n_cols)
        y_ = y if has_gate else x
        gate_, scale_ = (gate if has_gate else scale), (scale if has_out else gate)
        _rms_modulate_kernel[(batch * seq_len,)](
            x, y_, gate_, y_weight if has_gate else weight, weight if has_out else y_weight, scale_, res, out,
            seq_len, x.stride(0), x.stride(1), y_.stride(0), y_.stride(1), gate_.stride(0), scale_.stride(0), n_cols,
            y_eps, eps, HAS_GATE=has_gate, HAS_OUT=has_out, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )
    return res, out


def rms_modulate(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor) -> torch.Tensor:
    """`rms_norm(x) * weight * scale`: `x` `[B, S, D]`, `weight` `[D]`, `scale` `[B, 1, D]` (already `1 + scale`)."""
    return _rms_modulate(x, weight=weight, eps=eps, scale=scale)[1]


def gated_rms_residual(x: torch.Tensor, y: torch.Tensor, y_weight: torch.Tensor, y_eps: float,
                       gate: torch.Tensor) -> torch.Tensor:
    """`x + gate * rms_norm(y) * y_weight` (`gate` `[B, 1, D]`, already `tanh`ed)."""
    return _rms_modulate(x, y=y, y_weight=y_weight, y_eps=y_eps, gate=gate)[0]


def gated_rms_residual_modulate(x, y, y_weight, y_eps, gate, weight, eps, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Both in one pass: `x = x + gate * rms_norm(y) * y_weight`, then `(x, rms_norm(x) * weight * scale)`."""
    return _rms_modulate(x, y=y, y_weight=y_weight, y_eps=y_eps, gate=gate, weight=weight, eps=eps, scale=scale)


def _rms_norm_ref(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_modulate_ref(x, weight, eps, scale):
    return _rms_norm_ref(x, weight, eps) * scale


def gated_rms_residual_ref(x, y, y_weight, y_eps, gate):
    return x + gate * _rms_norm_ref(y, y_weight, y_eps)


def gated_rms_residual_modulate_ref(x, y, y_weight, y_eps, gate, weight, eps, scale):
    x = gated_rms_residual_ref(x, y, y_weight, y_eps, gate)
    return x, rms_modulate_ref(x, weight, eps, scale)


def rope_tables_from_complex(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Complex rotations `[S, D/2]` -> the interleaved fp32 (cos, sin) `[S, D]` tables `qk_norm_rope` reads."""
    parts = torch.view_as_real(freqs.to(torch.complex64))
    return (parts[..., 0].repeat_interleave(2, dim=-1).contiguous(),
            parts[..., 1].repeat_interleave(2, dim=-1).contiguous())
