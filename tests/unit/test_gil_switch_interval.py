"""MSTAR_SWITCH_INTERVAL_MS: parsed with a clear error, applied to the interpreter, 0.5 ms when unset."""

import sys

import pytest

from mstar_common.gil import DEFAULT_MS, ENV, apply_switch_interval, switch_interval_s


@pytest.fixture
def restore_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_unset_applies_the_default_not_pythons(restore_interval):
    sys.setswitchinterval(0.005)
    assert DEFAULT_MS == 0.5
    assert switch_interval_s({}) == switch_interval_s({ENV: " "}) == pytest.approx(5e-4)
    assert apply_switch_interval({}) == pytest.approx(5e-4)
    assert sys.getswitchinterval() == pytest.approx(5e-4, rel=1e-3)
    assert apply_switch_interval({ENV: "5"}) == pytest.approx(5e-3)  # Python's own, asked for by value
    assert sys.getswitchinterval() == pytest.approx(5e-3, rel=1e-3)


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
