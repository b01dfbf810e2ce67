"""Page allocator invariants, the KV pool layout, metadata building and the reference paged attention."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from mstar_common.engine.attention import TorchPagedAttention, build_attention_metadata
from mstar_common.engine.kv_cache import KVCache, KVSpec, PageAllocator, PageTable


def _check_invariants(allocator: PageAllocator, tables: list[PageTable]) -> None:
    held = [page for table in tables for page in table.pages]
    assert len(held) == len(set(held)), "a page is held twice"
    assert all(0 <= page < allocator.num_pages for page in held)
    assert allocator.num_used_pages == len(held)
    assert allocator.num_free_pages + allocator.num_used_pages == allocator.num_pages
    assert allocator.num_reserved_pages == sum(table.num_reserved for table in tables)
    assert allocator.num_used_pages <= allocator.num_reserved_pages <= allocator.num_pages
    assert all(len(table.pages) <= table.num_reserved for table in tables)


def test_reserve_then_grow_then_free():
    allocator = PageAllocator(num_pages=10, page_size=4)
    table = PageTable()
    assert allocator.can_allocate(10) and not allocator.can_allocate(11)
    allocator.allocate(table, allocator.pages_for(4 * 6 - 1))  # 23 tokens -> 6 pages
    assert (allocator.num_reserved_pages, allocator.num_used_pages, allocator.num_free_pages) == (6, 0, 10)
    assert allocator.can_allocate(4) and not allocator.can_allocate(5)
    allocator.grow(table, 1)
    assert len(table.pages) == 1
    allocator.grow(table, 4)  # still one page
    assert len(table.pages) == 1
    allocator.grow(table, 23)
    assert len(table.pages) == 6 and allocator.num_free_pages == 4
    with pytest.raises(RuntimeError, match="reserved 6"):
        allocator.grow(table, 25)
    allocator.free(table)
    assert (allocator.num_reserved_pages, allocator.num_used_pages, allocator.num_free_pages) == (0, 0, 10)
    allocator.free(table)  # freeing twice is harmless
    assert allocator.num_reserved_pages == 0 and allocator.num_free_pages == 10


def test_allocate_refuses_over_reservation_and_reuse():
    allocator = PageAllocator(num_pages=4, page_size=2)
    first, second = PageTable(), PageTable()
    allocator.allocate(first, 3)
    with pytest.raises(RuntimeError, match="unreserved"):
        allocator.allocate(second, 2)
    with pytest.raises(RuntimeError, match="already"):
        allocator.allocate(first, 1)


def test_random_workload_keeps_invariants():
    rng = random.Random(0)
    allocator = PageAllocator(num_pages=40, page_size=3)
    live: list[tuple[PageTable, int, int]] = []  # table, tokens now, token cap
    for _ in range(2000):
        action = rng.random()
        if action < 0.3:
            cap = rng.randint(1, 30)
            footprint = allocator.pages_for(cap)
            if allocator.can_allocate(footprint):
                table = PageTable()
                allocator.allocate(table, footprint)
                live.append((table, 0, cap))
        elif action < 0.8 and live:
            index = rng.randrange(len(live))
            table, tokens, cap = live[index]
            tokens = min(cap, tokens + rng.randint(1, 5))
            allocator.grow(table, tokens)  # never fails within the reservation
            live[index] = (table, tokens, cap)
        elif live:
            table, _, _ = live.pop(rng.randrange(len(live)))
            allocator.free(table)
        _check_invariants(allocator, [table for table, _, _ in live])
    for table, _, _ in live:
        allocator.free(table)
    assert allocator.num_free_pages == 40 and allocator.num_reserved_pages == 0


def test_allocator_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_kv_pages"):
        PageAllocator(num_pages=0, page_size=4)


def test_kv_cache_layout_and_sink_page():
    cache = KVCache(KVSpec(num_layers=3, num_kv_heads=2, head_dim=8), num_pages=5, page_size=4,
                    dtype=torch.float32, device="cpu")
    k0, v0 = cache.layer(0)
    assert k0.shape == (6, 4, 2, 8) and cache.sink_page == 5
    k0.fill_(1.0)
    assert v0.sum() == 0 and cache.layer(1)[0].sum() == 0  # layers and K/V are disjoint views


def test_metadata_slots_and_padding():
    metadata = build_attention_metadata(
        query_lens=[3, 1], context_lens=[3, 6], page_tables=[[7], [2, 4]], page_size=4, sink_page=9, device="cpu"
    )
    assert metadata.query_start_loc.tolist() == [0, 3, 4]
    assert metadata.slot_mapping.tolist() == [28, 29, 30, 4 * 4 + 1]  # row 1 writes position 5 -> page 4, offset 1
    assert metadata.block_tables.tolist() == [[7, 9], [2, 4]]
    assert (metadata.max_query_len, metadata.max_context_len, metadata.num_tokens) == (3, 6, 4)


def _dense_causal(q, k, v, scale):
    """Reference: full causal attention over one whole sequence, [L, H, D] each, GQA by repetition."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, scale=scale)
    return out.transpose(0, 1)


def _pick(tensors, spans):
    return torch.cat([tensors[row][start:end] for row, start, end in spans])


def test_paged_attention_matches_dense_over_chunks():
    """Feed three sequences in uneven chunks (mixed prefill and decode rows); every output equals dense."""
    torch.manual_seed(0)
    heads, kv_heads, dim, page_size = 4, 2, 8, 3
    lengths = [11, 1, 7]
    chunk_plans = [[4, 1, 3], [5, 0, 2], [2, 0, 2]]  # tokens per row per step (0: row absent)
    qs = [torch.randn(n, heads, dim) for n in lengths]
    ks = [torch.randn(n, kv_heads, dim) for n in lengths]
    vs = [torch.randn(n, kv_heads, dim) for n in lengths]
    cache = KVCache(KVSpec(1, kv_heads, dim), num_pages=16, page_size=page_size, dtype=torch.float32, device="cpu")
    allocator = PageAllocator(16, page_size)
    tables = [PageTable() for _ in lengths]
    for table, n in zip(tables, lengths, strict=True):
        allocator.allocate(table, allocator.pages_for(n))
    backend, done = TorchPagedAttention(), [0, 0, 0]
    outputs = [torch.zeros_like(q) for q in qs]
    for plan in chunk_plans:
        rows = [r for r, n in enumerate(plan) if n]
        for r in rows:
            allocator.grow(tables[r], done[r] + plan[r])
        metadata = build_attention_metadata(
            [plan[r] for r in rows], [done[r] + plan[r] for r in rows], [tables[r].pages for r in rows],
            page_size=page_size, sink_page=cache.sink_page, device="cpu",
        )
        spans = [(r, done[r], done[r] + plan[r]) for r in rows]
        k_cache, v_cache = cache.layer(0)
        backend.write_kv(_pick(ks, spans), _pick(vs, spans), k_cache, v_cache, metadata)
        out = backend.attend(_pick(qs, spans), k_cache, v_cache, metadata, scale=dim**-0.5)
        offset = 0
        for r in rows:
            outputs[r][done[r]: done[r] + plan[r]] = out[offset: offset + plan[r]]
            offset += plan[r]
            done[r] += plan[r]
    assert done == lengths
    for q, k, v, out in zip(qs, ks, vs, outputs, strict=True):
        torch.testing.assert_close(out, _dense_causal(q, k, v, dim**-0.5), atol=1e-5, rtol=1e-5)
