"""The sort-free top-k/top-p filter (mstar_kernels/top_k_top_p.py) against the engine's sorted form."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, GPU_ONLY, sweep

pytest.importorskip("triton")
pytestmark = GPU_ONLY

from mstar_kernels.top_k_top_p import top_k_top_p, top_k_top_p_ref  # noqa: E402


def _rows(vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.5, 1.0, 3.0, 8.0, 1.0, 2.0, 1.0, 4.0])[:, None]  # flat to peaked distributions
    logits = (torch.randn(8, vocab, generator=gen) * scales).to(DEVICE)
    top_k = torch.tensor([vocab, vocab, 50, vocab, 1, 7, vocab, 300], dtype=torch.int32, device=DEVICE)
    top_p = torch.tensor([0.8, 1.0, 0.9, 0.5, 0.9, 1.0, 0.05, 0.95], device=DEVICE)
    return logits, top_k, top_p


@pytest.mark.parametrize("vocab", sweep([28_672, 32_768, 1000], [1000, 333]))
def test_kept_sets_equal_the_sorted_form(vocab):
    logits, top_k, top_p = _rows(vocab, seed=vocab)
    out, ref = top_k_top_p(logits, top_k, top_p), top_k_top_p_ref(logits, top_k, top_p)
    kept, want = torch.isfinite(out), torch.isfinite(ref)
    assert torch.equal(kept, want), [int((kept != want)[r].sum()) for r in range(len(kept))]
    assert torch.equal(out[kept], logits[kept])  # kept logits pass through unchanged
    assert int(kept[1].sum()) == vocab and int(kept[4].sum()) == 1  # off keeps all; top_k=1 keeps the max


def test_masked_entries_and_a_padded_row_width():
    """Entries already at -inf (a logits window's masked tokens) stay out and do not count toward top-k."""
    logits, top_k, top_p = _rows(1000, seed=3)
    logits[:, :400] = float("-inf")
    out, ref = top_k_top_p(logits, top_k, top_p), top_k_top_p_ref(logits, top_k, top_p)
    assert torch.equal(torch.isfinite(out), torch.isfinite(ref))
    wide = torch.full((8, 1024), 5.0, device=DEVICE)
    wide[:, :1000] = logits
    assert torch.equal(top_k_top_p(wide[:, :1000], top_k, top_p), out)  # a strided view of a wider buffer


def test_refuses_a_vocabulary_past_the_register_row():
    with pytest.raises(AssertionError, match="at most 32768"):
        top_k_top_p(torch.zeros(1, 40_000, device=DEVICE), torch.tensor([5], device=DEVICE),
                    torch.tensor([0.9], device=DEVICE))
