"""`mstar_common.bench.fusion.critical_path`: a step's span charged to the kernels that end it, when kernels overlap."""

import pytest

pytest.importorskip("torch")

from mstar_common.bench.fusion import critical_path  # noqa: E402


def test_overlapping_kernels_are_charged_from_the_end_before_them():
    # one layer of two GEMVs around a norm, PDL-style: each starts before the one before it ends
    step = [(0.0, 5.0, "gemv"), (4.0, 6.0, "norm"), (5.5, 10.0, "gemv")]
    rows = {row["kernel"]: row for row in critical_path(step, replays=1, layers=1)}
    assert rows["gemv#0"]["us_per_step"] == 5.0  # the first kernel: from its start
    assert rows["norm"]["us_per_step"] == 1.0  # 5 -> 6
    assert rows["gemv#1"]["us_per_step"] == 4.0  # 6 -> 10, not its 4.5 us of duration
    assert sum(row["us_per_step"] for row in rows.values()) == 10.0  # the span


def test_gaps_between_replays_are_not_charged_and_steps_average():
    step = [(0.0, 2.0, "a"), (1.0, 3.0, "b")]
    second = [(start + 100.0, end + 100.0, name) for start, end, name in step]  # an idle gap between replays
    rows = {row["kernel"]: row for row in critical_path(step + second, replays=2, layers=28)}
    assert rows == {"a": {"kernel": "a", "us_per_step": 2.0, "calls_per_step": 1.0},
                    "b": {"kernel": "b", "us_per_step": 1.0, "calls_per_step": 1.0}}


def test_a_kernel_ending_inside_an_earlier_one_is_charged_nothing():
    rows = {row["kernel"]: row for row in critical_path([(0.0, 10.0, "long"), (1.0, 3.0, "short")], 1, 1)}
    assert rows["short"]["us_per_step"] == 0.0 and rows["long"]["us_per_step"] == 10.0


def test_idle_gaps_are_charged_to_the_kernels_around_them():
    from mstar_common.bench.fusion import idle_gaps

    # a kernel that ends inside an earlier one opens no gap; the gap after it is the earlier one's
    step = [(0.0, 10.0, "long"), (1.0, 3.0, "short"), (12.0, 13.0, "next"), (13.0, 14.0, "last")]
    second = [(start + 20.0, end + 20.0, name) for start, end, name in step]
    gaps = idle_gaps(step + second, replays=2)
    assert gaps == [{"between": "last -> long", "us_per_step": 3.0, "calls_per_step": 0.5},
                    {"between": "long -> next", "us_per_step": 2.0, "calls_per_step": 1.0}]
