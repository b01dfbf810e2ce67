"""mstar_kernels/fp8_quant.py against its torch reference: the same per-row scales, the same e4m3 codes (a code may
differ by one step where the two divisions round a value on either side of a rounding boundary)."""

from __future__ import annotations

import pytest
import torch

from mstar_kernels.fp8_quant_torch import quantize_rows_fp8_torch
from tests.kernels.conftest import DEVICE, GPU_ONLY, sweep

pytestmark = GPU_ONLY
SHAPES = sweep([(1, 16), (7, 3072), (33, 5000), (4608, 3072), (300, 12288)], [(1, 16), (5, 200), (3, 5000)])


@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_rows_matches_the_torch_reference(rows, cols, dtype):
    from mstar_kernels.fp8_quant import quantize_rows_fp8

    torch.manual_seed(rows * 31 + cols)
    x = (torch.randn(rows, cols) * torch.logspace(-2, 2, rows)[:, None]).to(dtype).to(DEVICE)
    if rows > 2:
        x[1] = 0.0
    codes, scale = quantize_rows_fp8(x)
    ref_codes, ref_scale = quantize_rows_fp8_torch(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (rows, cols) and scale.shape == (rows, 1)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    got, want = codes.float(), ref_codes.float()
    step = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2.0**-6))) - 3)  # one e4m3 step at the value
    assert ((got - want).abs() <= step).all()
    assert (got != want).float().mean() < 1e-3


def test_quantize_rows_takes_a_strided_view():
    from mstar_kernels.fp8_quant import quantize_rows_fp8

    x = torch.randn(4, 96, device=DEVICE)[:, :64]
    codes, scale = quantize_rows_fp8(x)
    ref_codes, ref_scale = quantize_rows_fp8_torch(x.contiguous())
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    assert (codes.float() != ref_codes.float()).float().mean() < 1e-3
