"""The persistent-chain probe's kernel (scripts/probe_persistent_step.py) against its torch reference.

The probe's timing only means something if its one-launch chain computes what the launches compute. The
interpreter runs programs one after another, so there the grid is one program (its barriers wait for itself); on
a GPU it is up to two programs per SM, and the barrier's counters must be back at zero afterwards. The buffers
between the projections start as NaN, so a program that reads one before the barrier releases it fails the test.
The reference is the chain of mstar_kernels/gemv.py launches (the same sums; the torch ops round differently, and
without norms the difference grows with depth, so they are only a loose check).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.kernels.conftest import DEVICE, GPU_ONLY, IS_INTERPRETED

pytest.importorskip("triton")
pytestmark = GPU_ONLY

from mstar_common.cuda_build import nvcc  # noqa: E402
from mstar_kernels.gemv import gemv  # noqa: E402

_SPEC = importlib.util.spec_from_file_location(
    "probe_persistent_step", Path(__file__).resolve().parents[2] / "scripts" / "probe_persistent_step.py")
probe = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(probe)


@pytest.mark.parametrize("programs", [1] if IS_INTERPRETED else [1, 7, 264])
@pytest.mark.parametrize("block_n", [4] if IS_INTERPRETED else [2, 8])
@pytest.mark.parametrize("stages", [0, 3])  # the register form; the tensor-descriptor (TMA) form, 3 tiles deep
def test_the_persistent_chain_matches_the_reference(programs, block_n, stages):
    block_k = 32  # one K chunk for qkv and gate/up, two for o, three for down
    layers, hidden, q, kv, inter = 2, 32, 64, 32, 96
    h0, (wqkv, wo, wgu, wd) = probe.chain_case(hidden, q, kv, inter, layers, seed=3, device=DEVICE)
    h = h0.clone()
    qkv = torch.full((1, q + 2 * kv), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    o = torch.full((1, hidden), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    gu = torch.full((1, 2 * inter), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    sync = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    expect = probe._reference(h0, wqkv, wo, wgu, wd, q)
    launches = h0
    for layer in range(layers):  # the skinny-GEMV launches of the served step
        qkv_l = gemv(launches, wqkv[layer])
        launches = gemv(gemv(gemv(qkv_l[:, :q], wo[layer]), wgu[layer]), wd[layer], swiglu=True)
    first = None
    for _ in range(2):  # a second launch finds the counters at zero again and gives the same bits
        h.copy_(h0)
        mode = dict(poll=0 if programs in (1, 7) else 1, block_n=block_n, block_k=block_k, warps=4, stages=stages)
        probe.launch_chain((programs,), h, qkv, o, gu, wqkv, wo, wgu, wd, sync, layers, q, mode)
        assert probe._rel_err(h.float(), launches.float()) < 0.02
        assert probe._rel_err(h.float(), expect) < 0.1
        assert sync.tolist() == [0, 0]
        if first is not None:
            assert torch.equal(h, first)
        first = h.clone()


def _cuda_form_available() -> bool:
    if IS_INTERPRETED or not torch.cuda.is_available():
        return False
    try:
        nvcc()
    except RuntimeError:
        return False
    return True


CUDA_ONLY = pytest.mark.skipif(not _cuda_form_available(), reason="the CUDA form needs a GPU and nvcc")


def _cuda_chain_case(layers=2, q=512):
    """Shapes whose inputs are multiples of 256 wide, as the CUDA form takes."""
    return probe.chain_case(hidden=256, q=q, kv=256, inter=768, layers=layers, seed=5)


@CUDA_ONLY
@pytest.mark.parametrize("blocks", [7, 31, "sms"])  # one CTA would hold over 256 rows of a projection
@pytest.mark.parametrize("form", [dict(warps=32, unroll=2), dict(warps=32, unroll=4), dict(warps=16, unroll=8),
                                  dict(warps=4, unroll=4),  # registers
                                  dict(warps=32, ring=12), dict(warps=16, ring=16), dict(warps=4, ring=4),  # ring
                                  dict(warps=32, units=4), dict(warps=16, units=8), dict(warps=8, units=16),
                                  dict(warps=1, units=4),  # (row, K segment) units
                                  dict(warps=32, units=4, early=1), dict(warps=8, units=8, early=2),
                                  dict(warps=1, units=4, early=1), dict(warps=16, units=4, early=3),
                                  dict(warps=4, units=4, early=4)])  # first units copied two stages ahead
def test_the_cuda_chain_matches_the_launches(blocks, form):
    layers, q = 2, 512
    h0, (wqkv, wo, wgu, wd) = _cuda_chain_case(layers=layers, q=q)
    grid = (torch.cuda.get_device_properties(0).multi_processor_count if blocks == "sms" else blocks,)
    h = h0.clone()
    qkv = torch.full((1, wqkv.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    o = torch.full((1, wo.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    gu = torch.full((1, wgu.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    sync = torch.zeros(2, dtype=torch.int32, device="cuda")
    launches = h0
    for layer in range(layers):
        qkv_l = gemv(launches, wqkv[layer])
        launches = gemv(gemv(gemv(qkv_l[:, :q], wo[layer]), wgu[layer]), wd[layer], swiglu=True)
    expect = probe._reference(h0, wqkv, wo, wgu, wd, q)
    mode = dict(cuda=True, **form)
    for _ in range(2):  # the second launch finds the counters at zero again
        h.copy_(h0)
        probe.launch_chain(grid, h, qkv, o, gu, wqkv, wo, wgu, wd, sync, layers, q, mode)
        torch.cuda.synchronize()
        # The row sums add in shared memory in no fixed order, so the bits may differ from launch to launch.
        assert probe._rel_err(h.float(), launches.float()) < 0.02
        assert probe._rel_err(h.float(), expect) < 0.1
        assert sync.tolist() == [0, 0]
    # the intermediate buffers hold the last layer's values, not NaN
    assert torch.isfinite(qkv).all() and torch.isfinite(o).all() and torch.isfinite(gu).all()


@CUDA_ONLY
def test_the_cuda_chain_refuses_what_it_cannot_run():
    h0, (wqkv, wo, wgu, wd) = _cuda_chain_case()
    h, sync = h0.clone(), torch.zeros(2, dtype=torch.int32, device="cuda")
    qkv = torch.empty(1, wqkv.shape[1], dtype=torch.bfloat16, device="cuda")
    o = torch.empty(1, wo.shape[1], dtype=torch.bfloat16, device="cuda")
    gu = torch.empty(1, wgu.shape[1], dtype=torch.bfloat16, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    args = (h, qkv, o, gu, wqkv, wo, wgu, wd, sync, 2, 512)
    with pytest.raises(ValueError, match="more CTAs than the GPU holds"):  # would hang at its first barrier
        probe.launch_chain((sms * 4,), *args, dict(cuda=True, warps=32, unroll=4))
    with pytest.raises(ValueError, match="does not take"):
        probe.launch_chain((sms,), *args, dict(cuda=True, warps=32, unroll=8))  # 1,024 threads with unroll 8
    with pytest.raises(ValueError, match="does not take"):  # 16 slots x 1,024 threads: 256 KB of shared memory
        probe.launch_chain((sms,), *args, dict(cuda=True, warps=32, ring=16))
    with pytest.raises(ValueError, match="does not take"):  # 16 vectors per lane need at most 256 threads
        probe.launch_chain((sms,), *args, dict(cuda=True, warps=16, units=16))
    with pytest.raises(ValueError, match="does not take"):  # 2 x 32 warps x 4 units x 2 KB: over 227 KB
        probe.launch_chain((sms,), *args, dict(cuda=True, warps=32, units=4, early=4))
    h_odd = torch.empty(1, 320, dtype=torch.bfloat16, device="cuda")  # K = 320 is not a multiple of 256
    with pytest.raises(ValueError, match="does not take"):
        probe.launch_chain((sms,), h_odd, *args[1:], dict(cuda=True, warps=32, unroll=4))
    assert sync.tolist() == [0, 0]
