"""The tens-of-rows decode GEMM (mstar_kernels/mid_gemm.py) against fp32 products: split K with its in-kernel reduce,
the SwiGLU load, row blocks, and the same bits from run to run."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, GPU_ONLY, IS_INTERPRETED, normed_projection_inputs, rel_err, sweep

pytest.importorskip("triton")
pytestmark = GPU_ONLY

from mstar_kernels.mid_gemm import counters, fits, mid_gemm, readable  # noqa: E402

# The interpreter's bf16 dots are not exact (numpy has no bf16): fp32 there, bf16 on the GPU
DTYPE = torch.float32 if IS_INTERPRETED else torch.bfloat16
# (N, K): Qwen3-0.6B o / down, Llama-3.2-3B qkv; odd sizes for the masks
SHAPES = sweep([(1024, 2048), (1024, 3072), (5120, 3072), (1000, 300)], [(64, 256), (48, 200)])


def _ref(x, weight, bias=None):
    out = x.float() @ weight.float().T
    return out + bias.float() if bias is not None else out


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", sweep([5, 16, 33, 64, 100], [5, 16, 70]))
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("with_bias", [True, False])
def test_mid_gemm_matches_fp32_products(n, k, rows, split_k, with_bias):
    gen = torch.Generator().manual_seed(n + k + rows + split_k)
    x = torch.randn(rows, k, generator=gen).to(DTYPE).to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(DTYPE).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(DTYPE).to(DEVICE) if with_bias else None
    block_k = 64 if IS_INTERPRETED else 128
    out = mid_gemm(x, weight, bias, block_n=16, block_k=block_k, split_k=split_k, num_stages=2)
    assert out.shape == (rows, n) and out.dtype == DTYPE
    ref = _ref(x, weight, bias)
    assert rel_err(out, ref) < (1e-6 if DTYPE == torch.float32 else 8e-3)
    if DTYPE == torch.bfloat16:
        assert (out != ref.to(DTYPE)).float().mean() < 0.05  # one rounding of an fp32 sum: mostly the same bits
    assert int(counters(DEVICE).abs().sum()) == 0, "a split-K launch left a counter set"


@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_mid_gemm_split_k_gives_the_same_bits_every_run(split_k):
    """The last split to arrive adds the partials in split order, so arrival order does not change the bits."""
    n, k = sweep([(1024, 2048)], [(32, 256)])[0]
    gen = torch.Generator().manual_seed(split_k)
    x = torch.randn(64, k, generator=gen).to(DTYPE).to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(DTYPE).to(DEVICE)
    runs = [mid_gemm(x, weight, block_n=16, block_k=64, split_k=split_k) for _ in range(4 if IS_INTERPRETED else 20)]
    assert all(torch.equal(runs[0], run) for run in runs[1:])


@pytest.mark.parametrize("rows", [16, 64])
def test_mid_gemm_swiglu_equals_the_activation_kernel_then_the_gemm(rows):
    from mstar_kernels.silu_mul import silu_mul

    n, k = sweep([(1024, 3072)], [(64, 192)])[0]
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * k, generator=gen).to(DTYPE).to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(DTYPE).to(DEVICE)
    for split_k in (1, 2):
        fused = mid_gemm(gate_up, weight, swiglu=True, block_n=16, block_k=64, split_k=split_k)
        separate = mid_gemm(silu_mul(gate_up), weight, block_n=16, block_k=64, split_k=split_k)
        assert torch.equal(fused, separate)
        # wider chunks are capped at FOLD_BLOCK_K (64) for the SwiGLU load: the same launch, the same bits
        assert torch.equal(mid_gemm(gate_up, weight, swiglu=True, block_n=16, block_k=256, split_k=split_k), fused)
    with pytest.raises(AssertionError, match="2K with swiglu"):
        mid_gemm(gate_up[:, :k], weight, swiglu=True)


@pytest.mark.parametrize("rows", sweep([5, 16, 64, 70], [5, 70]))
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("with_residual", [True, False])
def test_mid_gemm_norm_equals_the_norm_kernel_then_the_gemm(rows, split_k, with_residual):
    """The pre-norm block's add + RMSNorm inside the projection's loads (`mid_gemm_norm`): the reference ops within
    one rounding, the norm kernel + `mid_gemm` within an ulp here and there (the mean of squares summed in another
    order), and the residual stream it returns equal to the add's over every column and row block, whichever
    program of a split stores it. The input residual is only read."""
    from mstar_kernels.mid_gemm import mid_gemm_norm
    from mstar_kernels.rmsnorm import rms_norm_ref

    n, k = sweep([(4096, 1024), (1000, 300)], [(48, 200)])[0]
    x, residual, gamma, weight, bias = normed_projection_inputs(rows, n, k, DTYPE, rows + 5 * split_k + with_residual,
                                                                with_residual)
    before = residual.clone() if with_residual else None
    out, stream = mid_gemm_norm(x, gamma, 1e-6, weight, bias, residual, block_n=16, block_k=64, split_k=split_k,
                                num_stages=2)
    assert residual is None or torch.equal(residual, before), "the input residual is read, never written"
    ref_stream = before.clone() if with_residual else None
    normed = rms_norm_ref(x, gamma, 1e-6, ref_stream)
    assert torch.equal(stream, ref_stream if with_residual else x)
    assert out.shape == (rows, n) and out.dtype == DTYPE
    assert rel_err(out, _ref(normed, weight, bias)) < (1e-5 if DTYPE == torch.float32 else 1e-2)
    apart = mid_gemm(normed, weight, bias, block_n=16, block_k=64, split_k=split_k, num_stages=2)
    assert rel_err(out, apart) < (1e-6 if DTYPE == torch.float32 else 5e-3)
    if DTYPE == torch.bfloat16:
        assert (out != apart).float().mean() < 0.02, "the norm kernel's bits but for the odd ulp"
    assert int(counters(DEVICE).abs().sum()) == 0, "a split-K launch left a counter set"


def test_the_computing_forms_keep_the_weight_bytes_in_flight_within_shared_memory():
    """`fold_stages`: a form run at FOLD_BLOCK_K columns instead of the asked 256 takes 4x the stages (the same
    weight bytes in flight), fewer where the tiles would pass SMEM_BYTES, never fewer than asked."""
    from mstar_kernels.mid_gemm import FOLD_BLOCK_K, SMEM_BYTES, fold_stages

    assert FOLD_BLOCK_K == 64
    assert fold_stages(16, 32, 256, 3) == 12 and fold_stages(32, 32, 256, 3) == 12  # 8-32 rows: 4 x 3
    assert fold_stages(16, 64, 128, 2) == 4
    deep = fold_stages(64, 32, 256, 3)  # 64 rows: x and residual tiles of 64 rows cap it
    assert 3 < deep < 12 and (deep + 1) * (2 * 64 + 32) * FOLD_BLOCK_K * 2 <= SMEM_BYTES
    assert fold_stages(64, 256, 256, 3) == 3  # never below what was asked


def test_mid_gemm_in_a_captured_graph_replays_with_split_k():
    """Counters made before capture, partials from the graph's pool: replays give the eager bits."""
    if IS_INTERPRETED:
        pytest.skip("CUDA graphs need a GPU")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 2048, generator=gen).to(DTYPE).to(DEVICE)
    weight = (torch.randn(1024, 2048, generator=gen) / 2048**0.5).to(DTYPE).to(DEVICE)
    setting = dict(block_n=16, block_k=128, split_k=4, num_warps=4, num_stages=3)
    eager = mid_gemm(x, weight, **setting)
    counters(DEVICE)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mid_gemm(x, weight, **setting)
    for _ in range(5):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_fits_and_readable_refuse_what_the_kernel_cannot_take():
    assert fits(64, 1024, 2048, 16, 128, 4, 3) and not fits(64, 1024, 2048, 128, 256, 1, 5), "shared memory"
    assert not fits(64, 1024, 128, 16, 128, 2, 3), "two splits of one K chunk"
    weight = torch.zeros(8, 16, dtype=DTYPE, device=DEVICE)
    assert readable(torch.zeros(4, 16, dtype=DTYPE, device=DEVICE), weight, None)
    assert not readable(torch.zeros(300, 16, dtype=DTYPE, device=DEVICE), weight, None)
    assert not readable(torch.zeros(4, 16, dtype=torch.float64, device=DEVICE), weight.double().float(), None)
    assert not readable(torch.zeros(16, 4, dtype=DTYPE, device=DEVICE).T, weight, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the layers route to the kernel on CUDA tensors only")
def test_a_projection_takes_the_kernel_under_the_ab_switch(monkeypatch):
    """`MSTAR_MID_GEMM` (mstar_common/layers/linear.py) puts the named projections on this kernel at 5-64 rows
    (`mid_gemm_rows`) with the table's settings, and leaves other kinds, other row counts and the default (`auto`,
    with nothing chosen for this layer) on cuBLAS."""
    from torch import nn

    from mstar_common.layers.linear import MID_GEMM_SETTINGS, GemvLinear, mid_gemm_rows

    gen = torch.Generator().manual_seed(7)
    linear = nn.Linear(2048, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(1024, 2048, generator=gen) / 2048**0.5)
    linear.__class__, linear.pdl_kind, linear.gemv_plan = GemvLinear, "o_proj", {}
    low, high = mid_gemm_rows()
    wide = torch.randn(high + 1, 2048, generator=gen).to("cuda", torch.bfloat16)
    x = wide[:32]
    cublas = torch.nn.functional.linear(x, linear.weight)
    kernel = mid_gemm(x, linear.weight, None, *MID_GEMM_SETTINGS["o_proj"])
    assert not torch.equal(cublas, kernel), "the two sums should differ in some last bits, or the test proves nothing"
    monkeypatch.setenv("MSTAR_MID_GEMM", "o_proj,down_proj")
    assert torch.equal(linear(x), kernel)
    for rows in (low - 1, high + 1):  # below and above the switch's rows
        assert torch.equal(linear(wide[:rows]), torch.nn.functional.linear(wide[:rows], linear.weight))
    linear.pdl_kind = "qkv_proj"
    assert torch.equal(linear(x), cublas)
    monkeypatch.setenv("MSTAR_MID_GEMM", "all")
    linear.pdl_kind = "o_proj"
    assert rel_err(linear(x), cublas.float()) < 8e-3
    monkeypatch.delenv("MSTAR_MID_GEMM")
    assert torch.equal(linear(x), cublas)


@pytest.mark.parametrize("first_layer", [True, False])
def test_the_decoder_folds_match_the_launches_they_replace(first_layer, monkeypatch):
    """`MSTAR_MID_GEMM_FOLD=norm+swiglu` in a decoder layer's 8-row step on mid_gemm: the pre-norm + qkv (and + gate_up)
    as one launch give the norm then the projection's launch within an ulp, and the same residual stream (x itself
    on the first layer, which has none); the MLP with the activation in down's loads gives the activation then
    down. Run on the GPU, and on the CPU in Triton's interpreter (where the layers route CPU tensors to the kernel)."""
    import mstar_kernels.mid_gemm as mid_module
    from mstar_common.layers.decoder import DecoderLayer, DecoderLayerConfig
    from mstar_common.layers.linear import use_gemv

    hidden, inter = sweep([(1024, 3072)], [(64, 96)])[0]
    layer = DecoderLayer(DecoderLayerConfig(hidden_size=hidden, intermediate_size=inter, num_heads=4, num_kv_heads=2,
                                            head_dim=hidden // 4, qk_norm=True))
    gen = torch.Generator().manual_seed(5 + first_layer)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5 + (param.dim() == 1))
    layer.self_attn.fuse_qkv()
    layer.mlp.fuse_gate_up()
    layer = layer.to(DEVICE, DTYPE)
    use_gemv(layer, 4)  # GEMV plans for 1-4 rows: an 8-row step runs on mid_gemm
    layer.norm_gemv, layer.mlp.use_kernel = True, True
    monkeypatch.setenv("MSTAR_MID_GEMM", "all")
    x = torch.randn(8, hidden, generator=gen).to(DEVICE, DTYPE)
    residual = None if first_layer else torch.randn(8, hidden, generator=gen).to(DEVICE, DTYPE)
    tol = 1e-6 if DTYPE == torch.float32 else 5e-3
    calls = []
    real_norm = mid_module.mid_gemm_norm
    monkeypatch.setattr(mid_module, "mid_gemm_norm", lambda *a, **k: calls.append("norm") or real_norm(*a, **k))
    for norm, linear in layer.norm_gemv_pairs():
        monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "")
        assert layer._norm_project(norm, linear, x, residual) is None, "unfolded: the norm kernel, then the launch"
        normed, stream = (norm(x), x) if residual is None else norm(x, residual.clone())
        want = linear(normed)
        monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "norm")
        out, got_stream = layer._norm_project(norm, linear, x, residual)
        assert torch.equal(got_stream, stream) and (residual is not None or got_stream is x)
        assert rel_err(out, want) < tol, linear.pdl_kind
    assert calls == ["norm", "norm"]
    gate_up = torch.randn(8, 2 * inter, generator=gen).to(DEVICE, DTYPE)
    monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "")
    apart = layer.mlp(None, gate_up=gate_up)
    monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "swiglu")
    real_mid, swiglu = mid_module.mid_gemm, []
    monkeypatch.setattr(mid_module, "mid_gemm", lambda *a, **k: swiglu.append(k.get("swiglu")) or real_mid(*a, **k))
    folded = layer.mlp(None, gate_up=gate_up)
    assert swiglu == [True] and rel_err(folded, apart) < tol
    # chosen by MSTAR_MID_GEMM=auto with MSTAR_MID_GEMM_FOLD=auto (`set_mid_rows(..., fold=True)`): the same launches
    from mstar_common.layers.linear import set_mid_rows

    monkeypatch.setenv("MSTAR_MID_GEMM", "auto")
    monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "auto")
    set_mid_rows(layer, 8, True, fold=True)
    assert torch.equal(layer.mlp(None, gate_up=gate_up), folded) and swiglu == [True, True]
    norm, linear = layer.norm_gemv_pairs()[0]
    assert layer._norm_project(norm, linear, x, residual) is not None and calls == ["norm"] * 3
    set_mid_rows(layer, 8, True)
    assert layer._norm_project(norm, linear, x, residual) is None and layer.mlp(None, gate_up=gate_up) is not None
    assert swiglu == [True, True, None]  # down on mid_gemm, after the activation kernel
    set_mid_rows(layer, 8, False)
