"""ResponseKeeper (backends/bls.py): finished BLS iterators outlive the stub's clean-up, then die in Python."""

import gc
import sys
import threading
import types
import weakref

import pytest


@pytest.fixture()
def bls(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    monkeypatch.delitem(sys.modules, "backends.bls", raising=False)
    import backends.bls as module

    return module


class FakeIterator:
    freed_in: list = []

    def __del__(self):
        FakeIterator.freed_in.append(threading.current_thread().name)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_held_iterator_lives_for_hold_s_and_is_freed_by_a_later_hold(bls):
    clock = Clock()
    keeper = bls.ResponseKeeper(hold_s=5.0, clock=clock)
    first = FakeIterator()
    ref = weakref.ref(first)
    keeper.hold(first)
    del first
    gc.collect()
    assert ref() is not None, "dropped by the caller, still held by the keeper"

    clock.now += 4.9
    keeper.hold(FakeIterator())
    assert ref() is not None, "4.9 s < hold_s: must still be held"

    clock.now += 0.2
    FakeIterator.freed_in.clear()
    keeper.hold(FakeIterator())
    assert ref() is None, "past hold_s: released by the next hold"
    assert FakeIterator.freed_in == [threading.current_thread().name]
    assert len(keeper) == 2


def test_order_and_release_all(bls):
    clock = Clock()
    keeper = bls.ResponseKeeper(hold_s=1.0, clock=clock)
    refs = []
    for _ in range(3):
        item = FakeIterator()
        refs.append(weakref.ref(item))
        keeper.hold(item)
        del item
        clock.now += 0.4
    # t=101.2 now: the first (due 101.0) goes at the next hold, the second (101.4) and third (101.8) stay
    keeper.hold(FakeIterator())
    assert [r() is None for r in refs] == [True, False, False]
    keeper.release_all()
    assert all(r() is None for r in refs) and len(keeper) == 0


def test_hold_time_from_the_environment_and_its_rule(bls, monkeypatch):
    monkeypatch.setenv("MSTAR_BLS_HOLD_S", "2.5")
    assert bls.ResponseKeeper().hold_s == 2.5
    for bad in ("-1", "abc", "inf"):
        monkeypatch.setenv("MSTAR_BLS_HOLD_S", bad)
        with pytest.raises(ValueError, match=f"MSTAR_BLS_HOLD_S='{bad}': expected seconds >= 0"):
            bls.ResponseKeeper()
