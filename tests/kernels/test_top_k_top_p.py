"""The sort-free top-k/top-p filter (mstar_kernels/top_k_top_p.py) against the engine's sorted form: the
register-resident row up to 32,768 logits, and the chunked search that wider rows (an LM's whole vocabulary) take."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, GPU_ONLY, sweep

pytest.importorskip("triton")
pytestmark = GPU_ONLY

from mstar_kernels.top_k_top_p import (  # noqa: E402
    FAST_CAP,
    FAST_CAP_CHUNK,
    MAX_VOCAB,
    ChunkedSearch,
    search_groups,
    search_steps,
    top_k_top_p,
    top_k_top_p_chunked,
    top_k_top_p_ref,
)


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


def _assert_same_or_at_the_top_p_boundary(out, ref, logits, top_k, top_p):
    """Kept sets equal, except single tokens whose fp64 probability mass ranked above them (over what top-k kept)
    lies within rounding of top_p: there the two forms add in different orders and either answer is exact."""
    kept, want = torch.isfinite(out), torch.isfinite(ref)
    assert torch.equal(out[kept], logits[kept])  # kept logits pass through unchanged
    top_k_only = torch.isfinite(top_k_top_p_ref(logits, top_k, torch.ones_like(top_p))).cpu()
    for row in range(len(kept)):
        differing = (kept[row] != want[row]).nonzero().flatten().tolist()
        assert len(differing) <= 2, (row, len(differing))
        if differing:
            x = logits[row].double().cpu().masked_fill(~top_k_only[row], float("-inf"))
            probs = torch.softmax(x, -1)
            for token in differing:
                mass_above = float(probs[probs > probs[token]].sum())
                assert abs(mass_above - float(top_p[row])) < 2e-5, (row, token, mass_above, float(top_p[row]))


def test_refuses_nothing_wide_and_takes_few_launches_a_search():
    assert MAX_VOCAB == 32768 and search_steps() == 8  # 31 bisection passes become 8 launches of 16 candidates
    assert search_steps(1) == 0 and search_steps(17) == 2 and search_steps(16) == 1


@pytest.mark.parametrize("vocab", sweep([1000, 28_672, 32_768], [1000, 5000]))
def test_the_chunked_search_keeps_what_the_register_row_keeps(vocab):
    """The same two searches, as one program per row and as launches over chunks: the same kept sets."""
    logits, top_k, top_p = _rows(vocab, seed=vocab + 1)
    out = top_k_top_p_chunked(logits, top_k, top_p)
    _assert_same_or_at_the_top_p_boundary(out, top_k_top_p(logits, top_k, top_p), logits, top_k, top_p)
    _assert_same_or_at_the_top_p_boundary(out, top_k_top_p_ref(logits, top_k, top_p), logits, top_k, top_p)
    kept = torch.isfinite(out)
    assert int(kept[1].sum()) == vocab and int(kept[4].sum()) == 1 and int(kept[5].sum()) == 7  # top-k alone


@pytest.mark.parametrize("vocab", sweep([151_936, 128_256, 32_769], [33_000]))
def test_wide_vocabularies_take_the_chunked_search(vocab):
    """Past the register row (Qwen3's and Llama-3's vocabularies): the sorted form's kept sets, -inf entries
    left out and uncounted, and a row with both filters off passed through whole."""
    logits, top_k, top_p = _rows(vocab, seed=7)
    logits[2, : vocab // 3] = float("-inf")
    out = top_k_top_p(logits, top_k, top_p)
    _assert_same_or_at_the_top_p_boundary(out, top_k_top_p_ref(logits, top_k, top_p), logits, top_k, top_p)
    kept = torch.isfinite(out)
    assert torch.equal(out[1], logits[1]) and int(kept[4].sum()) == 1 and int(kept[5].sum()) == 7
    assert not kept[2, : vocab // 3].any()


@pytest.mark.parametrize("programs", [1, 14, 1000])
def test_a_search_launch_over_chunk_groups_keeps_what_one_program_a_chunk_keeps(programs, monkeypatch):
    """`MSTAR_SEARCH_PROGRAMS`: each of a row's programs loops over every `groups`-th chunk (1 program a row; 2;
    one a chunk), with every row sent through the search: bit-equal kept sets."""
    vocab = sweep(151_936, 33_000)
    logits, top_k, top_p = _rows(vocab, seed=3)
    expected = top_k_top_p_chunked(logits, top_k, top_p, fast=False)
    monkeypatch.setenv("MSTAR_SEARCH_PROGRAMS", str(programs))
    got = top_k_top_p_chunked(logits, top_k, top_p, fast=False)
    assert torch.equal(got, expected)


def test_search_groups_spread_and_refusal(monkeypatch):
    """The launch's programs a row: `MSTAR_SEARCH_PROGRAMS` over the rows, capped at one a chunk; 0 or (off CUDA)
    unset, one a chunk; on CUDA unset, 8 a multiprocessor; a malformed value is refused with its name."""
    cpu = torch.device("cpu")
    monkeypatch.delenv("MSTAR_SEARCH_PROGRAMS", raising=False)
    assert search_groups(64, 38, cpu) == 38
    if DEVICE == "cuda":
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert search_groups(64, 38, torch.device("cuda")) == min(38, -(-8 * sms // 64))
    for raw, rows, groups in [("0", 64, 38), ("1000", 64, 16), ("1000", 1, 38), ("1", 256, 1), ("264", 64, 5)]:
        monkeypatch.setenv("MSTAR_SEARCH_PROGRAMS", raw)
        assert search_groups(rows, 38, cpu) == groups
    monkeypatch.setenv("MSTAR_SEARCH_PROGRAMS", "-3")
    with pytest.raises(ValueError, match="MSTAR_SEARCH_PROGRAMS='-3'"):
        search_groups(64, 38, cpu)


def _search(logits, top_k, top_p):
    search = ChunkedSearch(logits, fast=True)
    ones = torch.ones(len(logits), device=logits.device)
    search.run(ones, top_k, top_p, torch.zeros_like(ones))
    return search


@pytest.mark.parametrize("vocab", sweep([151_936, 33_000], [33_000]))
def test_the_fast_path_finishes_the_rows_whose_cut_tokens_it_gathers(vocab):
    """Top-k up to one per 128 columns, and top-p over a peaked distribution, are cut from the few tokens at or
    above a bound taken from the blocks' maxima; the rest (a flat top-p row; top-k 300 at 33,000 columns, past its
    258 blocks of 128) take the search's launches. Either way the kept sets are the search's and the sorted
    form's."""
    logits, top_k, top_p = _rows(vocab, seed=11)
    done = _search(logits, top_k, top_p).done.tolist()
    assert done == [0, 0, 1, 1, 1, 1, 0, int(vocab >= 300 * 128)], done
    fast = top_k_top_p_chunked(logits, top_k, top_p, fast=True)
    chain = top_k_top_p_chunked(logits, top_k, top_p, fast=False)
    _assert_same_or_at_the_top_p_boundary(fast, chain, logits, top_k, top_p)
    _assert_same_or_at_the_top_p_boundary(fast, top_k_top_p_ref(logits, top_k, top_p), logits, top_k, top_p)
    temperature = torch.full((8,), 0.7, device=DEVICE)  # the cuts are taken on the tempered logits
    fast = top_k_top_p_chunked(logits, top_k, top_p, temperature=temperature, fast=True)
    chain = top_k_top_p_chunked(logits, top_k, top_p, temperature=temperature, fast=False)
    _assert_same_or_at_the_top_p_boundary(fast, chain, logits / temperature[:, None], top_k, top_p)


@pytest.mark.parametrize("vocab", sweep([151_936, 33_000], [33_000]))
def test_a_top_k_past_half_the_blocks_is_bounded_by_the_128_column_maxima(vocab):
    """A top-k above half the row's 512-column blocks (33 of 65 at 33,000 columns, 149 of 297 at 151,936) takes
    its bound from the 128-column blocks: the k-th largest of their maxima, which fewer tokens reach than the
    k-th largest of the 512-column maxima, so the row is cut on the fast path up to k = one per 128 columns
    (1,187 at 151,936), where the 512-column bound stopped at one per 512. Past that the search cuts it."""
    blocks, fine = -(-vocab // 512), -(-vocab // 128)
    ks = [blocks // 2, blocks // 2 + 1, blocks, fine // 3, fine + 1]
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(len(ks), vocab, generator=gen) * torch.tensor([1.0, 1.0, 2.0, 1.0, 1.0])[:, None])
    logits = logits.to(DEVICE)
    top_k = torch.tensor(ks, dtype=torch.int32, device=DEVICE)
    top_p = torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0], device=DEVICE)
    search = _search(logits, top_k, top_p)
    padded = torch.nn.functional.pad(logits, (0, -vocab % 512), value=float("-inf")).cpu()
    for row, (k, size) in enumerate(zip(ks, [512, 128, 128, 128, 128], strict=True)):
        maxima = padded[row].view(-1, size).max(dim=1).values
        e = torch.exp(maxima - maxima.max())
        want = float(e.topk(k).values[-1]) if k <= len(e) else 0.0
        assert float(search.bound[row]) == pytest.approx(want, rel=1e-5, abs=0.0), (row, k, size)
    assert search.done.tolist() == [1, 1, 1, 1, 0]
    fast = top_k_top_p_chunked(logits, top_k, top_p, fast=True)
    chain = top_k_top_p_chunked(logits, top_k, top_p, fast=False)
    _assert_same_or_at_the_top_p_boundary(fast, chain, logits, top_k, top_p)
    assert torch.isfinite(fast).sum(dim=1).tolist()[:2] == ks[:2]


@pytest.mark.parametrize("vocab", sweep([151_936, 33_000], [33_000]))
def test_a_chunk_crowded_with_likely_tokens_keeps_only_its_own_top_k(vocab):
    """Logits that fall with the column (a vocabulary ordered by frequency) crowd the first chunk with tokens above
    the blocks' bound; under top-k that chunk keeps only its own k largest (the row's k-th largest cannot be below
    its k-th), so the row is still cut on the fast path, with the search's kept sets."""
    gen = torch.Generator().manual_seed(2)
    columns = torch.arange(vocab, dtype=torch.float32)
    logits = (torch.randn(4, vocab, generator=gen) - torch.tensor([0.5, 1.0, 1.5, 1.0])[:, None] * torch.log1p(columns))
    logits = logits.to(DEVICE)
    top_k = torch.tensor([50, 20, 60, 20], dtype=torch.int32, device=DEVICE)  # at most one per 512 columns
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.8], device=DEVICE)
    search = _search(logits, top_k, top_p)
    assert search.done.tolist() == [1, 1, 1, 1]
    assert int(search.counts[:, 0].max()) <= FAST_CAP_CHUNK
    fast = top_k_top_p_chunked(logits, top_k, top_p, fast=True)
    chain = top_k_top_p_chunked(logits, top_k, top_p, fast=False)
    _assert_same_or_at_the_top_p_boundary(fast, chain, logits, top_k, top_p)
    assert torch.isfinite(fast).sum(dim=1).tolist()[:3] == [50, 20, 60]


def test_tokens_tied_across_a_cut_all_stay_on_the_fast_path():
    """Four tokens tied at the top, where top-p 0.3 or top-k 2 cuts inside the group: the fast path's sort puts
    part of the group's mass before some of its tokens, yet keeps all four (no token has mass strictly above it,
    or more than one token above it), as the search does."""
    vocab = 33_000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(6)) * 0.5 - 10.0
    tied = [100, 700, 1300, 1900]
    logits[:, tied] = 5.0
    logits = logits.to(DEVICE)
    top_k = torch.tensor([vocab, 2], dtype=torch.int32, device=DEVICE)
    top_p = torch.tensor([0.3, 1.0], device=DEVICE)
    assert _search(logits, top_k, top_p).done.tolist() == [1, 1]
    for fast in (True, False):
        kept = torch.isfinite(top_k_top_p_chunked(logits, top_k, top_p, fast=fast))
        assert kept.sum(dim=1).tolist() == [4, 4] and bool(kept[:, tied].all()), fast


def test_rows_whose_gathered_tokens_overflow_are_left_to_the_search():
    """More tokens at or above the bound than a chunk's slots (200 ties in one chunk, all of them its own k-th
    largest), or than a row's (120 ties in each of 9 chunks): the search cuts them, and every tie with the k-th
    largest stays."""
    vocab = 33_000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    logits[0, 100:300] = 10.0
    for chunk in range(9):
        logits[1, chunk * 4096 : chunk * 4096 + 120] = 10.0
    assert 200 > FAST_CAP_CHUNK and 9 * 120 > FAST_CAP >= 120
    top_k = torch.tensor([60, 60], dtype=torch.int32, device=DEVICE)
    top_p = torch.tensor([1.0, 0.9], device=DEVICE)
    search = _search(logits, top_k, top_p)
    assert search.done.tolist() == [0, 0] and float(search.bound.min()) > 0.0  # bounded, then overflowed
    kept = torch.isfinite(top_k_top_p_chunked(logits, top_k, top_p)).sum(dim=1).tolist()
    assert kept == [200, 9 * 120], kept
