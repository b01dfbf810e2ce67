"""The embedding lookup with the overlap gather inside (mstar_kernels/embedding.py) against the torch ops it replaces,
and the dense LM's embedding module switching to it."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, GPU_ONLY, sweep

triton = pytest.importorskip("triton")
pytestmark = GPU_ONLY

from mstar_common.layers.embedding import TokenEmbedding  # noqa: E402
from mstar_kernels.embedding import embed_tokens, embed_tokens_ref  # noqa: E402

# (vocab, hidden): Qwen3-0.6B, Llama-3.2-3B (three column chunks), odd sizes for the masks
SHAPES = sweep([(151936, 1024), (128256, 3072), (1000, 200)], [(1000, 200), (300, 1100)])


def _gather(tokens: int, rows: int, count: int, vocab: int, gen: torch.Generator):
    """A bucket of `rows` gather entries, the first `count` live: distinct packed destinations in shuffled order,
    each taking one of the previous step's `rows` tokens; the dead entries hold stale destinations."""
    dst = torch.randperm(tokens, generator=gen)[:rows].to(torch.int32)
    src = torch.randperm(rows, generator=gen).to(torch.int32)
    previous = torch.randint(0, vocab, (rows,), generator=gen, dtype=torch.int32)
    return dst, src, torch.tensor([count], dtype=torch.int32), previous


@pytest.mark.parametrize("vocab,hidden", SHAPES)
@pytest.mark.parametrize("tokens,rows,count", [(1, 1, 1), (1, 1, 0), (8, 8, 5), (40, 6, 6)])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_the_lookup_with_the_gather_equals_the_torch_ops(vocab, hidden, tokens, rows, count, id_dtype):
    gen = torch.Generator().manual_seed(vocab + hidden + tokens + count)
    weight = torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16).to(DEVICE)
    gather = _gather(tokens, rows, count, vocab, gen)
    ids = torch.randint(0, vocab, (tokens,), generator=gen).to(id_dtype)
    ids[gather[0][:count].long()] = -1  # placeholders where the live entries point
    ids, gather = ids.to(DEVICE), [t.to(DEVICE) for t in gather]
    want_ids = ids.clone()
    want = embed_tokens_ref(weight, want_ids, gather)
    assert (want_ids >= 0).all()  # every placeholder was a destination
    out = embed_tokens(weight, ids, gather)
    assert out.shape == (tokens, hidden) and out.dtype == weight.dtype
    assert torch.equal(out, want)  # a copy: the same bits
    assert torch.equal(ids, want_ids)  # the gathered ids were written back, the others left


@pytest.mark.parametrize("vocab,hidden", SHAPES)
def test_without_a_gather_it_is_the_lookup_and_a_bad_id_gives_zeros(vocab, hidden):
    gen = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, hidden, generator=gen).to(DEVICE)
    ids = torch.randint(0, vocab, (7,), generator=gen).to(DEVICE)
    assert torch.equal(embed_tokens(weight, ids), torch.nn.functional.embedding(ids, weight))
    bad = torch.tensor([vocab, -2, 0], device=DEVICE)
    out = embed_tokens(weight, bad)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.equal(out[2], weight[0])
    assert embed_tokens(weight, ids[:0]).shape == (0, hidden)


def test_the_module_runs_the_kernel_only_when_told_and_equals_the_reference(monkeypatch):
    from mstar_kernels import embedding as kernels

    calls = []
    monkeypatch.setattr(kernels, "embed_tokens", lambda *args: calls.append(1) or embed_tokens(*args))
    module = TokenEmbedding(500, 96).to(DEVICE)
    ids = torch.tensor([4, -1, 7, -1], dtype=torch.int32, device=DEVICE)
    # (dst, src, count, previous): two live entries, rows 3 and 1 take the previous step's tokens 1 and 0
    gather = [torch.tensor(values, dtype=torch.int32, device=DEVICE) for values in ([3, 1, 0], [1, 0, 2], [2],
                                                                                     [11, 22, 33])]
    want_ids = ids.clone()
    want = module(want_ids, gather)  # the torch ops
    assert want_ids.tolist() == [4, 11, 7, 22] and calls == []
    assert torch.equal(want, module.weight[want_ids.long()])
    module.use_kernel = True
    got_ids = ids.clone()
    assert torch.equal(module(got_ids, gather), want) and torch.equal(got_ids, want_ids)
    assert calls == [1]  # the kernel ran (on the CPU: in Triton's interpreter); the torch ops before it did not
