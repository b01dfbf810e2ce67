import pytest

from tests.unit import collectors


@pytest.fixture(autouse=True)
def no_call_after_a_final():
    """Every engine collector of the test (test_ar_engine.Collector) saw at most one final call per request and no
    call after it. In every unit module: it was a fixture of test_ar_engine, so the modules that imported Collector
    without it (test_admission, test_prefix_cache) went unchecked on their expiry paths."""
    collectors.COLLECTORS.clear()
    yield
    for collector in collectors.COLLECTORS:
        assert all(len(s.finals) <= 1 and s.num_late_calls == 0 for s in collector.streams.values())
