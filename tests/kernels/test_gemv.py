"""The skinny decode GEMM (mstar_kernels/gemv.py) against fp32 products, and the layers' switch to it."""

from __future__ import annotations

import json

import pytest
import torch

from tests.kernels.conftest import DEVICE, GPU_ONLY, IS_INTERPRETED, normed_projection_inputs, rel_err, sweep

triton = pytest.importorskip("triton")
pytestmark = GPU_ONLY

from mstar_common.layers.linear import GemvLinear, tune_gemv, use_gemv  # noqa: E402
from mstar_kernels.gemv import TILE_ELEMENTS, gemv, gemv_blocks, gemv_ref  # noqa: E402

# (N, K): Qwen3-0.6B qkv / o / gate_up / down, Whisper large-v3 q / fc1 / fc2; odd sizes for the masks
SHAPES = sweep([(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (1280, 1280), (5120, 1280), (1280, 5120),
                (1000, 300)], [(96, 64), (40, 200), (64, 384)])


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", sweep([torch.bfloat16, torch.float32], [torch.bfloat16, torch.float32]))
@pytest.mark.parametrize("with_bias", [True, False])
def test_gemv_matches_fp32_products(n, k, rows, dtype, with_bias):
    gen = torch.Generator().manual_seed(n + k + rows)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    out, ref = gemv(x, weight, bias), gemv_ref(x, weight, bias)
    assert out.shape == (rows, n) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else (3e-2 if IS_INTERPRETED else 8e-3)
    assert rel_err(out, ref) < tol
    if dtype == torch.bfloat16 and not IS_INTERPRETED:
        assert (out != ref).float().mean() < 0.05  # one rounding of an fp32 sum: mostly the same bits


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("dtype", sweep([torch.bfloat16, torch.float32], [torch.bfloat16, torch.float32]))
def test_gemv_swiglu_equals_the_activation_kernel_then_gemv(rows, dtype):
    """The down projection reading silu(gate) * up on load: the same roundings as silu_mul, then the product."""
    from mstar_kernels.silu_mul import silu_mul

    n, k = sweep([(1024, 3072)], [(64, 192)])[0]
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * k, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    fused = gemv(gate_up, weight, swiglu=True)
    separate = gemv(silu_mul(gate_up), weight)
    assert torch.equal(fused, separate) or IS_INTERPRETED and rel_err(fused, separate) < 1e-2
    with pytest.raises(AssertionError, match="2K with swiglu"):
        gemv(gate_up[:, :k], weight, swiglu=True)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", sweep([torch.bfloat16, torch.float32], [torch.bfloat16]))
def test_norm_gemv_equals_the_norm_kernel_then_gemv(rows, with_residual, dtype):
    """The pre-norm block's add + RMSNorm inside the projection's load: the reference ops' output within the
    tolerance of one bf16 rounding, the norm kernel's bits but for the odd ulp, and the residual stream it
    returns equal to the add's."""
    from mstar_kernels.gemv import norm_gemv
    from mstar_kernels.rmsnorm import rms_norm_ref

    n, k = sweep([(4096, 1024), (1024, 3072)], [(96, 200)])[0]
    x, residual, gamma, weight, bias = normed_projection_inputs(rows, n, k, dtype, rows + 7 * with_residual,
                                                                with_residual)
    before = residual.clone() if with_residual else None
    out, stream = norm_gemv(x, gamma, 1e-6, weight, bias, residual, block_k=64)  # several K chunks
    assert residual is None or torch.equal(residual, before), "the input residual is read, never written"

    ref_stream = before.clone() if with_residual else None
    normed = rms_norm_ref(x, gamma, 1e-6, ref_stream)
    want_stream = ref_stream if with_residual else x
    assert torch.equal(stream, want_stream)
    assert stream is x or stream.data_ptr() != x.data_ptr()
    ref = gemv_ref(normed, weight, bias)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.shape == (rows, n) and rel_err(out, ref) < tol
    assert rel_err(out, gemv(normed, weight, bias)) < (1e-6 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("with_residual", [True, False])
def test_a_whole_k_chunk_reads_the_normed_input_once_with_the_same_bits(rows, with_residual, monkeypatch):
    """`ONE_CHUNK` (BLOCK_K >= K): x (+ the residual) read once for the row scales and the products, and the norm
    weight ahead of the PDL wait, must give the bits of the general path's three reads, and the same residual
    stream. A chunk that normed with the wrong scale or weight, or dropped the residual, would differ."""
    from mstar_kernels.gemv import norm_gemv

    n, k = sweep([(4096, 1024), (6144, 1024), (1000, 300)], [(96, 200), (40, 64)])[0]
    gen = torch.Generator().manual_seed(rows + 3 * with_residual)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    residual = torch.randn(rows, k, generator=gen).to(torch.bfloat16).to(DEVICE) if with_residual else None
    gamma = (1 + 0.1 * torch.randn(k, generator=gen)).to(torch.bfloat16).to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16).to(DEVICE)
    whole_k = triton.next_power_of_2(k)
    runs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("MSTAR_GEMV_NORM_ONE_READ", switch)
        runs[switch] = norm_gemv(x, gamma, 1e-6, weight, None, residual, block_n=4, block_k=whole_k)
    (one, one_stream), (general, general_stream) = runs["1"], runs["0"]
    assert torch.equal(one, general) and torch.equal(one_stream, general_stream)
    assert not torch.equal(one, gemv(x, weight)), "the norm was applied"


def test_norm_gemv_checks_its_operands():
    from mstar_kernels.gemv import norm_gemv

    x = torch.randn(1, 64, device=DEVICE)
    with pytest.raises(AssertionError, match="x's width must be K"):
        norm_gemv(x, torch.ones(64, device=DEVICE), 1e-6, torch.randn(32, 48, device=DEVICE))


def test_gemv_on_a_strided_row_view():
    """Rows of a wider tensor (the last row of each sequence, as the runner gathers them)."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(4, 2 * 128, generator=gen).to(DEVICE)
    x = wide[:, :128]
    weight = torch.randn(96, 128, generator=gen).to(DEVICE)
    assert rel_err(gemv(x, weight), gemv_ref(x, weight)) < 1e-5


def test_blocks_cover_the_sms_and_bound_the_tile():
    assert gemv_blocks(1, 1024, 3072) == (1, 4096)  # 1,024 programs, each its whole weight row at once
    for rows, n, k in ((1, 1024, 2048), (3, 6144, 1024), (8, 151936, 1024), (2, 1280, 5120)):
        block_n, block_k = gemv_blocks(rows, n, k)
        assert block_n == 1 or n // block_n >= 4 * 132  # at least ~4 programs per SM
        assert block_k == 64 or block_k * block_n * (4 if rows == 3 else rows) <= TILE_ELEMENTS


def test_use_gemv_switches_the_projections_and_the_heads_unless_told_not_to(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 40_000, bias=False)).to(DEVICE)
    x = torch.randn(2, 64, device=DEVICE)
    want = model(x)
    assert use_gemv(model, 4) == 2  # the 40,000-wide head too (MSTAR_GEMV_HEADS unset: 1)
    assert isinstance(model[0], GemvLinear) and isinstance(model[1], GemvLinear)
    assert sorted(model[1].gemv_plan) == [1, 2, 3, 4]
    assert model[0].pdl_kind == "0"  # its name in the model: its kind for MSTAR_PDL_AHEAD_OF
    assert rel_err(model(x), want) < 1e-5  # rows <= 4: the kernel on CUDA (the eager op elsewhere)
    assert rel_err(model(torch.cat([x] * 4)), torch.cat([want] * 4)) < 1e-5  # 8 rows: F.linear
    monkeypatch.setenv("MSTAR_GEMV_HEADS", "0")
    assert use_gemv(model, 4) == 1
    assert model[1].gemv_plan == {} and sorted(model[0].gemv_plan) == [1, 2, 3, 4]  # the head: cuBLAS
    assert rel_err(model(x), want) < 1e-5
    monkeypatch.setenv("MSTAR_GEMV_HEADS", "yes")
    with pytest.raises(ValueError, match="MSTAR_GEMV_HEADS"):
        use_gemv(model, 4)
    with pytest.raises(ValueError, match="gemv rows"):
        use_gemv(model, 9)


def test_tune_keeps_the_kernel_only_where_it_won(monkeypatch, tmp_path):
    """`tune_gemv` with a stand-in timer: the kernel at (2, 1024) beats cuBLAS at one row only, so the plan keeps
    one row on the kernel with those blocks and hands 2-4 rows (3 rounds up to 4's decision) back to cuBLAS;
    the fused MLP's down projection is tuned as the SwiGLU prologue it would run."""
    import mstar_kernels.gemv as gemv_module
    from mstar_common.layers.mlp import GatedMLP

    calls = []
    real_gemv = gemv_module.gemv

    def recording_gemv(x, weight, bias=None, block_n=None, block_k=None, num_warps=None, swiglu=False,
                       num_stages=1, kind=None):
        calls.append((x.shape[0], (block_n, block_k), swiglu))
        return real_gemv(x, weight, bias, block_n, block_k, num_warps, swiglu=swiglu, num_stages=num_stages,
                         kind=kind)

    def timer(fns):
        assert len(fns) == 1  # a custom timer gets no cold copies
        calls.clear()
        fns[0]()
        if not calls:
            return 5.0  # cuBLAS
        rows, blocks, _ = calls[-1]
        return 3.0 if rows == 1 and blocks == (2, 1024) else 6.0

    monkeypatch.setattr(gemv_module, "gemv", recording_gemv)
    mlp = GatedMLP(96, 1024).to(DEVICE)
    mlp.fuse_gate_up()
    mlp.use_kernel = True
    model = torch.nn.Sequential(torch.nn.Linear(1024, 96), mlp).to(DEVICE)
    use_gemv(model, 4)
    cache = tmp_path / "gemv.json"
    records = tune_gemv(model, timer=timer, log=lambda line: None, cache=cache)
    assert model[0].gemv_plan == {1: (2, 1024)} and mlp.down_proj.gemv_plan == {1: (2, 1024)}
    assert mlp.gate_up_proj.gemv_plan == {}  # its K is 96: no candidate beats 5.0 there
    assert [(r["n"], r["k"], r["swiglu"], r["rows"]) for r in records] == [
        (96, 1024, False, 1), (96, 1024, False, 2), (96, 1024, False, 4),
        (96, 1024, True, 1), (96, 1024, True, 2), (96, 1024, True, 4),
        (2048, 96, False, 1), (2048, 96, False, 2), (2048, 96, False, 4)]
    x = torch.randn(1, 1024, device=DEVICE)
    assert rel_err(model[0](x), torch.nn.functional.linear(x, model[0].weight, model[0].bias)) < 1e-5

    # A second process on this machine: the cached decisions, no timing (a timer that would flip them is unused).
    use_gemv(model, 4)
    assert tune_gemv(model, timer=lambda fns: 0.0, log=lambda line: None, cache=cache) == []
    assert model[0].gemv_plan == {1: (2, 1024)} and mlp.gate_up_proj.gemv_plan == {}


def test_a_long_projection_takes_the_kernel_by_two_microseconds(monkeypatch, tmp_path):
    """The bar is 5% under cuBLAS or 2 us under it, whichever is less: a head-sized 75 us shape takes a setting
    timed at 72.5 us (3.3% faster), a 5 us shape keeps cuBLAS against 4.85 us (3% faster)."""
    import mstar_kernels.gemv as gemv_module

    calls = []
    real_gemv = gemv_module.gemv

    def recording_gemv(x, weight, bias=None, block_n=None, block_k=None, num_warps=None, swiglu=False,
                       num_stages=1, kind=None):
        calls.append((weight.shape[0], (block_n, block_k)))
        return real_gemv(x, weight, bias, block_n, block_k, num_warps, swiglu=swiglu, num_stages=num_stages,
                         kind=kind)

    def timer(fns):
        calls.clear()
        fns[0]()
        if not calls:
            return timings["cublas"]
        _, blocks = calls[-1]
        return timings["kernel"] if blocks == (2, 1024) else 2 * timings["cublas"]

    monkeypatch.setattr(gemv_module, "gemv", recording_gemv)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 96, bias=False)).to(DEVICE)
    for timings, plan in (({"cublas": 75.0, "kernel": 72.5}, {1: (2, 1024)}), ({"cublas": 5.0, "kernel": 4.85}, {})):
        use_gemv(model, 1)
        tune_gemv(model, timer=timer, log=lambda line: None, cache=tmp_path / f"{timings['cublas']}.json")
        assert model[0].gemv_plan == plan


def test_a_norm_fed_projection_takes_its_norm_inside_or_apart_as_timed(monkeypatch, tmp_path):
    """By default (MSTAR_NORM_GEMV unset: auto) a (norm, projection) pair that may run as one launch (`norm_gemv`)
    is timed three ways: norm kernel + cuBLAS, norm inside the kernel, norm kernel + plain kernel. The stand-in
    timer makes the norm inside win at one row and the norm apart at two; the layer then folds the norm at one row
    only, and a second process reads both decisions back from the cache."""
    import mstar_kernels.gemv as gemv_module
    from mstar_common.layers.decoder import DecoderLayer, DecoderLayerConfig

    forms = []
    real_gemv, real_norm_gemv = gemv_module.gemv, gemv_module.norm_gemv

    def recording_gemv(x, *args, **kwargs):
        forms.append(("apart", x.shape[0]))
        return real_gemv(x, *args, **kwargs)

    def recording_norm_gemv(x, *args, **kwargs):
        forms.append(("in", x.shape[0]))
        return real_norm_gemv(x, *args, **kwargs)

    def timer(fns):
        forms.clear()
        fns[0]()
        if not forms:
            return 5.0  # cuBLAS after the norm kernel
        form, rows = forms[-1]
        return 3.0 if (form, rows) in (("in", 1), ("apart", 2)) else 4.0

    monkeypatch.setattr(gemv_module, "gemv", recording_gemv)
    monkeypatch.setattr(gemv_module, "norm_gemv", recording_norm_gemv)
    monkeypatch.delenv("MSTAR_NORM_GEMV", raising=False)
    layer = DecoderLayer(DecoderLayerConfig(hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1,
                                            head_dim=32)).to(DEVICE)
    layer.self_attn.fuse_qkv()
    layer.mlp.fuse_gate_up()
    layer.norm_gemv = True
    use_gemv(layer, 2)
    assert layer.self_attn.qkv_proj.norm_apart == {1, 2}, "untuned, auto keeps the norm kernel"
    cache = tmp_path / "gemv.json"
    records = tune_gemv(layer, timer=timer, log=lambda line: None, cache=cache)
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    for linear in (qkv, gate_up):
        assert linear.gemv_plan.keys() == {1, 2} and linear.norm_apart == {2}
    assert layer.self_attn.o_proj.norm_apart == frozenset()  # not norm-fed
    assert {(r["n"], r["rows"]): r["norm_apart"] for r in records if r["norm"]} == {
        (128, 1): False, (128, 2): True, (256, 1): False, (256, 2): True}
    decisions = json.loads(cache.read_text())
    assert sorted(v["norm"] for k, v in decisions.items() if ":norm(in|apart)" in k) == ["apart", "apart", "in", "in"]

    # the layer: the norm inside the qkv projection's launch at one row, the norm kernel at two
    monkeypatch.setattr(GemvLinear, "gemv_blocks_for", lambda self, x: self.gemv_plan.get(x.shape[0]))
    for rows, folded in ((1, True), (2, False)):
        hidden, residual = torch.randn(rows, 64, device=DEVICE), torch.randn(rows, 64, device=DEVICE)
        out = layer._norm_project(layer.input_layernorm, qkv, hidden, residual)
        assert (out is not None) == folded
        if folded:
            ref = torch.nn.functional.linear(layer.input_layernorm(hidden, residual)[0], qkv.weight)
            assert rel_err(out[0], ref) < 1e-5 and torch.equal(out[1], hidden + residual)

    use_gemv(layer, 2)  # a second process: the same decisions from the cache, nothing timed
    assert tune_gemv(layer, timer=lambda fns: 0.0, log=lambda line: None, cache=cache) == []
    assert qkv.norm_apart == {2} and gate_up.gemv_plan.keys() == {1, 2}

    # MSTAR_NORM_GEMV=1: the norm inside wherever the kernel beats cuBLAS; the apart form is not timed
    monkeypatch.setenv("MSTAR_NORM_GEMV", "1")
    use_gemv(layer, 2)
    records = tune_gemv(layer, timer=timer, log=lambda line: None, cache=cache)
    assert [(r["rows"], r["norm_apart"]) for r in records if r["norm"]] == [(1, False), (2, False)] * 2
    assert qkv.norm_apart == frozenset() and qkv.gemv_plan.keys() == {1, 2}


def test_tune_keeps_cublas_on_a_near_tie(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(1024, 96)).to(DEVICE)
    use_gemv(model, 1)
    timer = iter([5.0] + [4.9] * 20).__next__  # cuBLAS first, then every kernel setting 2% faster
    tune_gemv(model, timer=lambda fns: timer(), log=lambda line: None, cache=tmp_path / "gemv.json")
    assert model[0].gemv_plan == {}


def test_a_step_timed_setting_in_the_cache_replaces_the_tuned_one(monkeypatch, tmp_path):
    """scripts/tune_step_gemv.py --write-cache stores settings that whole decode steps chose; `tune_gemv` then
    takes them over its own decision at that row count only (and logs it), and MSTAR_GEMV_STEP_PLANS=0 ignores
    them. The kernel runs with the stored setting and still computes the projection."""
    from mstar_common.layers import linear
    from mstar_common.layers.linear import step_setting_key, write_step_settings

    def timer(fns):  # (2, 1024) wins every row count timed alone
        return 3.0 if getattr(timer, "setting", None) == (2, 1024) else 6.0

    real_timed_calls = linear._timed_calls

    def recording(x, weights, bias, setting, *args, **kwargs):
        timer.setting = setting
        return real_timed_calls(x, weights, bias, setting, *args, **kwargs)

    monkeypatch.setattr(linear, "_timed_calls", recording)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 96)).to(DEVICE)
    cache = tmp_path / "gemv.json"
    write_step_settings(cache, {step_setting_key(model[0].weight, model[0].bias, 1): [1, 512]})
    use_gemv(model, 2)
    lines = []
    tune_gemv(model, timer=timer, log=lines.append, cache=cache)
    assert model[0].gemv_plan == {1: (1, 512), 2: (2, 1024)}
    assert any("step-timed setting (1, 512)" in line for line in lines)
    x = torch.randn(1, 1024, device=DEVICE)
    assert rel_err(model[0](x), torch.nn.functional.linear(x, model[0].weight, model[0].bias)) < 1e-5
    assert step_setting_key(model[0].weight, model[0].bias, 1) in json.loads(cache.read_text())  # kept on rewrite

    monkeypatch.setenv("MSTAR_GEMV_STEP_PLANS", "0")
    use_gemv(model, 2)
    assert tune_gemv(model, timer=lambda fns: 0.0, log=lambda line: None, cache=cache) == []  # all cached
    assert model[0].gemv_plan == {1: (2, 1024), 2: (2, 1024)}


def test_wide_candidates_are_tried_only_when_switched_on(monkeypatch, tmp_path):
    """MSTAR_GEMV_WIDE=1 (the default) adds the whole-K settings of GEMV_WIDE_CANDIDATES (8 and 16 columns,
    8 warps), within four tiles of products (so not at rows where they would exceed it), under a cache key of their
    own; MSTAR_GEMV_WIDE=0 leaves them out."""
    from mstar_common.layers import linear

    tried = []

    def timer(fns):
        return 5.0  # every setting ties cuBLAS: only the list of settings tried matters here

    real_timed_calls = linear._timed_calls

    def recording(x, weights, bias, setting, *args, **kwargs):
        tried.append((x.shape[0], setting))
        return real_timed_calls(x, weights, bias, setting, *args, **kwargs)

    monkeypatch.setattr(linear, "_timed_calls", recording)
    model = torch.nn.Sequential(torch.nn.Linear(3072, 96)).to(DEVICE)  # K 3072: whole K is 4096
    monkeypatch.setenv("MSTAR_GEMV_WIDE", "0")
    use_gemv(model, 2)
    tune_gemv(model, timer=timer, log=lambda line: None, cache=tmp_path / "gemv.json")
    assert not [s for _, s in tried if s is not None and s[1] == 4096 and s[2:] == (8, 1)]
    tried.clear()
    monkeypatch.delenv("MSTAR_GEMV_WIDE")  # the default
    use_gemv(model, 2)
    tune_gemv(model, timer=timer, log=lambda line: None, cache=tmp_path / "gemv.json")  # not answered from cache
    # one row: 8 x 4096 products fit in four tiles, 16 x 4096 do not; two rows: neither
    assert [(rows, s) for rows, s in tried if s is not None and s[2:] == (8, 1)] == [(1, (8, 4096, 8, 1))]
    keys = json.loads((tmp_path / "gemv.json").read_text())
    # on a PDL GPU the key reads ...:rows=1:pdl:wide:chained
    assert len([key for key in keys if ":rows=1:" in key and ":wide" in key]) == 1


def test_pdl_row_counts_are_timed_behind_a_norm_launch(monkeypatch):
    """At a row count that launches with PDL a projection is timed behind an RMSNorm launch that produces its
    input (both cuBLAS and the kernel), and decided under its own cache key; MSTAR_GEMV_CHAINED=0 times it alone."""
    import mstar_kernels._pdl as pdl
    import mstar_kernels.rmsnorm as rmsnorm
    from mstar_common.layers import linear

    w = torch.randn(96, 64, device=DEVICE)
    real_use_pdl = pdl.use_pdl
    monkeypatch.setattr(pdl, "use_pdl", lambda tensor, rows: rows == 1)
    assert linear._is_chained(w, 1, None) and not linear._is_chained(w, 2, None)
    assert not linear._is_chained(w, 1, norm=object()), "a projection with its norm inside is timed as it runs"
    monkeypatch.setenv("MSTAR_GEMV_CHAINED", "0")
    assert not linear._is_chained(w, 1, None)
    monkeypatch.setattr(pdl, "use_pdl", real_use_pdl)  # the launches below as this device runs them
    norms = []
    real = rmsnorm.rms_norm
    monkeypatch.setattr(rmsnorm, "rms_norm", lambda *a, **k: norms.append(a[0].shape) or real(*a, **k))
    x = torch.randn(1, 64, device=DEVICE)
    for setting in (None, (4, 64)):
        calls = linear._timed_calls(x, [w, w.clone()], None, setting, False, None, None, chained=True)
        outs = [call() for call in calls]
        ref = torch.nn.functional.linear(rmsnorm.rms_norm_ref(x, torch.ones(64, device=DEVICE), 1e-6), w)
        assert torch.allclose(outs[0], ref, atol=1e-3, rtol=1e-3)
    assert len(norms) == 4, "every timed call ran its norm first"


def test_the_environment_switch_is_checked(monkeypatch):
    from mstar_common.layers.linear import use_gemv_from_env

    model = torch.nn.Sequential(torch.nn.Linear(64, 96))
    for bad in ("9", "-1", "four"):
        monkeypatch.setenv("MSTAR_GEMV_MAX_ROWS", bad)
        with pytest.raises(ValueError, match="MSTAR_GEMV_MAX_ROWS: must be an integer in"):
            use_gemv_from_env(model)
    monkeypatch.setenv("MSTAR_GEMV_MAX_ROWS", "0")
    use_gemv_from_env(model)
    assert not isinstance(model[0], GemvLinear)
    monkeypatch.setenv("MSTAR_GEMV_MAX_ROWS", "2")
    use_gemv_from_env(model)  # on the CPU: switched with the default plan, never tuned (no CUDA timing)
    assert model[0].gemv_plan.keys() == {1, 2}


@pytest.mark.parametrize("setting", [(4, 64), (8, 64, 4, 3), (2, 128, 4, 2), (8, 512, 8, 1)])  # last: whole K
def test_pipelined_settings_give_the_reference(setting):
    """A tuned setting with a software-pipelined K loop (num_stages > 1) sums the same products as one without."""
    from mstar_kernels.gemv import gemv_with
    from mstar_kernels.silu_mul import silu_mul

    torch.manual_seed(3)
    x = torch.randn(2, 2 * 448, device=DEVICE)
    weight = torch.randn(40, 448, device=DEVICE)
    assert rel_err(gemv_with(x[:, :448].contiguous(), weight, None, setting), gemv_ref(x[:, :448], weight)) < 1e-5
    separate = gemv_with(silu_mul(x), weight, None, setting)
    assert rel_err(gemv_with(x, weight, None, setting, swiglu=True), separate) < 1e-5


def test_cold_copies_hold_enough_bytes():
    from mstar_common.bench.gpu_timing import MAX_COLD_COPIES, cold_copies

    weight = torch.ones(256, 1024, dtype=torch.bfloat16)  # 512 KiB
    copies = cold_copies(weight, min_bytes=3 << 20)
    assert len(copies) == 6 and copies[0] is weight
    assert len({c.data_ptr() for c in copies}) == 6 and all(torch.equal(c, weight) for c in copies)
    assert cold_copies(weight, min_bytes=1) == [weight]
    # a weight this small is timed on at most MAX_COLD_COPIES (one captured launch per copy)
    assert len(cold_copies(weight, min_bytes=1 << 30, max_copies=9)) == 9
    tiny = torch.ones(128, 64)  # 32 KiB: the bytes alone would ask for 8,192 copies
    assert len(cold_copies(tiny)) == MAX_COLD_COPIES


def test_forced_settings_replace_the_tuned_plan(monkeypatch):
    """MSTAR_GEMV_FORCE (an A/B switch): `1:8/0/8/1` puts every skinny-GEMM projection on 8 columns with its whole K
    at one row, cuBLAS decisions included (their norm then stays apart), and leaves other row counts alone; a bad
    value is refused, naming the switch and the rule."""
    from mstar_common.layers.linear import force_gemv_settings, forced_gemv_settings

    model = torch.nn.Sequential(torch.nn.Linear(3072, 96), torch.nn.Linear(1000, 64)).to(DEVICE)
    use_gemv(model, 2)
    model[0].gemv_plan = {2: (4, 1024)}  # as tuned: cuBLAS at one row, the kernel at two
    model[1].gemv_plan = {1: (2, 1024)}
    for linear in model:
        linear.norm_apart = frozenset()  # as tuned: any norm in front of them folded where they run the kernel
    monkeypatch.setenv("MSTAR_GEMV_FORCE", "1:8/0/8/1;4:2/64/4/3")
    forced = forced_gemv_settings()
    assert forced == {1: (8, 0, 8, 1), 4: (2, 64, 4, 3)}
    assert force_gemv_settings(model, forced, max_rows=2) == 2  # rows 4 is beyond use_gemv's 2
    assert model[0].gemv_plan == {1: (8, 4096, 8, 1), 2: (4, 1024)} and 1 in model[0].norm_apart
    assert model[1].gemv_plan == {1: (8, 1024, 8, 1)} and 1 not in model[1].norm_apart
    x = torch.randn(1, 1000, device=DEVICE)
    assert rel_err(model[1](x), torch.nn.functional.linear(x, model[1].weight, model[1].bias)) < 1e-5
    monkeypatch.delenv("MSTAR_GEMV_FORCE")
    assert forced_gemv_settings() == {}
    for bad in ("1:8/0/8", "9:8/0/8/1", "1:6/0/8/1", "1:8/100/8/1", "1:8/0/3/1", "x:8/0/8/1", "1,8/0/8/1"):
        monkeypatch.setenv("MSTAR_GEMV_FORCE", bad)
        with pytest.raises(ValueError, match="MSTAR_GEMV_FORCE=.*expected ROWS:BLOCK_N/BLOCK_K/WARPS/STAGES"):
            forced_gemv_settings()


class _RecordingKernel:
    """Stands in for mstar_kernels/gemv.py's `_gemv_kernel`: records each launch's and each compile-only call's
    specialization (argument dtypes and shapes, integer values, the constexprs and launch options) and hands the
    call on to the real kernel. `fail_warmup`: a compile-only call raises, as a failed compile would."""

    def __init__(self, real, fail_warmup: bool = False):
        self.real, self.fail_warmup, self.seen = real, fail_warmup, []

    @staticmethod
    def spec(args, meta) -> tuple:
        values = tuple((a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else a for a in args)
        return values, tuple(sorted(meta.items()))

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.seen.append(("launch", self.spec(args, meta)))
            return self.real[grid](*args, **meta)
        return launch

    def warmup(self, *args, grid, **meta):
        self.seen.append(("compile", self.spec(args, meta)))
        if self.fail_warmup:
            raise RuntimeError("compile failed")
        return self.real.warmup(*args, grid=grid, **meta)


@pytest.mark.parametrize("fail", [False, True])
def test_the_parallel_compile_covers_every_setting_the_tuning_times(monkeypatch, tmp_path, fail):
    """`tune_gemv(..., precompile=True)` (MSTAR_PARALLEL_COMPILE=1 on the GPU) first makes one compile-only call per
    setting and form it will time, and launches nothing then; every kernel the timing then launches was among those
    compiled (same dtypes, shapes, integers, constexprs and launch options), and the plan is the one taken without
    the pre-compile. A failing compile is logged and the tuning goes on to the same plan."""
    import mstar_kernels.gemv as gemv_module
    from mstar_common.layers.decoder import DecoderLayer, DecoderLayerConfig

    def timer(fns):
        before = len(kernel.seen)
        fns[0]()
        launches = [spec for what, spec in kernel.seen[before:] if what == "launch"]
        if not launches:
            return 5.0  # cuBLAS
        return 3.0 if dict(launches[-1][1])["BLOCK_N"] == 8 else 6.0  # the kernel wins with 8 columns a program

    plans = []
    for precompile in (False, True):
        kernel = _RecordingKernel(gemv_module._gemv_kernel, fail_warmup=fail and precompile)
        monkeypatch.setattr(gemv_module, "_gemv_kernel", kernel)
        torch.manual_seed(0)
        layer = DecoderLayer(DecoderLayerConfig(hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1,
                                                head_dim=32)).to(DEVICE)
        layer.self_attn.fuse_qkv()
        layer.mlp.fuse_gate_up()
        layer.mlp.use_kernel = True
        layer.norm_gemv = True
        use_gemv(layer, 2)
        lines = []
        tune_gemv(layer, timer=timer, log=lines.append,
                  cache=tmp_path / f"{precompile}-{fail}.json", precompile=precompile)
        plans.append({name: dict(m.gemv_plan) for name, m in layer.named_modules() if isinstance(m, GemvLinear)})
        compiled = [spec for what, spec in kernel.seen if what == "compile"]
        launched = [spec for what, spec in kernel.seen if what == "launch"]
        assert launched
        if not precompile:
            assert not compiled
            continue
        first_launch = next(i for i, (what, _) in enumerate(kernel.seen) if what == "launch")
        assert all(what == "compile" for what, _ in kernel.seen[:first_launch]), "nothing launches before the timing"
        if fail:
            assert len(compiled) == 1 and not any("compiled on" in line for line in lines)
        else:
            assert set(launched) <= set(compiled), "the timing launched a kernel the pre-compile did not compile"
            assert any("candidate calls compiled on" in line for line in lines)
    assert plans[0] == plans[1] and any(plans[0].values())
