"""MSTAR_SWITCH_INTERVAL_MS: parsed with a clear error, applied to the interpreter, unset keeps Python's."""

import sys

import pytest

from mstar_common.gil import ENV, apply_switch_interval, switch_interval_s


@pytest.fixture
def restore_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_unset_keeps_the_interpreters_interval(restore_interval):
    before = sys.getswitchinterval()
    assert switch_interval_s({}) is None and switch_interval_s({ENV: " "}) is None
    assert apply_switch_interval({}) is None and sys.getswitchinterval() == before


def test_a_value_in_milliseconds_is_applied(restore_interval):
    assert switch_interval_s({ENV: "0.5"}) == pytest.approx(5e-4)
    assert apply_switch_interval({ENV: "0.5"}) == pytest.approx(5e-4, rel=1e-3)
    assert sys.getswitchinterval() == pytest.approx(5e-4, rel=1e-3)


@pytest.mark.parametrize("raw, rule", [("fast", "a number of milliseconds"), ("0", "between"), ("500", "between"),
                                       ("-1", "between")])
def test_bad_values_name_the_variable_and_the_rule(raw, rule, restore_interval):
    before = sys.getswitchinterval()
    with pytest.raises(ValueError, match=f"{ENV}.*{rule}"):
        apply_switch_interval({ENV: raw})
    assert sys.getswitchinterval() == before
