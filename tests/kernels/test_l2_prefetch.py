"""kernels/l2_prefetch.py: the chunk plan (CPU), the switch, and the prefetch kernel on a Hopper GPU (eager and
inside a captured graph, forked to its side stream and joined back)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import IS_INTERPRETED


def _kernels():
    pytest.importorskip("triton")
    import kernels.l2_prefetch

    return kernels.l2_prefetch


def test_chunks_cover_each_range_and_end_at_its_end():
    k = _kernels()
    BLOCK, CHUNK, chunk_addresses = k.BLOCK, k.CHUNK, k.chunk_addresses
    ranges = [(0x10000, 3 * CHUNK + 4096), (0x900000, CHUNK), (0x2000000, 1024)]
    starts = chunk_addresses(ranges)
    assert len(starts) % BLOCK == 0
    first = [a for a in starts if 0x10000 <= a < 0x900000]
    assert sorted(set(first)) == [0x10000, 0x10000 + CHUNK, 0x10000 + 2 * CHUNK, 0x10000 + 3 * CHUNK + 4096 - CHUNK]
    assert 0x900000 in starts
    assert all(not 0x2000000 <= a < 0x2000000 + 1024 for a in starts), "a range under one chunk is skipped"
    covered = set()
    for start in starts:
        covered.update(range(start, start + CHUNK, 16))
    assert set(range(0x10000, 0x10000 + 3 * CHUNK + 4096, 16)) <= covered
    assert max(starts) + CHUNK <= 0x900000 + CHUNK, "no chunk runs past its range"
    assert chunk_addresses([]) == []


def test_unaligned_ranges_are_refused():
    k = _kernels()
    CHUNK, chunk_addresses = k.CHUNK, k.chunk_addresses
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        chunk_addresses([(0x10008, 2 * CHUNK)])


def test_the_switch_is_off_on_the_cpu_and_names_are_checked(monkeypatch, tmp_path):
    from mstar_common.engine.cuda_graph import l2_prefetch_from_env
    from mstar_common.families.qwen3.loader import load_qwen3
    from mstar_common.families.qwen3.tiny import build_tiny_checkpoint

    model, _ = load_qwen3(build_tiny_checkpoint(tmp_path / "tiny"), dtype="float32", device="cpu")
    monkeypatch.setenv("MSTAR_L2_PREFETCH", "1")
    assert not l2_prefetch_from_env(model, fused=True) and model.model.l2_prefetch is None
    monkeypatch.setenv("MSTAR_L2_PREFETCH_SET", "qkv,mlp")
    with pytest.raises(ValueError, match=r"MSTAR_L2_PREFETCH_SET: unknown projections \['mlp'\]"):
        l2_prefetch_from_env(model, fused=True)


@pytest.mark.gpu
@pytest.mark.skipif(IS_INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefetch_runs_eager_and_captured_and_changes_nothing():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cp.async.bulk.prefetch needs compute capability >= 9.0")
    L2Prefetcher = _kernels().L2Prefetcher
    weights = [torch.randn(n, 1024, device="cuda", dtype=torch.bfloat16) for n in (4096, 1024, 300)]
    before = [w.clone() for w in weights]
    prefetcher = L2Prefetcher([[weights[0]], [weights[1], weights[2]], []], torch.device("cuda"))
    assert prefetcher.nbytes[0] == weights[0].numel() * 2 and prefetcher.nbytes[2] == 0
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)

    def step():
        outs = []
        for slot, w in enumerate(weights):
            prefetcher.issue(slot)
            outs.append(x @ w.T)
        prefetcher.join()
        return outs

    eager = step()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, captured, strict=True))
    assert all(torch.equal(w, b) for w, b in zip(weights, before, strict=True))
