"""Admission control in the engine: the bounded queue (overloaded), the queue wait limit and request deadlines;
every refusal or expiry names its limit and leaves no pages behind."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from mstar_common import wire
from mstar_common.engine import admission, ar_engine
from mstar_common.engine.admission import Admission, EngineOverloaded, EngineUnavailable
from mstar_common.engine.types import EngineConfig, FinishReason
from mstar_common.families.qwen3.loader import load_qwen3, read_eos_token_ids
from mstar_common.families.qwen3.tiny import build_tiny_checkpoint
from tests.unit.test_ar_engine import Collector, assert_pool_empty, greedy, make_engine, run_until_idle


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    checkpoint = build_tiny_checkpoint(tmp_path_factory.getbasetemp() / "qwen3_tiny")
    model, config = load_qwen3(checkpoint)
    return model, read_eos_token_ids(checkpoint, config), config["vocab_size"]


PROMPT = [5, 6, 7, 8]


def _add(engine, collector, rid, max_tokens=30, timeout_s=None):
    engine.add_request(rid, PROMPT, greedy(max_tokens, ignore_eos=True), collector, timeout_s=timeout_s)


def test_queue_cap_refuses_at_once_with_an_overloaded_error(tiny):
    engine = make_engine(tiny, max_num_seqs=2, max_queue=1)
    collector = Collector()
    for rid in ("a", "b", "c"):
        _add(engine, collector, rid)
    with pytest.raises(EngineOverloaded) as info:
        _add(engine, collector, "d")
    assert info.value.wire_message.startswith(wire.OVERLOADED_PREFIX)
    assert "2 running and 1 queued" in str(info.value)
    assert engine.stats()["num_refused"] == 1
    engine.step()
    assert engine.stats()["num_running"] == 2 and engine.stats()["num_waiting"] == 1
    run_until_idle(engine)
    assert all(collector.reason(r) is FinishReason.LENGTH for r in "abc")
    _add(engine, collector, "e", max_tokens=2)  # room again once they finished
    run_until_idle(engine)


def test_max_queue_zero_refuses_past_the_running_cap(tiny):
    engine = make_engine(tiny, max_num_seqs=1, max_queue=0)
    collector = Collector()
    _add(engine, collector, "a", max_tokens=2)
    with pytest.raises(EngineOverloaded):
        _add(engine, collector, "b")
    run_until_idle(engine)


def test_queue_timeout_ends_a_waiting_request_with_unavailable(tiny, monkeypatch):
    # The engine's clock is the test's: only the 0.06 s below passes between the steps. On the real clock a pause of
    # the test process before the first step (a loaded 2-core CI box) expired "runs" too, before its admission.
    now = [0.0]
    monkeypatch.setattr(ar_engine, "time", SimpleNamespace(monotonic=lambda: now[0], perf_counter=time.perf_counter))
    monkeypatch.setattr(admission, "EXPIRY_CHECK_S", 0.0)
    engine = make_engine(tiny, max_num_seqs=1, queue_timeout_s=0.05)
    collector = Collector()
    _add(engine, collector, "runs", max_tokens=200)
    _add(engine, collector, "waits")
    engine.step()
    now[0] += 0.06
    engine.step()
    reason, error = collector.streams["waits"].finals[0]
    assert reason is FinishReason.ERROR and error.startswith(wire.UNAVAILABLE_PREFIX) and "queue_timeout_s" in error
    assert "runs" not in {r for r, s in collector.streams.items() if s.finals}  # admitted: not a queue wait
    engine.cancel("runs")
    run_until_idle(engine)
    assert engine.stats()["num_expired"] == 1


def test_deadline_ends_a_running_request_and_frees_its_pages(tiny, monkeypatch):
    monkeypatch.setattr(admission, "EXPIRY_CHECK_S", 0.0)
    engine = make_engine(tiny, request_timeout_s=30.0)
    collector = Collector()
    _add(engine, collector, "short", max_tokens=400, timeout_s=0.05)
    _add(engine, collector, "long", max_tokens=3, timeout_s=100.0)  # capped by request_timeout_s, finishes
    engine.step()
    assert engine.stats()["num_used_pages"] > 0
    time.sleep(0.06)
    run_until_idle(engine)
    reason, error = collector.streams["short"].finals[0]
    assert reason is FinishReason.ERROR and error.startswith(wire.DEADLINE_PREFIX) and "0.05 s" in error
    assert collector.reason("long") is FinishReason.LENGTH
    assert_pool_empty(engine)


def test_a_request_expired_before_its_intake_is_not_run_after_its_final(tiny, monkeypatch):
    """A request added between a step's intake and its expiry check, already past its deadline (a walk's hop sent
    with its last microsecond), got its deadline error while still in the inbox; the next intake then scheduled
    the finished sequence, which held pages, ran to max_tokens and got a second final, uncounted by the queue cap."""
    monkeypatch.setattr(admission, "EXPIRY_CHECK_S", 0.0)
    engine = make_engine(tiny, max_num_seqs=2, max_queue=0)
    collector = Collector()
    engine._intake()  # the loop's step, interleaved by hand: intake, then the request arrives, then expiry
    _add(engine, collector, "late", max_tokens=20, timeout_s=1e-6)
    time.sleep(0.001)
    engine._expire()
    assert collector.streams["late"].finals[0][1].startswith(wire.DEADLINE_PREFIX)
    engine.step()
    assert_pool_empty(engine)
    run_until_idle(engine)
    assert len(collector.streams["late"].finals) == 1 and collector.streams["late"].num_late_calls == 0


def test_the_loop_thread_expires_a_queued_request_while_another_runs(tiny):
    engine = make_engine(tiny, max_num_seqs=1, queue_timeout_s=0.1)
    collector = Collector()
    engine.start()
    try:
        _add(engine, collector, "runs", max_tokens=400)
        _add(engine, collector, "waits", max_tokens=10)
        collector.wait(["waits"], timeout=30)
        assert collector.streams["waits"].finals[0][1].startswith(wire.UNAVAILABLE_PREFIX)
        engine.cancel("runs")
        collector.wait(["runs"], timeout=30)
    finally:
        engine.shutdown()
    assert_pool_empty(engine)


def test_a_shut_down_engine_refuses_as_unavailable(tiny):
    engine = make_engine(tiny)
    engine.shutdown()
    with pytest.raises(EngineUnavailable) as info:
        _add(engine, Collector(), "x")
    assert info.value.wire_message.startswith(wire.UNAVAILABLE_PREFIX)


@pytest.mark.parametrize("field,value", [("max_queue", -1), ("max_queue", 1.5), ("queue_timeout_s", 0),
                                         ("request_timeout_s", float("inf")), ("request_timeout_s", -2)])
def test_engine_config_refuses_bad_admission_values(tiny, field, value):
    with pytest.raises(ValueError, match=field):
        make_engine(tiny, **{field: value})


def test_admission_takes_the_smaller_of_the_client_and_deployment_deadlines():
    adm = Admission(max_running=4, max_queue=None, queue_timeout_s=None, request_timeout_s=10.0)
    adm.track("client", 0.0, 2.0)
    adm.track("capped", 0.0, 50.0)
    adm.track("default", 0.0, None)
    assert [rid for rid, _ in adm.expired(5.0, lambda _: False)] == ["client"]
    assert sorted(rid for rid, _ in adm.expired(11.0, lambda _: False)) == ["capped", "client", "default"]
    assert adm.capacity == float("inf")
    adm.check_capacity(10_000)  # no queue cap: never overloaded


def test_untracked_requests_cost_nothing():
    adm = Admission(max_running=4, max_queue=4, queue_timeout_s=None, request_timeout_s=None)
    adm.track("a", 0.0, None)
    assert adm.expired(1e9, lambda _: True) == []
    assert EngineConfig().max_queue is None
