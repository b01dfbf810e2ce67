"""mstar_kernels/staged_gemv.py (CUDA C++, weights staged in shared memory ahead of the PDL wait) against
mstar_kernels/gemv.py and fp32 products: the same input roundings (plain, SwiGLU, residual + RMSNorm), so the same
bf16 inputs; sums in another order, so outputs within bf16 rounding. Needs a Hopper-or-newer GPU and nvcc; the plan
and candidate logic runs anywhere."""

from __future__ import annotations

import pytest
import torch

from mstar_kernels import staged_gemv as staged
from tests.kernels.conftest import IS_INTERPRETED, rel_err


def _gpu_ready() -> bool:
    if IS_INTERPRETED or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return False
    return staged._library() is not None  # built whether or not MSTAR_GEMV_STAGED lets the tuning try it


needs_kernel = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_ready(), reason="needs a GPU of compute capability "
                                                    ">= 9.0 and nvcc (mstar_kernels/staged_gemv.cu)")]
pytestmark = needs_kernel

# (N, K, cols): Qwen3-0.6B qkv / o / down, a ragged last CTA, a single column per CTA at a long K
CASES = [(4096, 1024, 16), (1024, 2048, 8), (1024, 3072, 8), (1000, 2048, 24), (136, 8192, 1), (6144, 1024, 48)]


def _operands(n, k, rows, seed, width=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, width or k, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    return x, weight, bias


@pytest.mark.parametrize("n,k,cols", CASES)
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("with_bias", [True, False])
def test_plain_matches_fp32_products_and_the_triton_kernel(n, k, cols, rows, with_bias):
    from mstar_kernels.gemv import gemv, gemv_ref

    x, weight, bias = _operands(n, k, rows, n + k + rows)
    bias = bias if with_bias else None
    out, res_out = staged.staged_gemv(x, weight, bias, cols)
    assert res_out is x and out.shape == (rows, n) and out.dtype == torch.bfloat16
    ref = gemv_ref(x, weight, bias)
    assert rel_err(out, ref) < 8e-3
    assert (out != ref).float().mean() < 0.05  # one rounding of an fp32 sum: mostly the same bits
    assert rel_err(out, gemv(x, weight, bias)) < 8e-3


@pytest.mark.parametrize("rows", [1, 3])
def test_swiglu_input_is_the_triton_kernels(rows):
    from mstar_kernels.gemv import gemv
    from mstar_kernels.silu_mul import silu_mul

    n, k = 1024, 3072
    x, weight, _ = _operands(n, k, rows, 7, width=2 * k)
    out, _ = staged.staged_gemv(x, weight, None, 8, swiglu=True)
    act = silu_mul(x)  # mstar_kernels/silu_mul.py: the rounding both GEMVs reproduce
    ref = act.float() @ weight.float().T
    assert rel_err(out, ref) < 8e-3
    assert rel_err(out, gemv(x, weight, None, swiglu=True)) < 8e-3


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_input_and_residual_stream_are_the_triton_kernels(rows, with_residual):
    from mstar_kernels.gemv import norm_gemv
    from mstar_kernels.rmsnorm import rms_norm_ref

    n, k = 4096, 1024
    x, weight, bias = _operands(n, k, rows, 11)
    gen = torch.Generator(device="cuda").manual_seed(12)
    gamma = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).bfloat16()
    residual = torch.randn(rows, k, device="cuda", generator=gen).bfloat16() if with_residual else None
    out, stream = staged.staged_gemv(x, weight, bias, 16, norm=(gamma, 1e-6, residual))
    tri_out, tri_stream = norm_gemv(x, gamma, 1e-6, weight, bias, residual)
    if with_residual:
        assert stream is not x and torch.equal(stream, tri_stream)  # x + residual, rounded once: exact
        assert torch.equal(stream, (x.float() + residual.float()).bfloat16())
    else:
        assert stream is x
    ref_stream = residual.clone() if with_residual else None
    normed = rms_norm_ref(x, gamma, 1e-6, ref_stream)
    ref = normed.float() @ weight.float().T + bias.float()
    assert rel_err(out, ref) < 8e-3
    assert rel_err(out, tri_out) < 8e-3


def test_dispatch_by_setting_and_fallback_for_an_unaligned_input():
    """`gemv_with` sends `(STAGED, cols)` here; an input the kernel cannot read (rows not 16-byte aligned) goes
    through the Triton kernel's default blocks, with the same result."""
    from mstar_kernels.gemv import gemv_ref, gemv_with

    n, k = 1024, 2048
    x, weight, _ = _operands(n, k, 2, 3, width=k + 8)
    view = x[:, 1:k + 1]  # a 2-byte offset: not aligned
    assert staged.readable(x[:, :k], weight, None) and not staged.readable(view, weight, None)
    for inp in (x[:, :k], view):
        out = gemv_with(inp, weight, None, (staged.STAGED, 16))
        assert rel_err(out, gemv_ref(inp, weight, None)) < 8e-3


def test_a_pdl_chain_in_a_cuda_graph_gives_the_eager_bits():
    """RMSNorm launch -> staged qkv-like -> staged o-like -> staged with its norm inside, captured with PDL: the same
    bits as the same launches run eagerly (a copy ahead of the wait must never see a stale input)."""
    from mstar_common.diffusion.step_graphs import capture_graph
    from mstar_kernels.rmsnorm import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(5)
    h = torch.randn(1, 1024, device="cuda", generator=gen).bfloat16()
    gamma = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    w1 = (torch.randn(2048, 1024, device="cuda", generator=gen) / 32).bfloat16()
    w2 = (torch.randn(1024, 2048, device="cuda", generator=gen) / 45).bfloat16()
    w3 = (torch.randn(3072, 1024, device="cuda", generator=gen) / 32).bfloat16()

    def chain():
        a = rms_norm(h, gamma, 1e-6)
        b, _ = staged.staged_gemv(a, w1, None, 16)
        c, _ = staged.staged_gemv(b, w2, None, 8)
        d, stream = staged.staged_gemv(c, w3, None, 24, norm=(gamma, 1e-6, h))
        return d, stream

    eager = [t.clone() for t in chain()]
    graph, outs = capture_graph(chain, None)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, e) for o, e in zip(outs, eager, strict=True))


def test_a_setting_that_does_not_fit_is_refused():
    x = torch.zeros(1, 8192 * 2, device="cuda", dtype=torch.bfloat16)
    weight = torch.zeros(64, 8192 * 2, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="does not take"):
        staged.staged_gemv(x, weight, None, 64)  # 65 rows x 32 KB of shared memory
