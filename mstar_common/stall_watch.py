"""A component process that stops serving without dying is ended, so that it can be restarted.

A Python stub can hang without dying: a thread stuck in one of Triton's interprocess calls (a response send, a
cancellation query) or a step loop that stops stepping. Its model still reports ready, and every request then
waits for its client's deadline. A dead stub is handled (`mstar serve`'s supervisor relaunches the server,
docs/reliability.md), so the watch turns a hang into a death.

The output pump's loop calls `beat()` every cycle (at least every 50 ms, busy or idle). At most once a second
the beat re-arms `faulthandler.dump_traceback_later(seconds, exit=True)`: a timer on a C thread that, if not
re-armed in time, writes every thread's Python stack to the server log and exits the process. Faulthandler's
timer needs no GIL, so it fires even while a thread holds it. The beat stops re-arming when the step loop
has had live requests but made no step for `seconds`; it logs that first.

`MSTAR_STALL_EXIT_S` (default 120; 0 turns the watch off) sets `seconds`. With `MSTAR_STACK_DUMP_S` set (periodic
stack dumps, which use the same timer) the watch is off.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import time
from typing import Any

from mstar_common.config import number_switch

logger = logging.getLogger(__name__)

DEFAULT_S = 120.0
REARM_S = 1.0  # the beat re-arms the timer at most this often


def stall_exit_s() -> float:
    """`MSTAR_STALL_EXIT_S`: seconds without progress before the process ends itself (0: never)."""
    return number_switch("MSTAR_STALL_EXIT_S", DEFAULT_S, lambda s: s == 0 or 5 <= s <= 3600,
                         "expected 0 (off) or seconds in [5, 3600]")


def stack_dump_s() -> float:
    """`MSTAR_STACK_DUMP_S`: seconds between periodic stack dumps to the server log (0 or unset: none)."""
    return number_switch("MSTAR_STACK_DUMP_S", 0, lambda s: s == 0 or 1 <= s <= 86400,
                         "expected 0 (off) or seconds in [1, 86400]")


class StallWatch:
    """`engine` gives `num_steps` and `num_live` (requests admitted and not yet finished)."""

    def __init__(self, engine: Any, seconds: float, name: str = "component", clock=time.monotonic,
                 arm=faulthandler.dump_traceback_later, disarm=faulthandler.cancel_dump_traceback_later):
        self._engine, self.seconds, self._name = engine, seconds, name
        self._clock, self._arm, self._disarm = clock, arm, disarm
        self._armed_at = -float("inf")
        self._steps = -1
        self._steps_at = clock()
        self.is_stalled = False

    @classmethod
    def from_env(cls, engine: Any, name: str) -> StallWatch | None:
        seconds = stall_exit_s()
        if seconds == 0:
            return None
        if stack_dump_s() > 0:
            logger.info("[%s] stall watch off: MSTAR_STACK_DUMP_S uses its timer", name)
            return None
        return cls(engine, seconds, name)

    def beat(self) -> None:
        now = self._clock()
        if now - self._armed_at < REARM_S:
            return
        steps, live = self._engine.num_steps, self._engine.num_live
        if not live or steps != self._steps:
            self._steps, self._steps_at = steps, now
        elif now - self._steps_at > self.seconds:
            if not self.is_stalled:
                self.is_stalled = True
                logger.error("[%s] the step loop has made no step in %.0f s with %d live requests; the process "
                             "ends within %.0f s unless it resumes (MSTAR_STALL_EXIT_S)", self._name,
                             now - self._steps_at, live, self.seconds)
            return  # not re-armed: the timer fires
        if self.is_stalled:
            logger.warning("[%s] the step loop resumed", self._name)
            self.is_stalled = False
        self._arm(self.seconds, exit=True, file=sys.__stderr__)
        self._armed_at = now

    def stop(self) -> None:
        self._disarm()
