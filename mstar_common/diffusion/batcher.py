"""The step loop of a stateless component (text encoder, VAE encode/decode): batch whatever is waiting.

`submit()` only enqueues. One background thread takes the oldest waiting item, adds every other waiting item
with the same batch key (same tensor shapes) in arrival order up to `max_rows` rows, runs them as one batch
and hands each item its own result. Items of other keys wait for the next turn, still in arrival order, so
no shape starves. A request cancelled before its turn is dropped without running.

A request's `is_cancelled` may be a `StopCheck`: then it also stops the request at its deadline (the Triton
timeout its caller set; the walk router sets the time its client has left), and the engine ends it with
`Expired` and counts it in `num_expired`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from mstar_common.devices import on_device

logger = logging.getLogger(__name__)

OnDone = Callable[[Any, BaseException | None], None]


class Cancelled(Exception):
    """The request was cancelled before its result was ready."""


class Expired(Cancelled):
    """The request's deadline passed before its result was ready."""


class ShuttingDown(Cancelled):
    """The component stopped before the request's result was ready (its node answers wire.SERVER_STOPPED)."""

    def __init__(self) -> None:
        super().__init__("the component stopped before the request finished")


class StopCheck:
    """An engine's `is_cancelled` for one request: true once its client went away (`client_gone()`) or
    `timeout_s` (None: no deadline) passed since it was made."""

    __slots__ = ("_client_gone", "timeout_s", "_deadline")

    def __init__(self, client_gone: Callable[[], bool], timeout_s: float | None):
        self._client_gone = client_gone
        self.timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s if timeout_s is not None else math.inf

    def is_expired(self) -> bool:
        return time.monotonic() >= self._deadline

    def __call__(self) -> bool:
        return self.is_expired() or bool(self._client_gone())


def stop_error(is_cancelled: Callable[[], bool], request_id: str, where: str = "") -> Cancelled:
    """Why a request whose `is_cancelled()` came true stops: `Expired` past a StopCheck's deadline, else
    `Cancelled` (`where`: e.g. " at step 3")."""
    if isinstance(is_cancelled, StopCheck) and is_cancelled.is_expired():
        return Expired(f"the request did not finish within its deadline of {is_cancelled.timeout_s:g} s{where}")
    return Cancelled(f"{request_id} cancelled{where}")


@dataclass(slots=True)
class WorkItem:
    request_id: str
    payload: Any
    key: Hashable
    num_rows: int
    on_done: OnDone
    is_cancelled: Callable[[], bool]


class BatchingEngine:
    """`run_batch(payloads) -> results` (one per payload, in order) on batches of equal `key_of(payload)`."""

    def __init__(self, name: str, run_batch: Callable[[list[Any]], list[Any]], *, max_rows: int,
                 key_of: Callable[[Any], Hashable] = lambda _: None, rows_of: Callable[[Any], int] = lambda _: 1):
        if max_rows < 1:
            raise ValueError(f"{name}: max_rows must be >= 1, got {max_rows}")
        self.name = name
        self.max_rows = max_rows
        self._run_batch, self.key_of, self.rows_of = run_batch, key_of, rows_of
        self._waiting: deque[WorkItem] = deque()
        self._cond = threading.Condition()
        self._is_stopped = False
        self._thread = threading.Thread(target=on_device(self._loop), name=f"{name}-batcher", daemon=True)
        self.num_batches = 0
        self.num_rows_run = 0
        self.num_expired = 0  # requests dropped unrun at their deadline
        self._num_running = 0  # the requests of the batch being computed
        self.graph_replays: Callable[[], int] | None = None  # the component's captured-graph runs, for stats()

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._is_stopped = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def submit(self, request_id: str, payload: Any, on_done: OnDone,
               is_cancelled: Callable[[], bool] = lambda: False) -> None:
        rows = self.rows_of(payload)
        if rows > self.max_rows:
            raise ValueError(f"{self.name}: a request of {rows} rows exceeds the batch limit of {self.max_rows}")
        item = WorkItem(request_id, payload, self.key_of(payload), rows, on_done, is_cancelled)
        with self._cond:
            if self._is_stopped:
                raise RuntimeError(f"{self.name} is shut down")
            self._waiting.append(item)
            self._cond.notify()

    def stats(self) -> dict[str, float]:
        with self._cond:
            waiting = len(self._waiting)
        # num_steps: batched forwards run (the metrics' step counter); num_rows_stepped / num_steps: mean batch;
        # num_running: the requests of the batch being computed (out of the waiting list, in none before)
        return {"num_running": self._num_running, "num_waiting": waiting, "num_steps": self.num_batches,
                "num_rows_stepped": self.num_rows_run, "num_expired": self.num_expired,
                "num_graph_steps": self.graph_replays() if self.graph_replays is not None else 0}

    # the loop

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._num_running = len(batch)
            try:
                self._run(batch)
            finally:
                self._num_running = 0

    def _next_batch(self) -> list[WorkItem] | None:
        with self._cond:
            while not self._waiting and not self._is_stopped:
                self._cond.wait()
            if self._is_stopped:
                for item in self._waiting:
                    _finish(item, None, ShuttingDown())
                self._waiting.clear()
                return None
            key = self._waiting[0].key
            batch, rest, rows = [], deque(), 0
            for item in self._waiting:
                if item.key == key and rows + item.num_rows <= self.max_rows:
                    batch.append(item)
                    rows += item.num_rows
                else:
                    rest.append(item)
            self._waiting = rest
        return batch

    def _run(self, batch: list[WorkItem]) -> None:
        live = []
        for item in batch:
            if item.is_cancelled():
                error = stop_error(item.is_cancelled, item.request_id)
                self.num_expired += isinstance(error, Expired)
                _finish(item, None, error)
            else:
                live.append(item)
        if not live:
            return
        try:
            results = self._run_batch([item.payload for item in live])
        except Exception as exc:  # noqa: BLE001 - a fault fails this batch's requests, never the loop
            logger.exception("[%s] batch of %d failed", self.name, len(live))
            for item in live:
                _finish(item, None, exc)
            return
        self.num_batches += 1
        self.num_rows_run += sum(item.num_rows for item in live)
        for item, result in zip(live, results, strict=True):
            _finish(item, result, None)


def _finish(item: WorkItem, result: Any, error: BaseException | None) -> None:
    try:
        item.on_done(result, error)
    except Exception:  # noqa: BLE001 - a failing callback must not stop the loop
        logger.exception("result callback of %s failed", item.request_id)
