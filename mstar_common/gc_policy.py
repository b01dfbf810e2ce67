"""The garbage collector in a serving process: freeze what start-up built, and log slow collections.

A component process holds ~350k Python objects once torch, transformers and a model are loaded. CPython's
full (generation 2) collection walks all of them with the GIL held: 250-320 ms on the development machine's
CPU for the tiny Orpheus LM's process (`gc.collect()` after building it). CPython starts one by itself when
enough new objects have survived since the last, so under a burst of new requests it could land at a moment
no one chose, and every thread of the process (the engine's step loop, the codec pump, the response senders)
would stop for its length (not yet observed while serving: docs/reliability.md).

`settle_heap()` runs once at the end of a node's `initialize`: one collection, then `gc.freeze()` moves every
surviving object to the permanent generation, which later collections skip (the same collection then took
~0.01 ms). Objects frozen this way are never collected: start-up objects that later become unreachable
cyclic garbage stay allocated (tensors and arrays are freed by reference counting as before).
`MSTAR_GC_FREEZE=0` turns the freeze off; collections slower than `MSTAR_GC_LOG_MS` (default 50) are logged
as warnings with their generation and length either way.
"""

from __future__ import annotations

import gc
import logging
import math
import time

from mstar_common.config import env_switch, number_switch

logger = logging.getLogger(__name__)

_started: dict[str, float] = {}
_process = {"name": "?"}  # the component this process serves, for the log line


def _watch(phase: str, info: dict) -> None:
    if phase == "start":
        _started["t"] = time.perf_counter()
        return
    begun = _started.pop("t", None)
    if begun is None:
        return
    ms = (time.perf_counter() - begun) * 1e3
    if ms >= gc_log_ms():
        logger.warning("[%s] gc: generation %d collection took %.1f ms (%d objects collected)", _process["name"],
                       info.get("generation", -1), ms, info.get("collected", 0))


def gc_log_ms() -> float:
    """`MSTAR_GC_LOG_MS`: collections at least this long are logged (default 50)."""
    return number_switch("MSTAR_GC_LOG_MS", 50, lambda ms: 0 <= ms < math.inf, "expected milliseconds >= 0")




def settle_heap(name: str) -> None:
    """Collect once, freeze the survivors (unless MSTAR_GC_FREEZE=0) and log slow collections from now on."""
    _process["name"] = name
    started = time.perf_counter()
    gc.collect()
    frozen = 0
    if env_switch("MSTAR_GC_FREEZE", True):
        gc.freeze()
        frozen = gc.get_freeze_count()
    if _watch not in gc.callbacks:
        gc.callbacks.append(_watch)
    logger.info("[%s] gc: start-up heap settled in %.0f ms; %d objects frozen", name,
                (time.perf_counter() - started) * 1e3, frozen)
