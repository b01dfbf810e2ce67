"""The GIL switch interval of a component's stub process (`MSTAR_SWITCH_INTERVAL_MS`).

A component's stub runs several Python threads: the engine's step loop, the output pump (detokenizing and
sending responses), Triton's `execute` (tokenizing new prompts) and the metrics sampler. When the step loop
wakes from its wait on a GPU step it needs the GIL back, and a thread running Python keeps it until the
interpreter's switch interval (5 ms by default) forces a hand-over. With a decode step of ~2.4 ms that can
leave the GPU without a queued step. A shorter interval bounds that wait (scripts/probe_gil_wake.py measures
it); the variable is unset by default, which keeps Python's own interval.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

ENV = "MSTAR_SWITCH_INTERVAL_MS"
MIN_MS, MAX_MS = 0.05, 100.0


def switch_interval_s(environ: Mapping[str, str] = os.environ) -> float | None:
    """The interval `MSTAR_SWITCH_INTERVAL_MS` asks for, in seconds; None when unset."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: must be a number of milliseconds") from None
    if not MIN_MS <= ms <= MAX_MS:
        raise ValueError(f"{ENV}={raw!r}: must be between {MIN_MS} and {MAX_MS} milliseconds")
    return ms / 1e3


def apply_switch_interval(environ: Mapping[str, str] = os.environ) -> float | None:
    """Set the interpreter's switch interval from the environment; returns the one set, or None when unset."""
    interval = switch_interval_s(environ)
    if interval is not None:
        sys.setswitchinterval(interval)
    return interval
