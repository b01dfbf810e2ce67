"""The persistent-chain probe's kernel (scripts/probe_persistent_step.py) against its torch reference.

The probe's timing only means something if its one-launch chain computes what the launches compute. The
interpreter runs programs one after another, so there the grid is one program (its barriers wait for itself); on
a GPU it is up to two programs per SM, and the barrier's counters must be back at zero afterwards. The buffers
between the projections start as NaN, so a program that reads one before the barrier releases it fails the test.
The reference is the chain of kernels/gemv.py launches (the same sums; the torch ops round differently, and
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

from kernels.gemv import gemv  # noqa: E402

_SPEC = importlib.util.spec_from_file_location(
    "probe_persistent_step", Path(__file__).resolve().parents[2] / "scripts" / "probe_persistent_step.py")
probe = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(probe)


@pytest.mark.parametrize("programs", [1] if IS_INTERPRETED else [1, 7, 264])
@pytest.mark.parametrize("block_n", [4] if IS_INTERPRETED else [2, 8])
@pytest.mark.parametrize("stages", [0, 3])  # the register form; the tensor-descriptor (TMA) form, 3 tiles deep
def test_the_persistent_chain_matches_the_reference(programs, block_n, stages):
    block_k = 32  # one K chunk for qkv and gate/up, two for o, three for down
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    layers, hidden, q, kv, inter = 2, 32, 64, 32, 96

    def weights(n, k):
        return (torch.randn(layers, n, k, device=DEVICE, generator=gen) / k ** 0.5).to(torch.bfloat16)

    wqkv, wo, wgu, wd = weights(q + 2 * kv, hidden), weights(hidden, q), weights(2 * inter, hidden), weights(hidden,
                                                                                                           inter)
    h0 = torch.randn(1, hidden, device=DEVICE, generator=gen).to(torch.bfloat16)
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
