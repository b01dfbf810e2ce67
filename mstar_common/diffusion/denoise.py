"""The denoise-loop component's step loop: every request's whole loop runs here, batched across requests.

A job is one request: `num_rows` images of one token layout (output size and reference-image grid), each
with its own schedule. Every iteration the loop admits new jobs, drops cancelled ones, and for each layout
runs ONE batched step over the jobs of that layout (up to `max_rows` rows): each row at its own step index,
with its own timestep and Euler step size. A new request therefore joins the running batch at its step 0
on the very next iteration, while the others carry on at theirs. Jobs left out of a full batch run first
on the next iteration. A finished job hands its latents to `on_done` and leaves the batch.

The step itself (`stepper`) is the family's: a transformer forward plus the Euler update, eager or a
captured CUDA graph per (layout, batch) bucket.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mstar_common.devices import on_device
from mstar_common.diffusion.batcher import Expired, OnDone, ShuttingDown, stop_error

logger = logging.getLogger(__name__)


class Stepper(Protocol):
    """Optionally also `rows_to_run(layout, rows) -> int`: how many of the rows waiting to step the engine takes
    (image_components.BucketedStepper: fewer when padding them to a captured batch would cost more)."""

    def __call__(self, layout: Hashable, latents: torch.Tensor, prompt_embeds: torch.Tensor,
                 ref_tokens: torch.Tensor | None, timesteps: torch.Tensor, dts: torch.Tensor) -> torch.Tensor:
        """One Euler step of `B` rows of `layout`: `latents` `[B, N, C]` -> `[B, N, C]`; `timesteps`, `dts` `[B]`."""


@dataclass(slots=True)
class DenoiseJob:
    request_id: str
    layout: Hashable  # rows batch together only within one layout
    latents: torch.Tensor  # [n, N, C] on the device, in the model dtype
    prompt_embeds: torch.Tensor  # [n, T, J]
    ref_tokens: torch.Tensor | None  # [n, N_ref, C]
    timesteps: list[float]  # [S] the schedule's timesteps
    sigmas: list[float]  # [S + 1]
    on_done: OnDone
    is_cancelled: Callable[[], bool] = lambda: False
    step: int = 0
    last_run: int = -1  # loop iteration of its last step (fairness when a layout's batch is full)
    order: int = field(default=0)
    png_rows: bool = False  # the in-process decoder answers PNG rows, not pixels (want_png_rows)

    @property
    def num_rows(self) -> int:
        return self.latents.shape[0]

    @property
    def is_finished(self) -> bool:
        return self.step >= len(self.timesteps)


class DenoiseEngine:
    def __init__(self, name: str, stepper: Stepper, *, max_rows: int, device: torch.device | str = "cpu"):
        if max_rows < 1:
            raise ValueError(f"{name}: max_rows must be >= 1, got {max_rows}")
        self.name = name
        self.stepper = stepper
        self.max_rows = max_rows
        self.device = torch.device(device)
        self._incoming: queue.SimpleQueue[DenoiseJob | None] = queue.SimpleQueue()
        self._running: list[DenoiseJob] = []
        self._is_stopped = False
        self._iteration = 0
        self._num_admitted = 0
        self._thread = threading.Thread(target=on_device(self._loop, self.device), name=f"{name}-denoise",
                                        daemon=True)
        self.num_steps = 0  # batched forwards run
        self.num_rows_stepped = 0  # rows advanced by them (num_rows_stepped / num_steps = mean batch)
        self.num_expired = 0  # jobs ended by their deadline (their is_cancelled a batcher.StopCheck)
        self.companions: list[Any] = []  # engines started and stopped with this one (an in-process VAE decoder)

    def start(self) -> None:
        for engine in self.companions:
            engine.start()
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._is_stopped = True
        self._incoming.put(None)
        self._thread.join(timeout)
        for engine in self.companions:
            engine.shutdown()

    def submit(self, job: DenoiseJob) -> None:
        if job.num_rows > self.max_rows:
            raise ValueError(f"{self.name}: {job.num_rows} images exceed the denoise batch limit of {self.max_rows}")
        if self._is_stopped:
            raise RuntimeError(f"{self.name} is shut down")
        self._incoming.put(job)

    def stats(self) -> dict[str, float]:
        """The component's gauges and counters. A request whose latents went on to an in-process decoder (a
        companion, `vae_in_denoise`) is still this component's: running while it is decoded, and expired if its
        deadline passes there."""
        graphs = getattr(self.stepper, "graphs", None)
        running, expired = len(self._running), self.num_expired
        for engine in self.companions:
            theirs = engine.stats()
            running += theirs.get("num_running", 0) + theirs.get("num_waiting", 0)
            expired += theirs.get("num_expired", 0)
        return {"num_running": running, "num_waiting": self._incoming.qsize(),
                "num_steps": self.num_steps, "num_rows_stepped": self.num_rows_stepped, "num_expired": expired,
                "num_graph_steps": graphs.num_replays if graphs is not None else 0}

    # the loop

    def _loop(self) -> None:
        try:
            while not self._is_stopped:
                self._admit(block=not self._running)
                self._drop_cancelled()
                with torch.inference_mode():
                    for layout, jobs in self._schedule():
                        self._step(layout, jobs)
                self._iteration += 1
        finally:
            for job in self._running:
                _finish(job, None, ShuttingDown())
            while True:  # and what was submitted meanwhile: its caller (a walk's hop) waits for an answer
                try:
                    job = self._incoming.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    _finish(job, None, ShuttingDown())

    def _admit(self, block: bool) -> None:
        while True:
            try:
                job = self._incoming.get(block=block)
            except queue.Empty:
                return
            if job is None:
                return
            job.order = self._num_admitted
            self._num_admitted += 1
            # As if it stepped last iteration: it queues behind the rows a full batch left out, which would
            # otherwise be passed over again by every newer request (-1 sorted it ahead of them all).
            job.last_run = self._iteration - 1
            self._running.append(job)
            block = False

    def _drop_cancelled(self) -> None:
        kept = []
        for job in self._running:
            if job.is_cancelled():
                error = stop_error(job.is_cancelled, job.request_id, f" at step {job.step}")
                self.num_expired += isinstance(error, Expired)
                _finish(job, None, error)
            else:
                kept.append(job)
        self._running = kept

    def _schedule(self) -> list[tuple[Hashable, list[DenoiseJob]]]:
        """Per layout, the jobs that step this iteration: least recently stepped first, up to max_rows rows, or
        fewer where the stepper's `rows_to_run` says a smaller captured batch steps more rows per second, but never
        fewer than the least recently stepped job's own rows (else a job of more images than that smaller batch
        would wait while younger, smaller jobs stepped past it, until its deadline)."""
        groups: dict[Hashable, list[DenoiseJob]] = {}
        for job in sorted(self._running, key=lambda j: (j.last_run, j.order)):
            groups.setdefault(job.layout, []).append(job)
        plan = []
        rows_to_run = getattr(self.stepper, "rows_to_run", None)
        for layout, jobs in groups.items():
            limit = self.max_rows
            if rows_to_run is not None:  # a captured step pads to its bucket: maybe step fewer rows, exactly
                limit = rows_to_run(layout, min(self.max_rows, sum(job.num_rows for job in jobs)))
            limit = max(limit, jobs[0].num_rows)
            chosen, rows = [], 0
            for job in jobs:
                if rows + job.num_rows <= limit:
                    chosen.append(job)
                    rows += job.num_rows
            plan.append((layout, chosen))
        return plan

    def _step(self, layout: Hashable, jobs: list[DenoiseJob]) -> None:
        try:
            latents = torch.cat([job.latents for job in jobs])
            prompt = torch.cat([job.prompt_embeds for job in jobs])
            refs = torch.cat([job.ref_tokens for job in jobs]) if jobs[0].ref_tokens is not None else None
            timesteps = torch.tensor([job.timesteps[job.step] for job in jobs for _ in range(job.num_rows)],
                                     dtype=torch.float32).to(self.device)
            dts = torch.tensor([job.sigmas[job.step + 1] - job.sigmas[job.step]
                                for job in jobs for _ in range(job.num_rows)], dtype=torch.float32).to(self.device)
            out = self.stepper(layout, latents, prompt, refs, timesteps, dts)
        except Exception as exc:  # noqa: BLE001 - a fault fails this layout's requests, never the loop
            logger.exception("[%s] denoise step of %d requests failed", self.name, len(jobs))
            for job in jobs:
                self._running.remove(job)
                _finish(job, None, exc)
            return
        self.num_steps += 1
        self.num_rows_stepped += out.shape[0]
        for job, part in zip(jobs, out.split([job.num_rows for job in jobs]), strict=True):
            job.latents = part
            job.step += 1
            job.last_run = self._iteration
            if job.is_finished:
                self._running.remove(job)
                _finish(job, job.latents, None)


def _finish(job: DenoiseJob, result: Any, error: BaseException | None) -> None:
    try:
        job.on_done(result, error)
    except Exception:  # noqa: BLE001
        logger.exception("result callback of %s failed", job.request_id)
