"""Row-wise scaled float8 (e4m3) linears for the diffusion transformers' GEMMs (`model_kwargs.dit_fp8`).

`Fp8Linear` keeps its weight as e4m3 codes with one fp32 scale per output channel (max |row| / 448, computed
once from the loaded bf16 weight), quantises each call's activations per row the same way (mstar_kernels/fp8_quant.py
on CUDA, eager torch elsewhere), and multiplies on the fp8 tensor cores with `torch._scaled_mm`, which applies
both scales and writes the linear's original dtype (bf16 on CUDA, cast when the model runs in another). On an
H200 the DiT's projections run 1.5-1.7x faster than in bf16 (docs/benchmarks.md); the weights take half the
memory. It changes the numerics: each GEMM's result moves by a
few percent relative (e4m3 keeps 3 mantissa bits), so the images are close to, not equal to, the bf16 ones.

`quantize_linears(module)` swaps every eligible `nn.Linear` under `module` in place (features multiples of 16,
as `_scaled_mm` needs; a bias is added after the product).
"""

from __future__ import annotations

import torch
from torch import nn

from mstar_kernels.fp8_quant_torch import quantize_rows_fp8_torch


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda:
        from mstar_kernels.fp8_quant import quantize_rows_fp8

        return quantize_rows_fp8(x)
    return quantize_rows_fp8_torch(x)


class Fp8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            codes, scale = quantize_rows_fp8_torch(linear.weight)  # per output channel: [N, K], [N, 1]
        self.register_buffer("weight_fp8", codes)  # [N, K], row-major: weight_fp8.t() is the column-major B
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, N]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.out_dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        codes, scale = _quantize_rows(rows)
        # CUDA's row-wise scaled GEMM writes bf16 only: another dtype is cast from it
        mm_dtype = torch.bfloat16 if rows.is_cuda else self.out_dtype
        out = torch._scaled_mm(codes, self.weight_fp8.t(), scale_a=scale, scale_b=self.weight_scale,
                               out_dtype=mm_dtype).to(self.out_dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 row-wise"


def is_eligible(linear: nn.Module) -> bool:
    return (type(linear) is nn.Linear and linear.in_features % 16 == 0 and linear.out_features % 16 == 0
            and linear.weight.dtype in (torch.bfloat16, torch.float16, torch.float32))


def quantize_linears(module: nn.Module) -> int:
    """Replace every eligible `nn.Linear` under `module` by an `Fp8Linear`, in place; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if is_eligible(child):
            setattr(module, name, Fp8Linear(child))
            count += 1
        else:
            count += quantize_linears(child)
    return count
