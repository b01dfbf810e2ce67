"""The GIL switch interval of a component's stub process (`MSTAR_SWITCH_INTERVAL_MS`, default 0.5 ms).

A component's stub runs several Python threads: the engine's step loop, the output pump (detokenizing and
sending responses), Triton's `execute` (tokenizing new prompts) and the metrics sampler. When the step loop
wakes from its wait on a GPU step it needs the GIL back, and a thread running Python keeps it until the
interpreter's switch interval (Python's default is 5 ms) forces a hand-over. With a decode step of ~2.4 ms that
can leave the GPU without a queued step. A shorter interval bounds that wait (scripts/probe_gil_wake.py measures
it). On the H200, Qwen3-0.6B at c=64, 0.5 ms served 2-3% more tokens/s through the OpenAI proxy than Python's
5 ms in two A/B pairs, and the same through Triton (docs/benchmarks.md), so it is the default;
`MSTAR_SWITCH_INTERVAL_MS=5` restores Python's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

ENV = "MSTAR_SWITCH_INTERVAL_MS"
DEFAULT_MS = 0.5
MIN_MS, MAX_MS = 0.05, 100.0


def switch_interval_s(environ: Mapping[str, str] = os.environ) -> float:
    """The interval `MSTAR_SWITCH_INTERVAL_MS` asks for (DEFAULT_MS when unset or empty), in seconds."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_MS / 1e3
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: must be a number of milliseconds") from None
    if not MIN_MS <= ms <= MAX_MS:
        raise ValueError(f"{ENV}={raw!r}: must be between {MIN_MS} and {MAX_MS} milliseconds")
    return ms / 1e3


def apply_switch_interval(environ: Mapping[str, str] = os.environ) -> float:
    """Set the interpreter's switch interval from the environment; returns the one set."""
    interval = switch_interval_s(environ)
    sys.setswitchinterval(interval)
    return interval
