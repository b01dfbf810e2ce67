"""Stop strings over a stream of text deltas (OpenAI `stop` semantics: the stop string is not emitted).

A stop string can span deltas, so the matcher holds back the longest tail of the text that could still
grow into a stop string, and emits everything before it. The stream stops where a stop string first ends, as
it would were the text fed a character at a time, so the outcome never depends on how the text was split into
deltas (a stream that falls behind gets several tokens a delta): of stops "abcd" and "bc", text "abcd" stops
at "bc", which ends first, keeping "a".
"""

from __future__ import annotations

import copy

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters


def validate_stops(stops: str | list[str] | None) -> list[str]:
    """Normalise `stop` (a string, a list of strings or None) to a list; raise ValueError naming the rule."""
    if stops is None:
        return []
    if isinstance(stops, str):
        stops = [stops]
    if not isinstance(stops, list):
        raise ValueError(f"stop: must be a string or a list of strings, got {type(stops).__name__}")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: must hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for stop in stops:
        if not isinstance(stop, str):
            raise ValueError(f"stop: entries must be strings, got {stop!r}")
        if not stop:
            raise ValueError("stop: entries must be non-empty strings")
        if len(stop) > MAX_STOP_LENGTH:
            raise ValueError(f"stop: entries must be at most {MAX_STOP_LENGTH} characters, got {len(stop)}")
    return list(stops)


class StopStringMatcher:
    """Feeds text deltas through a set of stop strings.

    `feed(delta)` returns `(text safe to emit now, is_stopped)`. On a match the text is whatever preceded the
    stop string and the matcher stays stopped: later feeds and `flush()` return nothing. `flush()` releases
    the held-back tail at the end of a stream that never matched.
    """

    def __init__(self, stops: list[str]):
        self._stops = validate_stops(stops)
        # Proper prefixes of every stop string: the tails worth holding back.
        self._prefixes = {stop[:n] for stop in self._stops for n in range(1, len(stop))}
        self._first_chars = {stop[0] for stop in self._stops}
        self._max_hold = max((len(stop) - 1 for stop in self._stops), default=0)
        self._held = ""
        self.is_stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.is_stopped:
            return "", True
        text = self._held + delta
        match_at = self._earliest_match(text)
        if match_at is not None:
            self.is_stopped, self._held = True, ""
            return text[:match_at], True
        num_held = self._num_partial_tail(text)
        self._held = text[len(text) - num_held :]
        return text[: len(text) - num_held], False

    def flush(self) -> str:
        text, self._held = self._held, ""
        return text

    def fork(self) -> StopStringMatcher:
        """An independent copy of the matcher's state (its stop strings shared: they never change)."""
        return copy.copy(self)

    def _earliest_match(self, text: str) -> int | None:
        """Where the stop string that ends first in `text` starts (of two that end together, the longer one)."""
        matches = [(at + len(stop), at) for stop in self._stops if (at := text.find(stop)) >= 0]
        return min(matches)[1] if matches else None

    def _num_partial_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for start in range(max(0, len(text) - self._max_hold), len(text)):
            if text[start] in self._first_chars and text[start:] in self._prefixes:
                return len(text) - start
        return 0
