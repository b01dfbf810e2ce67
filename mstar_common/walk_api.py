"""What a walk script (ensembles/<family>.py) sees of the server: one async call per component hop.

A walk is plain async Python over `call(component, inputs) -> outputs` (tensors by wire name). In Triton the
walk router (backends/walk_router.py) implements `call` with an async BLS request to `<family>_<component>`;
the tests and the benchmark implement it in-process against the same component runtimes. A walk refuses a
bad request with a ValueError naming the field and the rule (the client's fault); a component's error
arrives as a ComponentError carrying that component's message.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from mstar_common import wire

Call = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class ComponentError(Exception):
    """A component answered with an error; `message` is its text (an `invalid_request:` one is the client's fault)."""

    def __init__(self, component: str, message: str):
        super().__init__(f"{component}: {message}")
        self.component = component
        self.message = message

    @property
    def is_invalid_request(self) -> bool:
        return wire.is_invalid_request(self.message)


class QueueWaitExpired(ComponentError):
    """A walk's own wait for admission ran past admission.queue_timeout_s (an `unavailable:` 503): the walk router
    counts it with the deadlines (`mstar_requests_expired_total`), as a component counts its queue waits."""


class LastResponse(dict):
    """A streaming walk's last response (`stream(...)` yields it at its end): the walk router sends it with the FINAL
    flag and every other response as soon as it is yielded. A stream that ends without one is closed by a FINAL
    without outputs."""
