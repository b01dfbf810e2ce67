"""Admission control of one component instance: the bounded queue, the queue wait limit, request deadlines.

The gate lives in the component, not only in the proxy, because every client path ends here (the proxy,
tritonclient users, walk models calling the component over BLS) and only the component knows exactly how
many requests it holds. A component holds at most `max_num_seqs` running requests (the deployment's
`max_concurrent_requests`) plus `max_queue` waiting ones; one more is refused at once with `EngineOverloaded`
(the proxy's 429). A request that waits longer than `queue_timeout_s` for admission ends with an
`unavailable:` error (503), and one still live past its deadline ends with a `deadline_exceeded:` error (504).
Both free the request's pages in the step that notices them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mstar_common import wire

EXPIRY_CHECK_S = 0.01  # deadlines are checked at most this often (a step or so)


class AdmissionRefused(RuntimeError):
    """A request the component cannot take now; `wire_prefix` names the class of refusal on the wire."""

    wire_prefix = wire.UNAVAILABLE_PREFIX

    @property
    def wire_message(self) -> str:
        return self.wire_prefix + str(self)


class EngineOverloaded(AdmissionRefused):
    wire_prefix = wire.OVERLOADED_PREFIX


class EngineUnavailable(AdmissionRefused):
    wire_prefix = wire.UNAVAILABLE_PREFIX


@dataclass(slots=True)
class _Limits:
    arrival: float
    queue_deadline: float  # math.inf: none
    deadline: float  # math.inf: none
    timeout_s: float | None


class Admission:
    """Book-keeping for the engine (called under the engine's locks; not thread-safe on its own)."""

    def __init__(self, max_running: int, max_queue: int | None, queue_timeout_s: float | None,
                 request_timeout_s: float | None) -> None:
        self.max_running, self.max_queue = max_running, max_queue
        self.queue_timeout_s, self.request_timeout_s = queue_timeout_s, request_timeout_s
        self._limits: dict[str, _Limits] = {}
        self._next_check = 0.0
        self.num_refused = 0
        self.num_expired = 0

    @property
    def capacity(self) -> float:
        return math.inf if self.max_queue is None else self.max_running + self.max_queue

    def check_capacity(self, num_live: int) -> None:
        if num_live >= self.capacity:
            self.num_refused += 1
            raise EngineOverloaded(
                f"the component holds its cap of {self.max_running} running and {self.max_queue} queued requests; "
                "retry later"
            )

    def track(self, request_id: str, now: float, timeout_s: float | None) -> None:
        """Start the clocks of a new request; `timeout_s` (the client's) is capped by the deployment's."""
        timeouts = [t for t in (timeout_s, self.request_timeout_s) if t is not None and t > 0]
        timeout = min(timeouts) if timeouts else None
        queue_deadline = now + self.queue_timeout_s if self.queue_timeout_s else math.inf
        deadline = now + timeout if timeout is not None else math.inf
        if queue_deadline != math.inf or deadline != math.inf:
            self._limits[request_id] = _Limits(now, queue_deadline, deadline, timeout)

    def forget(self, request_id: str) -> None:
        self._limits.pop(request_id, None)

    def expired(self, now: float, is_waiting) -> list[tuple[str, str]]:
        """(request id, wire error) for each tracked request past a limit; `is_waiting(id)` says if it is queued."""
        if now < self._next_check or not self._limits:
            return []
        self._next_check = now + EXPIRY_CHECK_S
        out = []
        for request_id, lim in self._limits.items():
            if now >= lim.deadline:
                out.append((request_id, f"{wire.DEADLINE_PREFIX}the request did not finish within its deadline of "
                                        f"{lim.timeout_s:g} s"))
            elif now >= lim.queue_deadline and is_waiting(request_id):
                out.append((request_id, f"{wire.UNAVAILABLE_PREFIX}the request waited {now - lim.arrival:.1f} s for "
                                        f"admission (queue_timeout_s={self.queue_timeout_s:g}); retry later"))
        self.num_expired += len(out)
        return out
