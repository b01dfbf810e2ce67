"""Paged decode and ragged/paged prefill attention kernels vs plain-torch references."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, GPU_ONLY, IS_INTERPRETED, rel_err, sweep

pytest.importorskip("triton")
pytestmark = GPU_ONLY

from mstar_kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from mstar_kernels.paged_prefill_attention import (  # noqa: E402
    build_prefill_work,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    prefill_work_capacity,
)

# (head_dim, num_heads, num_kv_heads): MHA, GQA 2 (Qwen3-0.6B), GQA 3 (Llama-3.2-3B), GQA 4, MQA
HEADS = sweep([(128, 16, 8), (128, 24, 8), (64, 8, 8), (64, 16, 4), (128, 8, 1)], [(64, 4, 2), (128, 6, 2)])
PAGE_SIZE = 16
# Each page size is a separate compiled kernel: the other sizes are swept on one head layout.
OTHER_PAGES = sweep([(128, 16, 8, 1), (128, 16, 8, 64), (128, 24, 8, 128)], [(64, 4, 2, 4)])
CASES = [(*heads, PAGE_SIZE) for heads in HEADS] + OTHER_PAGES
# The interpreter's tl.dot mishandles bf16 (it multiplies the raw bits), so on the CPU only fp32 is checked.
DTYPES = sweep([torch.bfloat16], [torch.float32])


def _pool(lengths, page_size, num_kv_heads, head_dim, dtype, gen):
    """A shuffled paged pool holding one random context per row; returns caches and int32 block tables."""
    pages_per_row = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per_row) + 3
    perm = torch.randperm(num_pages, generator=gen).tolist()
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    width = max(pages_per_row) + 2
    tables, used = [], 0
    for n in pages_per_row:
        row = perm[used:used + n]
        used += n
        tables.append(row + [perm[-1]] * (width - n))  # padding points at an unused page
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,page_size", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_matches_reference(head_dim, num_heads, num_kv_heads, page_size, dtype):
    gen = torch.Generator().manual_seed(head_dim * 7 + page_size)
    lengths = sweep([1, 17, 64, 65, 300, 1000, 4097], [1, 17, 70])
    k_cache, v_cache, tables = _pool(lengths, page_size, num_kv_heads, head_dim, dtype, gen)
    query = torch.randn(len(lengths), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    ctx = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    ref = paged_decode_attention_ref(query, k_cache, v_cache, tables, ctx, scale)
    for splits in sweep([None, 1, 8], [1, 4]):
        out = paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale, num_splits=splits)
        assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2), splits
        out = paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale, num_splits=splits,
                                     tokens_major=True)
        assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2), ("tokens major", splits)


def test_decode_merge_reads_only_the_splits_that_ran():
    """Splits past a row's context write no partials, so the merge must not read their (uninitialised) slots:
    with deterministic algorithms torch fills `torch.empty` with NaN, which would reach the output."""
    gen = torch.Generator().manual_seed(5)
    dtype = DTYPES[0]
    lengths = [1, 40, 64, 65, 130]  # at 32 splits of 64 tokens: 1, 1, 1, 2 and 3 splits hold context
    k_cache, v_cache, tables = _pool(lengths, 64, 2, 64, dtype, gen)
    query = torch.randn(len(lengths), 4, 64, generator=gen).to(dtype).to(DEVICE)
    ctx = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    ref = paged_decode_attention_ref(query, k_cache, v_cache, tables, ctx, 0.125)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for tokens_major in (False, True):
            out = paged_decode_attention(query, k_cache, v_cache, tables, ctx, 0.125, num_splits=32,
                                         tokens_major=tokens_major)
            assert not out.isnan().any()
            assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2), tokens_major
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.mark.parametrize("form", ["registers", "L2"])
@pytest.mark.parametrize("pool", ["model", "fp8"])
def test_decode_with_the_first_block_prefetched_gives_the_same_bits(pool, form):
    """`prefetch` (under PDL: the first block loaded before the wait, the newest token put into it after) must
    give the bits of the plain loop: the newest token in a split's first block, in a later block, alone in its
    split, at 1 to 32 splits. A prefetched block that lost the newest token (or kept the pool's stale row) would
    change the output. `prefetch_l2` (the block asked of L2 ahead of the wait; a no-op in the interpreter, which
    runs no PTX) must too: its addresses are computed from the same block tables, and a bad one faults on the
    GPU."""
    gen = torch.Generator().manual_seed(11)
    dtype = DTYPES[0]
    lengths = [1, 17, 64, 65, 130, 641]
    k_cache, v_cache, tables = _pool(lengths, PAGE_SIZE, 2, 64, dtype, gen)
    fp16_dots = False
    if pool == "fp8":
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        fp16_dots = dtype == torch.bfloat16
    query = torch.randn(len(lengths), 8, 64, generator=gen).to(dtype).to(DEVICE)
    ctx = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    for splits in sweep([1, 4, 8, 32], [1, 4, 32]):
        plain = paged_decode_attention(query, k_cache, v_cache, tables, ctx, 0.125, num_splits=splits,
                                       fp16_dots=fp16_dots, prefetch=False)
        ahead = paged_decode_attention(query, k_cache, v_cache, tables, ctx, 0.125, num_splits=splits,
                                       fp16_dots=fp16_dots, prefetch=form == "registers",
                                       prefetch_l2=form == "L2")
        assert torch.equal(plain, ahead), splits


def test_the_first_block_is_prefetched_only_where_the_grid_fits_one_wave_of_that_form():
    """Holding the first block across the PDL wait costs registers (175 a thread against 96 for Triton 3.6 on
    sm_90), so an SM holds fewer programs: prefetch only where the grid still runs in one wave. (That the constant
    promises no more programs an SM than the compiled form allows is checked on the CPU, by compiling for sm_90:
    tests/unit/test_kernel_resources.py.)"""
    from mstar_kernels.paged_decode_attention import prefetch_fits

    assert prefetch_fits(32 * 8, 132)  # Qwen3-0.6B / Llama-3.2-3B, 1-32 rows: splits keep the grid at 256
    assert not prefetch_fits(64 * 8, 132)  # 64 rows: 512 programs would take two waves


def test_the_first_block_is_asked_of_l2_on_wider_grids_only_when_switched_on(monkeypatch):
    """`prefetch_forms`: held in registers where the grid fits one wave of that form; on a wider grid asked of L2
    only with `MSTAR_DECODE_PREFETCH_L2=1`; nothing ahead without PDL or with `MSTAR_DECODE_PREFETCH=0` (and the
    SM count is not asked for then: a CPU has none)."""
    from mstar_kernels.paged_decode_attention import prefetch_forms

    def no_gpu() -> int:
        raise AssertionError("the SM count was asked for without PDL")

    for name in ("MSTAR_DECODE_PREFETCH", "MSTAR_DECODE_PREFETCH_L2", "MSTAR_DECODE_PREFETCH_ANY_GRID"):
        monkeypatch.delenv(name, raising=False)
    sms = lambda: 132  # noqa: E731
    assert prefetch_forms(False, 512, no_gpu) == (False, False)
    assert prefetch_forms(True, 256, sms) == (True, False)
    assert prefetch_forms(True, 512, sms) == (False, False)
    monkeypatch.setenv("MSTAR_DECODE_PREFETCH_L2", "1")
    assert prefetch_forms(True, 512, sms) == (False, True)
    assert prefetch_forms(True, 256, sms) == (True, False)  # where the held form fits, it is kept
    monkeypatch.setenv("MSTAR_DECODE_PREFETCH_ANY_GRID", "1")
    assert prefetch_forms(True, 512, sms) == (True, False)
    monkeypatch.setenv("MSTAR_DECODE_PREFETCH", "0")
    assert prefetch_forms(True, 512, no_gpu) == (False, False)
    monkeypatch.setenv("MSTAR_DECODE_PREFETCH", "")
    monkeypatch.setenv("MSTAR_DECODE_PREFETCH_ANY_GRID", "")
    monkeypatch.setenv("MSTAR_DECODE_PREFETCH_L2", "yes")
    with pytest.raises(ValueError, match="MSTAR_DECODE_PREFETCH_L2='yes': expected 0 or 1"):
        prefetch_forms(True, 512, sms)


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("form", [{}, {"tokens_major": True}])
def test_mixed_step_splits_rows_between_the_prefill_and_decode_kernels(head_dim, num_heads, num_kv_heads, form):
    """A mixed step as the Triton backend runs it: the prefill kernel over the multi-token rows (their work
    items only), then the decode kernel over the one-token rows at their packed positions into the same output;
    trailing padding rows (no queries, as in a captured bucket) are skipped."""
    dtype = DTYPES[0]
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    rows = [(1, 300), (40, 40), (1, 77), (1, 1), (17, 530), (1, 64)]
    query_lens = [q for q, _ in rows]
    k_cache, v_cache, tables = _pool([c for _, c in rows], PAGE_SIZE, num_kv_heads, head_dim, dtype, gen)
    tokens = sum(query_lens)
    qsl = [0] + torch.tensor(query_lens).cumsum(0).tolist()
    ctx = [c for _, c in rows]
    query = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    ref = paged_prefill_attention_ref(query, k_cache, v_cache, torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
                                      torch.tensor(ctx, dtype=torch.int32, device=DEVICE), tables, scale=scale)
    padded_tables = torch.cat([tables, tables[:2]])  # two padding rows
    padded_qsl = torch.tensor(qsl + [tokens, tokens], dtype=torch.int32, device=DEVICE)
    padded_ctx = torch.tensor(ctx + [1, 1], dtype=torch.int32, device=DEVICE)
    capacity = prefill_work_capacity(tokens, len(rows) + 2)
    work_rows, work_firsts = build_prefill_work(query_lens + [0, 0], capacity, skip_single=True)
    assert sum(r >= 0 for r in work_rows) == 2  # the 40- and 17-token rows only
    out = paged_prefill_attention(query, k_cache, v_cache, padded_qsl, padded_ctx, padded_tables,
                                  torch.tensor(work_rows, dtype=torch.int32, device=DEVICE),
                                  torch.tensor(work_firsts, dtype=torch.int32, device=DEVICE), scale)
    for splits in (1, 4):
        mixed = paged_decode_attention(query, k_cache, v_cache, padded_tables, padded_ctx, scale, num_splits=splits,
                                       query_start_loc=padded_qsl, out=out.clone(), **form)
        assert rel_err(mixed, ref) < (1e-5 if dtype == torch.float32 else 1e-2), splits


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,page_size", CASES)
def test_paged_prefill_matches_reference_on_ragged_rows(head_dim, num_heads, num_kv_heads, page_size):
    dtype = DTYPES[0]
    gen = torch.Generator().manual_seed(head_dim + page_size)
    # (new queries, context after the step): a fresh prompt, a chunk after cached tokens, a decode row, ...
    rows = sweep([(512, 512), (100, 300), (1, 77), (64, 64), (65, 1000), (3, 3)], [(20, 20), (5, 40), (1, 9)])
    query_lens = [q for q, _ in rows]
    k_cache, v_cache, tables = _pool([c for _, c in rows], page_size, num_kv_heads, head_dim, dtype, gen)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([c for _, c in rows], dtype=torch.int32, device=DEVICE)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    capacity = prefill_work_capacity(sum(query_lens), len(rows)) + 5  # padded items must be ignored
    work_rows, work_firsts = build_prefill_work(query_lens, capacity)
    scale = head_dim**-0.5
    ref = paged_prefill_attention_ref(query, k_cache, v_cache, qsl, ctx, tables, scale=scale)
    group = num_heads // num_kv_heads
    # the grouped form: its own choice of heads a program, one head, and padded head slots past the group
    variants = [("plain", None)] + [("grouped", h) for h in dict.fromkeys([None, 1, 2 if group > 1 else 4])]
    for form, heads in variants:
        out = paged_prefill_attention(query, k_cache, v_cache, qsl, ctx, tables,
                                      torch.tensor(work_rows, dtype=torch.int32, device=DEVICE),
                                      torch.tensor(work_firsts, dtype=torch.int32, device=DEVICE), scale, form=form,
                                      heads_per_program=heads)
        assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2), (form, heads)


@pytest.mark.parametrize("block_n", sweep([32, 64, 128], [32, 128]))
def test_grouped_prefill_blocks_of_keys_against_pages_and_diagonals(block_n):
    """The grouped form's two loops (keys below the diagonal unmasked, the rest masked) meet where the block
    size puts them: contexts whose cached part ends mid-block and on a block's edge, chunks of 1-130 queries, pages
    that hold whole blocks (one table read a block) and pages smaller than a block (one a key)."""
    dtype = DTYPES[0]
    head_dim, num_heads, num_kv_heads = 64, 4, 2
    scale = head_dim**-0.5
    rows = [(130, 130), (64, 192), (1, 64), (33, 97), (70, 200), (2, 128)]
    query_lens = [q for q, _ in rows]
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([c for _, c in rows], dtype=torch.int32, device=DEVICE)
    work = [torch.tensor(w, dtype=torch.int32, device=DEVICE)
            for w in build_prefill_work(query_lens, prefill_work_capacity(sum(query_lens), len(rows)))]
    for page_size in (16, 128):
        gen = torch.Generator().manual_seed(block_n + page_size)
        k_cache, v_cache, tables = _pool([c for _, c in rows], page_size, num_kv_heads, head_dim, dtype, gen)
        query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
        ref = paged_prefill_attention_ref(query, k_cache, v_cache, qsl, ctx, tables, scale=scale)
        out = paged_prefill_attention(query, k_cache, v_cache, qsl, ctx, tables, *work, scale, block_n=block_n,
                                      form="grouped")
        assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2), page_size


@pytest.mark.parametrize("grouped_us,expected", [(9.7, "grouped"), (9.9, "plain")])
def test_auto_keeps_the_grouped_form_where_it_is_two_percent_faster(monkeypatch, grouped_us, expected):
    """`choose_form` times each form on synthetic prompts with the model's heads (here with a stand-in timer that
    runs each launch once and checks it against the reference) and keeps `grouped` only at a 2% gain."""
    import mstar_kernels.paged_prefill_attention as prefill_module

    launches = []
    real = prefill_module._prefill_grouped_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(prefill_module, "_prefill_grouped_kernel", Counted())
    timed = []

    def timer(fn, form):
        out = fn()
        assert out.shape == (70, 4, 64) and torch.isfinite(out.float()).all()
        timed.append((form, len(launches)))
        return {"plain": 10.0, "grouped": grouped_us}[form]

    dtype = DTYPES[0]
    chosen, totals = prefill_module.choose_form(4, 2, 64, 16, dtype, dtype, torch.device(DEVICE), timer=timer,
                                                workloads=((1, 70),))
    assert chosen == expected and totals == {"plain": 10.0, "grouped": grouped_us}
    assert timed == [("plain", 0), ("grouped", 1)]  # each launch ran its own form


def test_auto_times_once_a_shape_and_not_off_cuda_nor_in_a_capture(monkeypatch, caplog):
    import logging

    import mstar_kernels.paged_prefill_attention as prefill_module

    monkeypatch.setattr(prefill_module, "_AUTO_CHOICES", {})
    asked = []
    monkeypatch.setattr(prefill_module, "choose_form",
                        lambda *a: asked.append(a) or ("grouped", {"plain": 50.0, "grouped": 30.0}))
    bf16, cuda = torch.bfloat16, torch.device("cuda", 0)
    assert prefill_module.auto_form(16, 8, 128, 64, bf16, bf16, torch.device("cpu")) == "plain" and not asked
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with caplog.at_level(logging.WARNING):
        assert prefill_module.auto_form(16, 8, 128, 64, bf16, bf16, cuda) == "plain" and not asked
    assert "no form timed before this capture" in caplog.text
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with caplog.at_level(logging.INFO):
        assert prefill_module.auto_form(16, 8, 128, 64, bf16, bf16, cuda) == "grouped"
    assert "plain 50.0 us, grouped 30.0 us over 8x512 + 1x2048 prompts x tokens: grouped" in caplog.text
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # kept: no timing, no warning
    assert prefill_module.auto_form(16, 8, 128, 64, bf16, bf16, cuda) == "grouped" and len(asked) == 1
    assert prefill_module.auto_form(16, 8, 128, 64, bf16, torch.float8_e4m3fn, cuda) == "plain"  # another pool


@pytest.mark.skipif(IS_INTERPRETED, reason="times both forms on the GPU")
def test_auto_on_the_gpu_runs_the_form_it_timed_and_keeps_it(monkeypatch):
    import mstar_kernels.paged_prefill_attention as prefill_module

    monkeypatch.setattr(prefill_module, "_AUTO_CHOICES", {})
    gen = torch.Generator().manual_seed(21)
    lengths = [300, 77]
    k_cache, v_cache, tables = _pool(lengths, 64, 8, 128, torch.bfloat16, gen)
    qsl = torch.tensor([0, 300, 377], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    query = torch.randn(377, 16, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    work = [torch.tensor(w, dtype=torch.int32, device=DEVICE)
            for w in build_prefill_work(lengths, prefill_work_capacity(377, 2))]
    auto = paged_prefill_attention(query, k_cache, v_cache, qsl, ctx, tables, *work, 0.088, form="auto")
    (chosen,) = prefill_module._AUTO_CHOICES.values()
    assert chosen in prefill_module.FORMS
    assert torch.equal(auto, paged_prefill_attention(query, k_cache, v_cache, qsl, ctx, tables, *work, 0.088,
                                                     form=chosen))


def test_prefill_form_switch(monkeypatch):
    from mstar_kernels.paged_prefill_attention import grouped_heads, prefill_form

    monkeypatch.delenv("MSTAR_PREFILL_ATTENTION", raising=False)
    assert prefill_form() == "grouped"
    monkeypatch.setenv("MSTAR_PREFILL_ATTENTION", "plain")
    assert prefill_form() == "plain"
    monkeypatch.setenv("MSTAR_PREFILL_ATTENTION", "auto")
    assert prefill_form() == "auto"
    monkeypatch.setenv("MSTAR_PREFILL_ATTENTION", "fast")
    with pytest.raises(ValueError, match="MSTAR_PREFILL_ATTENTION='fast': expected one of plain, grouped, auto"):
        prefill_form()
    # Qwen3-0.6B's group of 2 fills a 128-row tile; Llama-3.2-3B's 3 takes 2 heads a program (4 slots for 3)
    assert [grouped_heads(g) for g in (1, 2, 3, 4, 8)] == [1, 2, 2, 2, 2]
    assert grouped_heads(4, block_m=32) == 4


@pytest.mark.skipif(DEVICE == "cpu", reason="fp16 on the GPU only")
def test_paged_decode_fp16():
    test_paged_decode_matches_reference(128, 16, 8, 16, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_kv_pool_is_read_back_exactly(dtype):
    """An fp8 (e4m3) pool: both kernels read it back in the query's dtype (exact: e4m3 values are bf16/fp32
    values), so they equal the reference over the same rounded caches."""
    head_dim, num_heads, num_kv_heads = HEADS[0]
    gen = torch.Generator().manual_seed(8)
    lengths = sweep([1, 65, 1000], [1, 17, 40])
    k_cache, v_cache, tables = _pool(lengths, PAGE_SIZE, num_kv_heads, head_dim, dtype, gen)
    k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    ctx = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    query = torch.randn(len(lengths), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    out = paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale)
    assert out.dtype == dtype
    ref = paged_decode_attention_ref(query, k_cache, v_cache, tables, ctx, scale)
    assert rel_err(out, ref) < tol
    if dtype == torch.bfloat16:  # the fp16-dot variant for fp8 pools: fp16 holds e4m3 and bf16 queries here
        fp16 = paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale, fp16_dots=True)
        assert fp16.dtype == dtype and rel_err(fp16, ref) < tol
        for splits in (1, 4):
            fp16 = paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale, fp16_dots=True,
                                          tokens_major=True, num_splits=splits)
            assert rel_err(fp16, ref) < tol, ("tokens major, fp16 dots", splits)
            # the query quantised to e4m3 per head: ~3% error per score at most, a few % on the output
            fp8 = paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale, tokens_major=True,
                                         qk_fp8=True, num_splits=splits)
            err = rel_err(fp8, ref)
            assert 1e-4 < err < 0.05, ("tokens major, fp8 q.k", splits, err)
    out = paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale, tokens_major=True)
    assert rel_err(out, ref) < tol
    query_lens = [min(n, 5) for n in lengths]  # the last few positions of each context are new queries
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    work_rows, work_firsts = build_prefill_work(query_lens, prefill_work_capacity(sum(query_lens), len(lengths)))
    ref = paged_prefill_attention_ref(query, k_cache, v_cache, qsl, ctx, tables, scale=scale)
    for form in ("plain", "grouped"):
        out = paged_prefill_attention(query, k_cache, v_cache, qsl, ctx, tables,
                                      torch.tensor(work_rows, dtype=torch.int32, device=DEVICE),
                                      torch.tensor(work_firsts, dtype=torch.int32, device=DEVICE), scale, form=form)
        assert rel_err(out, ref) < tol, form


def _row_slots(tables, lengths, page_size):
    """The KV slot of each row's last context position (the token a decode step writes)."""
    return torch.tensor([int(tables[r, (n - 1) // page_size]) * page_size + (n - 1) % page_size
                         for r, n in enumerate(lengths)], dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("has_norm", [True, False])
@pytest.mark.parametrize("pool", ["model", "fp8"])
def test_decode_with_the_prologue_inside_matches_the_two_launches(head_dim, num_heads, num_kv_heads, has_norm, pool):
    """`paged_decode_attention_rope` (q/k norm + RoPE + KV write inside the decode kernel) against the prologue
    kernel followed by the decode kernel: the same pool afterwards (bit-equal without the norm: the one rounding
    that can differ is the norm's sum order) and the same attention output to rounding (the new token's score is a
    sum, not a dot), at 1 to 32 splits (the new token in
    the first block, a middle one or a split of its own), and against the torch reference."""
    from mstar_common.layers.rotary import RotaryEmbedding
    from mstar_kernels.paged_decode_attention import paged_decode_attention_rope
    from mstar_kernels.qk_norm_rope_kv import qk_norm_rope_kv, qk_norm_rope_kv_ref

    dtype = DTYPES[0]
    gen = torch.Generator().manual_seed(head_dim + num_heads * 3 + has_norm)
    lengths = sweep([1, 17, 64, 65, 300, 1000], [1, 17, 64, 65, 130])
    k_cache, v_cache, tables = _pool(lengths, PAGE_SIZE, num_kv_heads, head_dim, dtype, gen)
    fp16_dots = pool == "fp8" and dtype == torch.bfloat16
    if pool == "fp8":
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    ctx = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    slots = _row_slots(tables, lengths, PAGE_SIZE)
    positions = ctx.long() - 1
    inv_freq = RotaryEmbedding(head_dim, 1e6).inv_freq(positions.device)
    qkv = (3 * torch.randn(len(lengths), (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)).to(dtype)
    qkv = qkv.to(DEVICE)
    qw = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype).to(DEVICE) if has_norm else None
    kw = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype).to(DEVICE) if has_norm else None
    scale = head_dim**-0.5
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    # the torch reference: the prologue's ops, then attention over the written pool
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    cos, sin = RotaryEmbedding(head_dim, 1e6)(positions, dtype)
    q_ref = qk_norm_rope_kv_ref(qkv, cos, sin, qw, kw, 1e-6, k_ref, v_ref, slots, num_heads, num_kv_heads, head_dim)
    ref = paged_decode_attention_ref(q_ref, k_ref, v_ref, tables, ctx, scale)
    for splits in sweep([1, 8, 32], [1, 4, 32]):
        k_two, v_two = k_cache.clone(), v_cache.clone()
        query = qk_norm_rope_kv(qkv, None, None, qw, kw, 1e-6, k_two, v_two, slots, num_heads, num_kv_heads,
                                head_dim, positions=positions, inv_freq=inv_freq)
        two = paged_decode_attention(query, k_two, v_two, tables, ctx, scale, num_splits=splits, fp16_dots=fp16_dots)
        k_one, v_one = k_cache.clone(), v_cache.clone()
        one = paged_decode_attention_rope(qkv, qw, kw, 1e-6, positions, inv_freq, k_one, v_one, slots, tables, ctx,
                                          num_heads, num_kv_heads, head_dim, scale, num_splits=splits,
                                          fp16_dots=fp16_dots)
        assert one.shape == two.shape == (len(lengths), num_heads, head_dim) and one.dtype == dtype
        assert torch.equal(v_one.float(), v_two.float()), splits  # v is copied verbatim
        written = torch.zeros(k_cache.shape[:3], dtype=torch.bool, device=DEVICE)
        written.view(-1, num_kv_heads)[slots] = True
        assert torch.equal(k_one[~written].float(), k_cache[~written].float()), "a slot besides the new ones changed"
        if has_norm:
            assert rel_err(k_one.float(), k_two.float()) < tol, splits
        else:
            assert torch.equal(k_one.float(), k_two.float()), splits
        assert rel_err(one, two) < tol, splits
        if pool == "model" or not IS_INTERPRETED:  # the interpreter rounds fp32 -> e4m3 unlike torch
            assert rel_err(one, ref) < tol, splits


@pytest.mark.skipif(DEVICE == "cpu", reason="a deep grid: the GPU only")
@pytest.mark.parametrize("pool", ["bf16", "fp8"])
def test_a_deep_decode_grid_takes_its_own_settings_and_matches_the_reference(pool):
    """128 rows x 8 KV heads in one split is 1,024 programs: the bf16 form takes 3 pipeline stages there and the
    fp8 q.k form 128-token blocks (decode_num_stages, the block rule), settings no smaller test reaches."""
    from mstar_kernels.paged_decode_attention import decode_num_stages

    head_dim, num_heads, num_kv_heads = 128, 16, 8
    gen = torch.Generator().manual_seed(128)
    lengths = torch.randint(1, 700, (128,), generator=gen).tolist()
    k_cache, v_cache, tables = _pool(lengths, 64, num_kv_heads, head_dim, torch.bfloat16, gen)
    if pool == "fp8":
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    ctx = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    query = torch.randn(len(lengths), num_heads, head_dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    scale = head_dim**-0.5
    ref = paged_decode_attention_ref(query, k_cache, v_cache, tables, ctx, scale)
    assert decode_num_stages(len(lengths), num_kv_heads, 1) == 3
    if pool == "bf16":
        out = paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale, num_splits=1)
        assert rel_err(out, ref) < 1e-2
    else:  # the query quantised to e4m3 per head: a few % on the output, as at 3 rows
        out = paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale, num_splits=1, tokens_major=True,
                                     qk_fp8=True)
        assert 1e-4 < rel_err(out, ref) < 0.05


def test_decode_stages_rule_and_switch(monkeypatch):
    from mstar_kernels.paged_decode_attention import decode_num_stages

    monkeypatch.delenv("MSTAR_DECODE_STAGES", raising=False)
    assert decode_num_stages(256, 8, 1) == 3  # one split, 2,048 programs: deep enough for 3 stages
    assert decode_num_stages(64, 8, 1) == 2 and decode_num_stages(256, 8, 2) == 2
    monkeypatch.setenv("MSTAR_DECODE_STAGES", "4")
    assert decode_num_stages(64, 8, 1) == 4 and decode_num_stages(1, 8, 32) == 4
    monkeypatch.setenv("MSTAR_DECODE_STAGES", "three")
    with pytest.raises(ValueError, match="MSTAR_DECODE_STAGES='three': expected a positive integer"):
        decode_num_stages(64, 8, 1)


def test_rope_in_attention_rule_and_switch(monkeypatch):
    from mstar_kernels.paged_decode_attention import rope_in_attention

    monkeypatch.delenv("MSTAR_DECODE_ROPE_IN_ATTENTION", raising=False)
    assert [n for n in (1, 2, 3, 4, 8, 16, 17, 32, 64) if rope_in_attention(n)] == [3, 4, 8, 16]
    monkeypatch.setenv("MSTAR_DECODE_ROPE_IN_ATTENTION", "1")
    assert rope_in_attention(1) and rope_in_attention(64)
    monkeypatch.setenv("MSTAR_DECODE_ROPE_IN_ATTENTION", "0")
    assert not rope_in_attention(8)
    monkeypatch.setenv("MSTAR_DECODE_ROPE_IN_ATTENTION", "yes")
    with pytest.raises(ValueError, match="MSTAR_DECODE_ROPE_IN_ATTENTION='yes': expected rule, 0 or 1"):
        rope_in_attention(8)


@pytest.mark.skipif(not IS_INTERPRETED, reason="the sweep's own run is the GPU check")
def test_the_prefill_sweep_runs_both_forms_and_reports_them(capsys):
    """scripts/sweep_decode_attention.py --prefill, small and in the interpreter (fp32, a stand-in timer): every
    form at every setting runs, equals the plain form, and is reported, so a device call never finds it broken."""
    from tests.scripts import load_script

    sweep_module = load_script("sweep_decode_attention")
    rows = sweep_module.sweep_prefill(1, cases=((1, 70),), heads_list=(("gqa3", 6, 2),),
                                      settings=((32, 4, 2), (64, 4, 2)), device="cpu", dtype=torch.float32,
                                      timer=lambda fn: fn() is not None and 10.0)
    assert {(r["form"], r["heads"], r["block_n"]) for r in rows} == {
        (form, heads, block) for form, heads in (("plain", None), ("grouped", 1), ("grouped", 2)) for block in (32, 64)}
    assert all(r["rel_err_vs_plain"] < 1e-5 and r["us"] == 10.0 for r in rows)
    assert "gqa3 1x70: as launched by default" in capsys.readouterr().out
