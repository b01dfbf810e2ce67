"""Stop strings across deltas: hold-back, earliest match, overlapping prefixes, validation."""

from __future__ import annotations

import random

import pytest

from mstar_common.engine.stop_strings import StopStringMatcher, validate_stops


def _run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops)
    out = []
    for delta in deltas:
        text, is_stopped = matcher.feed(delta)
        out.append(text)
        if is_stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def _reference(stops: list[str], text: str) -> tuple[str, bool]:
    """The text fed a character at a time: it stops at the first character that completes a stop string."""
    for end in range(1, len(text) + 1):
        starts = [end - len(stop) for stop in stops if text[:end].endswith(stop)]
        if starts:
            return text[: min(starts)], True
    return text, False


def test_stop_spanning_deltas():
    assert _run(["STOP"], ["Hello wor", "ld ST", "O", "P and more"]) == ("Hello world ", True)


def test_holds_back_possible_prefix_only():
    matcher = StopStringMatcher(["</s>"])
    assert matcher.feed("abc</") == ("abc", False)
    assert matcher.feed("b>") == ("</b>", False)
    assert matcher.feed("x<") == ("x", False)
    assert matcher.flush() == "<"


def test_self_overlapping_stop():
    assert _run(["aab"], list("xaaab")) == ("xa", True)


def test_overlapping_stops_the_first_to_end_wins_however_the_text_is_split():
    """The stop that ends first wins ("bc" inside "abcd"), as when the text comes a character at a time; before, a
    longer stop that started earlier won when one delta held both, so the outcome depended on the split."""
    for deltas in (["xab", "cd"], ["xab", "c", "d"], ["xabcd"], list("xabcd")):
        assert _run(["abcd", "bc"], deltas) == ("xa", True), deltas
    assert _run(["abcd", "bc"], ["xab", "ce"]) == ("xa", True)
    assert _run(["world", "lo"], ["hel", "lo world"]) == ("hel", True)
    for deltas in (["hello world"], list("hello world")):
        assert _run(["lo w", "o"], deltas) == ("hell", True), deltas
    assert _run(["b", "abc"], ["abc"]) == _run(["b", "abc"], list("abc")) == ("a", True)
    assert _run(["bc", "abc"], ["xabc"]) == ("x", True)  # two ending together: the longer one


def test_stopped_matcher_stays_stopped():
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("a\n\nb") == ("a", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_no_stops_passes_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", False)


def test_random_streams_match_reference():
    rng = random.Random(0)
    for _ in range(500):
        stops = ["".join(rng.choices("abc", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abcd", k=rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _run(stops, deltas) == _reference(stops, text), (stops, deltas)


def test_validate_stops():
    assert validate_stops(None) == []
    assert validate_stops("x") == ["x"]
    assert validate_stops(["a", "b"]) == ["a", "b"]


@pytest.mark.parametrize(
    ("stops", "rule"),
    [
        (["s"] * 17, "at most 16"),
        ([""], "non-empty"),
        (["x" * 257], "at most 256"),
        ([3], "strings"),
        (3, "string or a list"),
    ],
)
def test_validate_stops_rejects(stops, rule):
    with pytest.raises(ValueError, match=rule) as info:
        validate_stops(stops)
    assert "stop" in str(info.value)
