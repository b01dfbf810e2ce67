"""The persistent MLP-half kernel (mstar_kernels/fused_mlp.py) against the eager ops and against the launches it
replaces.

On the CPU (interpreter) its two phases run as two launches; on a GPU as one launch with the grid barrier, which is
the point of the kernel, and as two launches, which must give the same bits (the barrier only decides when phase 2
may read phase 1's output).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, GPU_ONLY, IS_INTERPRETED, rel_err, sweep

pytest.importorskip("triton")
pytestmark = GPU_ONLY

from mstar_kernels.fused_mlp import fused_mlp, fused_mlp_ref, new_sync  # noqa: E402
from mstar_kernels.gemv import gemv, norm_gemv  # noqa: E402

# (hidden, intermediate): Qwen3-0.6B, Llama-3.2-3B; odd sizes for the masks
SHAPES = sweep([(1024, 3072), (3072, 8192), (1000, 1500)], [(64, 128), (40, 72)])
EPS = 1e-6


def _inputs(hidden, inter, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).to(DEVICE)
    residual = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16).to(DEVICE)
    gate_up = (torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5).to(torch.bfloat16).to(DEVICE)
    down = (torch.randn(hidden, inter, generator=gen) / inter**0.5).to(torch.bfloat16).to(DEVICE)
    return x, residual, norm_w, gate_up, down


@pytest.mark.parametrize("hidden,inter", SHAPES)
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("with_residual", [True, False])
def test_fused_mlp_matches_the_eager_ops(hidden, inter, rows, with_residual):
    x, residual, norm_w, gate_up, down = _inputs(hidden, inter, rows, hidden + inter + rows)
    sync = new_sync(DEVICE)
    out, h = fused_mlp(x, residual if with_residual else None, norm_w, EPS, gate_up, down, sync)
    ref, ref_h = fused_mlp_ref(x, residual if with_residual else None, norm_w, EPS, gate_up, down)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(h, ref_h)  # the residual stream: one rounded add, written whole by block 0's program
    assert rel_err(out, ref) < (3e-2 if IS_INTERPRETED else 1e-2)
    assert torch.equal(sync.cpu(), torch.zeros(2, dtype=torch.int32))  # handed back for the next launch
    if with_residual:
        assert h.data_ptr() != residual.data_ptr()  # a new tensor: other programs may still read the old one


def test_fused_mlp_equals_the_launches_it_replaces():
    """norm_gemv (gate/up) then gemv(swiglu), each with the whole K per block and the same columns per block as
    the fused kernel's programs: the same products and sums; on the GPU mostly the very same bits."""
    hidden, inter = sweep([(1024, 2048)], [(64, 128)])[0]
    x, residual, norm_w, gate_up, down = _inputs(hidden, inter, 1, 7)
    programs = hidden // 16
    block_n1, block_n2 = 2 * inter // programs, hidden // programs  # whole columns per program, as gemv's blocks
    out, h = fused_mlp(x, residual, norm_w, EPS, gate_up, down, new_sync(DEVICE), programs=programs,
                       block_n=(block_n1, block_n2))
    a, h2 = norm_gemv(x, norm_w, EPS, gate_up, None, residual, block_n=block_n1, block_k=hidden, num_warps=8)
    expected = gemv(a, down, None, block_n2, inter, num_warps=8, swiglu=True)
    assert torch.equal(h, h2)
    assert rel_err(out, expected) < 1e-2
    assert (out != expected).float().mean() < 0.05


@pytest.mark.skipif(IS_INTERPRETED, reason="one launch with the grid barrier needs a GPU")
@pytest.mark.parametrize("programs", [None, 7])
def test_one_launch_equals_two_and_replays_in_a_graph(programs):
    """The barrier version against the two-launch version, eager and replayed from a captured graph (the counters
    come back to zero after every launch, so each replay passes its barrier exactly once)."""
    x, residual, norm_w, gate_up, down = _inputs(1024, 3072, 1, 11)
    sync = new_sync(DEVICE)
    two, h_two = fused_mlp(x, residual, norm_w, EPS, gate_up, down, sync, split=True, programs=programs)
    one, h_one = fused_mlp(x, residual, norm_w, EPS, gate_up, down, sync, split=False, programs=programs)
    assert torch.equal(one, two) and torch.equal(h_one, h_two)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fused_mlp(x, residual, norm_w, EPS, gate_up, down, sync, programs=programs)  # compile outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = [fused_mlp(x, residual, norm_w, EPS, gate_up, down, sync, programs=programs) for _ in range(3)]
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    for out, h in outs:
        assert torch.equal(out, two) and torch.equal(h, h_two)
    assert torch.equal(sync.cpu(), torch.zeros(2, dtype=torch.int32))


def test_fused_mlp_refuses_a_bad_shape():
    x, residual, norm_w, gate_up, down = _inputs(*SHAPES[0], 1, 3)
    with pytest.raises(AssertionError):
        fused_mlp(x, residual, norm_w, EPS, gate_up[:-2], down, new_sync(DEVICE))
    with pytest.raises(AssertionError, match="M <= 8"):
        fused_mlp(x.expand(9, -1).contiguous(), None, norm_w, EPS, gate_up, down, new_sync(DEVICE))
