"""A seeded random workload through the whole engine on the tiny Qwen3: requests arrive (many sharing a prompt
start), are cancelled, run past their deadline or queue wait, and steps fail, in small pools that evict prefix
cache pages; with and without overlap and the prefix cache. After every call the KV pool's books must balance
(each page's reference count is the number of page tables holding it; free, idle and held pages partition the
pool; reservations sum), every request gets exactly one final call, and a request that ends normally gets the
tokens it gets alone in an engine without the cache."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest

from mstar_common import wire
from mstar_common.engine import ar_engine
from mstar_common.engine.admission import EngineOverloaded
from mstar_common.engine.ar_engine import AREngine
from mstar_common.engine.types import AdmissionError, EngineConfig, FinishReason, SamplingParams
from tests.unit.test_ar_engine import checkpoint, loaded  # noqa: F401 - fixtures

NUM_OPS = 300


class Clock:
    """The engine's monotonic clock, moved by the workload (deadlines and queue waits without sleeping)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def check_books(engine: AREngine) -> None:
    allocator, scheduler = engine.allocator, engine.scheduler
    holders: dict[int, int] = {}
    for seq in scheduler.running:
        table = seq.page_table
        assert not seq.is_finished and len(set(table.pages)) == len(table.pages) <= table.num_reserved
        assert seq.num_computed_tokens <= len(table.pages) * allocator.page_size
        for page in table.pages:
            holders[page] = holders.get(page, 0) + 1
    assert all(not seq.page_table.pages and not seq.page_table.num_reserved for seq in scheduler.waiting)
    assert [allocator._refs[page] for page in range(allocator.num_pages)] == [
        holders.get(page, 0) for page in range(allocator.num_pages)]
    free, idle, held = set(allocator._free), set(allocator._idle), set(holders)
    assert len(free) == len(allocator._free) and not (free & idle or free & held or idle & held)
    assert len(free) + len(idle) + len(held) == allocator.num_pages
    assert not free & set(allocator._keyed) and idle <= set(allocator._keyed)
    assert all(allocator._keyed[node.page] is node and node.key == key for key, node in allocator._index.items())
    assert allocator.num_reserved_pages == sum(seq.page_table.num_reserved for seq in scheduler.running)
    stats = engine.stats()
    assert stats["num_used_pages"] == len(held) and stats["num_cached_pages"] == len(idle)
    assert stats["num_free_pages"] == len(free) + len(idle)


def run_workload(loaded, seed: int, overlap: bool, prefix_caching: bool, clock: Clock):  # noqa: F811
    rng = random.Random(seed)
    # 16 pages of 3 tokens: the longest requests (20 + 30 tokens) are refused, some fill the pool exactly
    config = EngineConfig(num_kv_pages=16, page_size=3, max_num_seqs=4, max_batch_tokens=8, max_queue=6,
                          queue_timeout_s=5.0, prefix_caching=prefix_caching)
    engine = AREngine(loaded[0], config, eos_token_ids=loaded[1], vocab_size=loaded[2], overlap=overlap)
    calls: dict[str, list[tuple[list[int], FinishReason | None, str | None]]] = {}

    def on_output(request_id, token_ids, finish_reason, error):  # recorded: the engine swallows what raises here
        calls.setdefault(request_id, []).append((list(token_ids), finish_reason, error))

    launch = engine.runner.launch

    def flaky_launch(plan):
        if rng.random() < 0.02:
            raise RuntimeError("injected step fault")
        return launch(plan)

    engine.runner.launch = flaky_launch
    stems = [[rng.randrange(3, loaded[2]) for _ in range(rng.randint(4, 14))] for _ in range(3)]
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    refusals = set()
    for _ in range(NUM_OPS):
        action = rng.random()
        if action < 0.3:
            stem = rng.choice(stems)
            prompt = stem[:rng.randint(0, len(stem))] + [rng.randrange(3, loaded[2]) for _ in range(rng.randint(1, 6))]
            params = SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0, ignore_eos=rng.random() < 0.5,
                                    repetition_penalty=rng.choice([1.0, 1.0, 1.3]))
            request_id = f"r{len(requests)}"
            try:
                engine.add_request(request_id, prompt, params, on_output, timeout_s=rng.choice([None, None, 3.0]))
            except (AdmissionError, EngineOverloaded) as exc:  # longer than the pool holds; the queue's cap
                refusals.add(type(exc))
                continue
            requests[request_id] = (prompt, params)
        elif action < 0.4 and requests:
            engine.cancel(rng.choice(list(requests)))
        elif action < 0.45:
            clock.now += rng.random() * 2
        else:
            engine.step()
        check_books(engine)
    for _ in range(1000):
        if not engine.step() and engine.num_live == 0:
            break
        check_books(engine)
    stats = engine.stats()
    assert engine.num_live == stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_used_pages"] == stats["num_reserved_pages"] == 0
    assert stats["num_free_pages"] == config.num_kv_pages
    assert refusals == {AdmissionError, EngineOverloaded}
    assert set(calls) == set(requests)
    for request_id, made in calls.items():  # exactly one final call, the last one
        assert [finish is not None for _, finish, _ in made] == [False] * (len(made) - 1) + [True], request_id
    outputs = {rid: [token for tokens, _, _ in made for token in tokens] for rid, made in calls.items()}
    finals = {rid: made[-1][1:] for rid, made in calls.items()}
    return requests, outputs, finals, stats


def tokens_alone(engine: AREngine, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    engine.add_request("alone", prompt, params, lambda _rid, new, _finish, _error: tokens.extend(new))
    while engine.step():
        pass
    return tokens


def ending(reason: FinishReason, error: str | None) -> str:
    if reason is not FinishReason.ERROR:
        return reason.value
    for name, prefix in (("deadline", wire.DEADLINE_PREFIX), ("queue wait", wire.UNAVAILABLE_PREFIX)):
        if error.startswith(prefix):
            return name
    assert error.startswith("engine step failed (error id "), error
    return "step failed"


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_random_workload_keeps_the_books_and_the_tokens(loaded, monkeypatch, overlap, prefix_caching):  # noqa: F811
    clock = Clock()
    monkeypatch.setattr(ar_engine, "time", SimpleNamespace(monotonic=clock.monotonic, perf_counter=time.perf_counter))
    requests, outputs, finals, stats = run_workload(loaded, 11, overlap, prefix_caching, clock)
    alone = AREngine(loaded[0], EngineConfig(num_kv_pages=64, page_size=4, max_num_seqs=1, max_batch_tokens=64,
                                             prefix_caching=False), eos_token_ids=loaded[1], vocab_size=loaded[2])
    endings = set()
    for request_id, (prompt, params) in requests.items():
        expected = tokens_alone(alone, prompt, params)
        reason, error = finals[request_id]
        endings.add(ending(reason, error))
        got = outputs[request_id]
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            assert got == expected, request_id
        else:
            assert got == expected[:len(got)], request_id
    # the workload did reach the endings, and the cache shared and evicted pages
    assert {"length", "cancelled", "step failed", "deadline", "queue wait"} <= endings, endings
    if prefix_caching:
        assert stats["prefix_cache_hit_tokens"] > 0 and stats["prefix_cache_evicted_pages"] > 0
