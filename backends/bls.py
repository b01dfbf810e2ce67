"""Shared BLS settings for the nodes that call other components, and the keeper that works around a stub crash.

The crash (Triton <= 2.52, python_backend before upstream commit b771f4f "Hold GIL when deleting numpy
array"): reading the last response of a decoupled BLS stream queues a clean-up message; the stub's
stub-to-parent thread (a C++ thread without the GIL) then erases the stream's `ResponseIterator` from its
map. If Python has already dropped the iterator, that erase frees it there, and `~PbTensor` decrefs the
outputs' numpy arrays without the GIL: a segfault in a non-Python thread. Measured on the H200 with
`MSTAR_NATIVE_BACKTRACE` (docs/architecture.md): `Stub::ServiceStubToParentRequests` -> `SendCleanupId` ->
`~ResponseIterator` -> `~InferResponse` -> `~PbTensor` -> libpython. It struck within seconds once the
Orpheus codec hop asked for host outputs, and after ~1,000 steps with device outputs.

`ResponseKeeper.hold(iterator)` after the last read keeps a Python reference for `hold_s` (default 5 s,
`MSTAR_BLS_HOLD_S`), so the erase never drops the last reference; the iterator is released later by a
Python thread (the next `hold`) with the GIL held. The cost is the held outputs' shared memory for `hold_s`.
"""

from __future__ import annotations

import collections
import gc
import math
import threading
import time

import triton_python_backend_utils as pb_utils

from mstar_common.config import bls_hold_s


def cpu_output_memory() -> dict:
    """`InferenceRequest` keyword asking for BLS outputs in host memory, where this Python backend has the knob.

    Every caller reads outputs with `as_numpy()`: asking for CPU memory keeps GPU buffers (CUDA IPC between
    stubs) out of the hop whatever instance kinds the two components have.
    """
    if hasattr(pb_utils, "PreferredMemory"):
        return {"preferred_memory": pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)}
    return {}


class ResponseKeeper:
    """Keeps finished BLS response iterators alive for `hold_s`, then lets them go from a Python thread."""

    def __init__(self, hold_s: float | None = None, clock=time.monotonic) -> None:
        if hold_s is None:
            hold_s = bls_hold_s()
        if not 0 <= hold_s < math.inf:
            raise ValueError(f"ResponseKeeper: hold_s must be seconds >= 0, got {hold_s}")
        self.hold_s = hold_s
        self._clock = clock
        self._held: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def hold(self, iterator) -> None:
        """Call after the last read of `iterator` (never before: the reader's own reference must be gone last)."""
        now = self._clock()
        with self._lock:
            self._held.append((now + self.hold_s, iterator))
            expired = self._pop_expired(now)
        del expired  # the expired iterators are freed here, by this Python thread

    def release_all(self) -> None:
        with self._lock:
            expired = list(self._held)
            self._held.clear()
        del expired

    def __len__(self) -> int:
        return len(self._held)

    def _pop_expired(self, now: float) -> list:
        expired = []
        while self._held and self._held[0][0] <= now:
            expired.append(self._held.popleft()[1])
        return expired


KEEPER = ResponseKeeper()


def release_stub_objects() -> None:
    """Every node's last step in `finalize`: free the held BLS iterators and collect the cyclic garbage that
    still holds Triton objects (requests, response senders, tensors) while the stub can free them; left to
    the interpreter's teardown, their destructors run after the stub's IPC is gone and segfault the stub.
    """
    KEEPER.release_all()
    gc.collect()
