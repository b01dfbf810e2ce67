"""Row-wise scaled fp8 linears (model_kwargs.dit_fp8): the product is exactly the e4m3 codes' product with both
scales applied, close to the full-precision linear, and only eligible linears are swapped."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mstar_common.layers.fp8_linear import Fp8Linear, quantize_linears
from mstar_kernels.fp8_quant_torch import FP8_MAX, quantize_rows_fp8_torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_row_quantisation_scales_each_row_to_the_e4m3_range():
    x = torch.randn(6, 80) * torch.logspace(-3, 3, 6)[:, None]
    x[2] = 0.0
    codes, scale = quantize_rows_fp8_torch(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    peak = codes.float().abs().amax(dim=1)
    assert torch.equal(peak[[0, 1, 3, 4, 5]], torch.full((5,), FP8_MAX)) and peak[2] == 0
    assert rel(codes.float() * scale, x) < 0.05  # 3 mantissa bits: ~2-4% relative per row


@torch.no_grad()
def test_fp8_linear_is_the_scaled_product_of_the_codes_and_close_to_the_linear():
    torch.manual_seed(0)
    linear = nn.Linear(96, 64, bias=True)
    fp8 = Fp8Linear(linear)
    x = torch.randn(3, 5, 96)
    out = fp8(x)
    assert out.shape == (3, 5, 64) and out.dtype == torch.float32
    codes, scale = quantize_rows_fp8_torch(x.reshape(-1, 96))
    weight = fp8.weight_fp8.double() * fp8.weight_scale.double().t()
    expected = (codes.double() * scale.double()) @ weight.t() + linear.bias.double()
    assert rel(out.reshape(-1, 64), expected) < 1e-6  # fp32 accumulation of the same codes
    assert 0.005 < rel(out, linear(x)) < 0.06  # quantised: close, not equal (e4m3 keeps 3 mantissa bits)
    assert fp8.weight_fp8.dtype == torch.float8_e4m3fn and fp8.weight_scale.shape == (1, 64)


def test_quantize_linears_swaps_only_linears_fp8_gemms_can_take():
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Sequential(nn.Linear(48, 20), nn.Linear(16, 64, bias=False)))
    assert quantize_linears(model) == 2
    assert isinstance(model[0], Fp8Linear) and type(model[2][0]) is nn.Linear and isinstance(model[2][1], Fp8Linear)
    assert quantize_linears(model) == 0  # already swapped


@pytest.mark.gpu
@torch.no_grad()
def test_fp8_linear_on_cuda_quantises_with_the_kernel_and_replays_in_a_graph():
    """bf16 on the GPU: the Triton quantiser feeds `_scaled_mm`; the result is the codes' scaled product (bf16
    output rounding), ~4% from the bf16 linear at the DiT's shapes, and a captured replay equals the eager call."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    linear = nn.Linear(3072, 9216, bias=False, device="cuda", dtype=torch.bfloat16)
    fp8 = Fp8Linear(linear)
    x = torch.randn(2, 4608, 3072, device="cuda", dtype=torch.bfloat16)
    out = fp8(x)
    codes, scale = quantize_rows_fp8_torch(x.reshape(-1, 3072))
    expected = (codes.float() * scale) @ (fp8.weight_fp8.float() * fp8.weight_scale.t()).t()
    assert rel(out.reshape(-1, 9216), expected) < 5e-3  # bf16 output rounding
    assert rel(out, linear(x)) < 0.06
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    fp8(static)  # warm-up (Triton compile) outside the capture
    with torch.cuda.graph(graph):
        captured = fp8(static)
    static.copy_(x)
    graph.replay()
    assert torch.equal(captured, out)
