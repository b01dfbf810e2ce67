"""settle_heap: start-up objects leave the collector's reach, and slow collections are logged."""

import gc
import logging

import pytest

from mstar_common import gc_policy


@pytest.fixture
def restore_gc():
    yield
    gc.unfreeze()
    if gc_policy._watch in gc.callbacks:
        gc.callbacks.remove(gc_policy._watch)


def test_settle_heap_freezes_the_start_up_objects(restore_gc, monkeypatch):
    monkeypatch.delenv("MSTAR_GC_FREEZE", raising=False)
    kept = [[i] for i in range(10_000)]  # objects the collector tracks
    gc_policy.settle_heap("test")
    assert gc.get_freeze_count() >= len(kept)
    assert not any(obj is kept for obj in gc.get_objects(2))  # a full collection no longer walks them


def test_freeze_can_be_turned_off(restore_gc, monkeypatch):
    monkeypatch.setenv("MSTAR_GC_FREEZE", "0")
    gc_policy.settle_heap("test")
    assert gc.get_freeze_count() == 0


def test_slow_collections_are_logged(restore_gc, monkeypatch, caplog):
    monkeypatch.setenv("MSTAR_GC_FREEZE", "0")
    monkeypatch.setenv("MSTAR_GC_LOG_MS", "0")  # every collection counts as slow
    gc_policy.settle_heap("test")
    with caplog.at_level(logging.WARNING, logger="mstar_common.gc_policy"):
        gc.collect()
    assert any("[test] gc: generation 2 collection took" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("MSTAR_GC_LOG_MS", "1e9")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mstar_common.gc_policy"):
        gc.collect()
    assert not caplog.records

