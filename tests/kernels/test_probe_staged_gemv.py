"""scripts/probe_staged_gemv.cu (one-row GEMV with its weights copied into shared memory ahead of the PDL wait)
against torch, and its forms against each other: the probe's timings only mean something if every form computes
the same projection. Needs a Hopper-or-newer GPU and nvcc (the probe builds the kernel); skipped otherwise."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mstar_common.cuda_build import nvcc

pytestmark = pytest.mark.gpu

_SPEC = importlib.util.spec_from_file_location(
    "probe_staged_gemv", Path(__file__).resolve().parents[2] / "scripts" / "probe_staged_gemv.py")
probe = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(probe)


@pytest.fixture(scope="module")
def lib():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a CUDA GPU of compute capability >= 9.0")
    try:
        nvcc()
    except RuntimeError:
        pytest.skip("needs nvcc")
    return probe.cuda_library()


@pytest.mark.parametrize("n,k,cols", [(4096, 1024, 16), (1024, 3072, 8), (1000, 2048, 24), (8, 8192, 1)])
@pytest.mark.parametrize("mode,first", [(0, 1), (1, 0), (1, 1), (3, 1)])
def test_one_projection_matches_torch(lib, n, k, cols, mode, first):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    x = torch.randn(k, device="cuda", generator=gen).bfloat16()
    out = torch.full((n + 8,), float("nan"), device="cuda", dtype=torch.bfloat16)  # 8 past the end stay NaN
    probe.staged_gemv(lib, weight, x, out, cols, mode, first)
    torch.cuda.synchronize()
    ref = weight.float() @ x.float()
    assert float((out[:n].float() - ref).norm() / ref.norm()) < 4e-3  # bf16 output rounding
    assert torch.isnan(out[n:]).all()


def test_a_shape_the_kernel_does_not_take_is_refused(lib):
    weight = torch.zeros(16, 12, device="cuda", dtype=torch.bfloat16)  # K not a multiple of 8
    x = torch.zeros(12, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="failed: -1"):
        probe.staged_gemv(lib, weight, x, torch.empty(16, device="cuda", dtype=torch.bfloat16), 8, 1, 1)


def test_the_chain_forms_give_the_same_bits_replayed(lib):
    chain = probe.Chain("qwen3", layers=3, seed=5)
    results = {}
    for name, (mode, first) in probe.CUDA_FORMS.items():
        for buf in chain.bufs:
            buf.fill_(float("nan"))
        graph, out = probe.graph_of(chain, probe._cuda_project(lib, chain, [16, 8, 16, 8], mode, first))
        graph.replay()
        torch.cuda.synchronize()
        results[name] = out.clone()
    eager = chain.run(probe._cuda_project(lib, chain, [16, 8, 16, 8], 0, 1)).clone()
    assert torch.isfinite(eager).all()
    for out in results.values():
        assert torch.equal(out, eager)
