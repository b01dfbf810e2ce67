"""The prefix cache (engine/kv_cache.py): pages keyed by their token chain, matched at admission, shared by
reference count, kept idle and evicted oldest first; and the engine serving the same tokens with it as without."""

from __future__ import annotations

import random

import pytest

from mstar_common.engine.ar_engine import AREngine, _prefix_caching
from mstar_common.engine.kv_cache import PageAllocator, PageTable
from mstar_common.engine.types import EngineConfig
from tests.unit.test_ar_engine import TEXTS, Collector, checkpoint, greedy, loaded, prompts  # noqa: F401

P = 4  # tokens per page


def _run(allocator: PageAllocator, tokens: list[int], footprint: int | None = None) -> tuple[PageTable, int]:
    """Admit a prompt as the scheduler does, compute it, key its pages; returns (table, tokens matched)."""
    table = PageTable()
    allocator.allocate(table, footprint or allocator.pages_for(len(tokens)))
    matched = allocator.match_prefix(table, tokens, (len(tokens) - 1) // P)
    allocator.grow(table, len(tokens))
    allocator.commit(table, tokens, len(tokens))
    return table, matched


def test_a_repeated_prompt_reuses_its_full_pages_but_the_last_token():
    allocator = PageAllocator(16, P, prefix_caching=True)
    prompt = list(range(100, 114))  # 14 tokens: 3 full pages + 2
    first, matched = _run(allocator, prompt)
    assert matched == 0 and allocator.num_prefix_hit_tokens == 0
    second, matched = _run(allocator, prompt)
    assert matched == 12 and second.pages[:3] == first.pages[:3] and second.pages[3] != first.pages[3]
    exact = list(range(100, 112))  # 12 tokens, all in full pages: the last page is recomputed (its row samples)
    third, matched = _run(allocator, exact)
    assert matched == 8 and third.pages[:2] == first.pages[:2]
    assert allocator.num_prefix_queried_tokens == 14 + 14 + 12 and allocator.num_prefix_hit_tokens == 20


def test_with_the_cache_off_nothing_is_matched_or_counted_as_looked_up():
    """mstar_prefix_cache_queried_tokens_total ("prompt tokens looked up in the prefix cache") grew with it off."""
    allocator = PageAllocator(16, P, prefix_caching=False)
    prompt = list(range(100, 114))
    _run(allocator, prompt)
    _, matched = _run(allocator, prompt)
    assert matched == 0 and allocator.num_prefix_queried_tokens == allocator.num_prefix_hit_tokens == 0


def test_a_diverging_prompt_shares_only_the_common_full_pages():
    allocator = PageAllocator(16, P, prefix_caching=True)
    first, _ = _run(allocator, list(range(20)))
    other = list(range(6)) + [99] + list(range(7, 20))  # differs inside the second page
    second, matched = _run(allocator, other)
    assert matched == 4 and second.pages[0] == first.pages[0] and second.pages[1] != first.pages[1]
    shifted, matched = _run(allocator, [7] + list(range(20)))  # same tokens at other positions: no match
    assert matched == 0


def test_shared_pages_are_counted_and_kept_until_the_last_holder_and_then_idle():
    allocator = PageAllocator(8, P, prefix_caching=True)
    prompt = list(range(9))
    first, _ = _run(allocator, prompt)
    second, matched = _run(allocator, prompt)
    assert matched == 8 and allocator.num_used_pages == 4  # 2 shared + 1 each
    allocator.free(first)
    assert allocator.num_used_pages == 3 and allocator.num_cached_pages == 0  # the shared ones are still held
    allocator.free(second)
    assert allocator.num_used_pages == 0 and allocator.num_cached_pages == 2  # the keyed pages stay, idle
    assert allocator.num_free_pages == 8
    third, matched = _run(allocator, prompt)
    assert matched == 8 and allocator.num_cached_pages == 0


def test_idle_pages_are_evicted_oldest_first_when_the_free_list_runs_out():
    allocator = PageAllocator(4, P, prefix_caching=True)
    old, new = [1] * 5, [2] * 5  # each keys one page (its second page, with the 5th token, is not full)
    for prompt in (old, new):
        table, _ = _run(allocator, prompt)
        allocator.free(table)
    assert allocator.num_cached_pages == 2
    filler = PageTable()
    allocator.allocate(filler, 3)
    allocator.grow(filler, 12)  # 2 free pages, then the idle page released first (old's)
    assert allocator.num_cached_pages == 1 and allocator.num_evicted_pages == 1
    allocator.free(filler)
    assert _run(allocator, old)[1] == 0 and _run(PageAllocator(4, P), new)[1] == 0
    table = PageTable()
    allocator.allocate(table, 2)
    assert allocator.match_prefix(table, new, 1) == 4  # new's page survived


def _reachable(allocator: PageAllocator) -> bool:
    """Every keyed page can still be matched: the page before it in its chain is in the index too."""
    return all(node.key[0] == 0 or node.key[0] in allocator._nodes for node in allocator._keyed.values())


def test_eviction_takes_a_cached_prefix_from_its_end_not_its_start():
    """Pages were released first page first, so the first eviction took the page every lookup of the prefix must
    match: the rest stayed cached (and counted) but could never be matched again."""
    allocator = PageAllocator(4, P, prefix_caching=True)
    prompt = list(range(10, 23))  # 13 tokens: 3 full pages keyed, and a fourth
    table, _ = _run(allocator, prompt)
    allocator.free(table)
    assert allocator.num_cached_pages == 3
    other = PageTable()
    allocator.allocate(other, 2)
    allocator.grow(other, 8)  # the free page, then one eviction
    allocator.free(other)
    assert allocator.num_evicted_pages == 1 and allocator.num_cached_pages == 2 and _reachable(allocator)
    again = PageTable()
    allocator.allocate(again, 4)
    assert allocator.match_prefix(again, prompt, 3) == 8  # the prefix's first two pages, still reachable


def test_pages_keyed_after_an_evicted_page_leave_the_cache_with_it():
    """Two sequences compute the same prompt: the first keys its pages, the second's later pages are keyed after
    the first's (its own copies of the shared start stay unkeyed). When the first's pages are evicted, the second's
    keyed pages can never be matched: they leave the index, and go to the free list when released."""
    allocator = PageAllocator(8, P, prefix_caching=True)
    prompt = list(range(40, 52))  # 12 tokens: 3 full pages
    first, second = PageTable(), PageTable()
    for table in (first, second):
        allocator.allocate(table, 3)
        assert allocator.match_prefix(table, prompt[:4], 1) == 0  # both admitted before either computed a page
        allocator.grow(table, 4)
    allocator.commit(first, prompt, 4)
    allocator.commit(second, prompt, 4)  # keyed by the first already: the second's page stays unkeyed
    for table in (second, first):
        allocator.grow(table, 12)
    allocator.commit(second, prompt, 12)  # the second keys pages 2 and 3 after the first's page 1
    allocator.free(first)
    assert allocator.num_cached_pages == 1 and _reachable(allocator)
    filler = PageTable()
    allocator.allocate(filler, 5)
    allocator.grow(filler, 20)  # 4 free pages, then the first's keyed one
    assert allocator.num_evicted_pages == 1 and _reachable(allocator)
    allocator.free(second)
    assert allocator.num_cached_pages == 0 and allocator.num_free_pages == 8 - 5


def test_a_page_with_a_pending_token_is_not_keyed_and_caching_off_matches_nothing():
    allocator = PageAllocator(8, P, prefix_caching=True)
    table = PageTable()
    allocator.allocate(table, 3)
    tokens = [5, 6, 7, 8, 9, 10, -1, 11]  # -1: a sampled token not back from the device yet
    allocator.grow(table, 8)
    allocator.commit(table, tokens, 8)
    assert table.num_keyed == 1
    off = PageAllocator(8, P)
    first, _ = _run(off, list(range(9)))
    assert _run(off, list(range(9)))[1] == 0 and off.num_cached_pages == 0


def test_random_workload_never_serves_another_prefixs_kv():
    """Random prompts over a small alphabet (many shared starts), admitted, grown, keyed and freed at random in a
    small pool. A stand-in KV store records, for every slot written, the token chain it was computed from; every
    matched page must hold exactly this prompt's chain, and the pool's counts must add up throughout."""
    rng = random.Random(7)
    allocator = PageAllocator(24, P, prefix_caching=True)
    kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (page, slot) -> the tokens up to and including that position
    live: list[tuple[PageTable, list[int]]] = []
    hits = 0
    for _ in range(3000):
        if live and (rng.random() < 0.45 or allocator.num_unreserved_pages < 6):
            table, _ = live.pop(rng.randrange(len(live)))
            allocator.free(table)
        else:
            stem = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [3, 3, 3, 3]])
            tokens = stem[:rng.randint(0, len(stem))] + [rng.randint(1, 3) for _ in range(rng.randint(1, 10))]
            table = PageTable()
            allocator.allocate(table, allocator.pages_for(len(tokens)))
            matched = allocator.match_prefix(table, tokens, (len(tokens) - 1) // P)
            hits += matched
            for pos in range(matched):
                assert kv[(table.pages[pos // P], pos % P)] == tuple(tokens[:pos + 1]), "served another prefix's KV"
            allocator.grow(table, len(tokens))
            for pos in range(matched, len(tokens)):  # this sequence's own writes: never into a shared page
                page = table.pages[pos // P]
                assert sum(page in other.pages for other, _ in live) == 0
                kv[(page, pos % P)] = tuple(tokens[:pos + 1])
            allocator.commit(table, tokens, len(tokens))
            live.append((table, tokens))
        held = {page for table, _ in live for page in table.pages}
        assert allocator.num_used_pages == len(held) and _reachable(allocator)
        assert allocator.num_free_pages + allocator.num_used_pages == allocator.num_pages
        assert allocator.num_reserved_pages == sum(table.num_reserved for table, _ in live)
    assert hits > 500  # the workload did exercise sharing


def test_models_whose_kv_is_not_a_function_of_the_ids_get_no_prefix_cache():
    class IdsOnly:
        supports_prefix_caching = True

    auto, on, off = EngineConfig(), EngineConfig(prefix_caching=True), EngineConfig(prefix_caching=False)
    assert _prefix_caching(IdsOnly(), auto, None) and _prefix_caching(IdsOnly(), on, None)
    assert not _prefix_caching(IdsOnly(), off, None)
    assert not _prefix_caching(IdsOnly(), auto, hooks=object())  # per-request state, e.g. Whisper's audio
    assert not _prefix_caching(object(), auto, None)  # not declared
    with pytest.raises(ValueError, match="prefix_caching: true"):
        _prefix_caching(object(), on, None)  # asked for explicitly: refused, not quietly off


def _serve(loaded, token_lists, sequential: bool, **config) -> tuple[list[list[int]], dict]:  # noqa: F811
    engine = AREngine(loaded[0], EngineConfig(**{"num_kv_pages": 64, "page_size": P, "max_num_seqs": 4,
                                                 "max_batch_tokens": 32, **config}),
                      eos_token_ids=loaded[1], vocab_size=loaded[2])
    collector = Collector()
    ids = []
    for index, tokens in enumerate(token_lists):
        ids.append(f"r{index}")
        engine.add_request(ids[-1], tokens, greedy(max_tokens=12, ignore_eos=True), collector)
        while sequential and engine.step():
            pass
    while engine.step():
        pass
    return [collector.streams[rid].tokens for rid in ids], engine.stats()


@pytest.mark.parametrize("sequential", [True, False])
def test_the_engine_serves_the_same_tokens_with_the_prefix_cache(loaded, prompts, sequential):  # noqa: F811
    """Prompts sharing a long start (the fifth text) with different endings, one after another (later ones match
    the first's pages) and all at once (chunked prefill: later admissions match what earlier steps keyed), in a
    pool small enough to evict: greedy tokens equal the engine's without the cache."""
    system = prompts[4]
    token_lists = [system + ending for ending in prompts[:4]] + [system + prompts[0], prompts[2]]
    cached, stats = _serve(loaded, token_lists, sequential, num_kv_pages=40)
    plain, plain_stats = _serve(loaded, token_lists, sequential, prefix_caching=False)
    assert cached == plain
    assert plain_stats["prefix_cache_hit_tokens"] == 0
    assert stats["prefix_cache_hit_tokens"] >= (len(system) // P) * P * (3 if sequential else 1)
    assert stats["prefix_cache_evicted_pages"] > 0  # the small pool took idle pages back, and tokens held
    assert stats["num_used_pages"] == 0 and stats["num_free_pages"] == 40


def test_a_request_that_fills_the_pool_exactly_reuses_its_cached_start_and_evicts_only_idle_pages(loaded):  # noqa: F811
    """A pool of 8 pages, every one of them cached from an earlier request, and a request whose footprint is the
    whole pool: it holds the pages of its matched start, and growing takes only the other idle pages."""
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]  # 17 tokens: 4 full pages + 1
    params = greedy(max_tokens=15, ignore_eos=True)  # 32 tokens: 8 pages of 4
    engine = AREngine(loaded[0], EngineConfig(num_kv_pages=8, page_size=P, max_num_seqs=2, max_batch_tokens=32),
                      eos_token_ids=loaded[1], vocab_size=loaded[2])
    collector = Collector()
    engine.add_request("first", prompt, params, collector)
    while engine.step():
        pass
    assert engine.stats()["num_cached_pages"] == 7  # the prompt's 4 full pages and 3 of output (the 8th never fills)
    engine.add_request("again", prompt, params, collector)
    engine.step()
    assert engine.stats()["num_reserved_pages"] == 8 and engine.stats()["prefix_cache_hit_tokens"] == 16
    while engine.step():
        pass
    assert collector.streams["again"].tokens == collector.streams["first"].tokens
    assert engine.stats()["prefix_cache_evicted_pages"] == 3  # the first output pages, for the second's
    assert engine.stats()["num_used_pages"] == engine.stats()["num_reserved_pages"] == 0
