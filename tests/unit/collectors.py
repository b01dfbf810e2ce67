"""The engine tests' output collectors alive in the current test (tests/unit/test_ar_engine.py's Collector), which
tests/unit/conftest.py checks after every unit test: no request got a call after its final one."""

COLLECTORS: list = []
