"""Continuous batching with chunked prefill, FIFO admission by KV footprint, no preemption.

An admitted prompt starts from the pages the prefix cache matched (engine/kv_cache.py): its prefill computes only
the tokens after them.

Each step packs, within `max_batch_tokens`: every running decode (one token each), then prefill chunks of
admitted sequences still prefilling (oldest first), then newly admitted sequences from the head of the
queue while `max_num_seqs` and the unreserved KV pages allow. Admission is strictly FIFO: when the head of
the queue does not fit, later requests wait behind it (no overtaking, so a long prompt is never starved).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from mstar_common.engine.kv_cache import PageAllocator
from mstar_common.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at its `num_computed_tokens`, computed this step."""

    seq: Sequence
    num_tokens: int

    @property
    def is_sampling(self) -> bool:
        """Whether this chunk reaches the sequence's last token, so the row produces a token."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_tokens: int = 0

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.chunks.append(ScheduledChunk(seq, num_tokens))
        self.num_tokens += num_tokens

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class RequestHooks(Protocol):
    """Optional model hooks for a per-request resource beside the KV pages (e.g. Whisper's cross-KV slot):
    admission also waits for `can_admit_request()`, `admit_request(seq.request_state)` returns the slot
    (`metadata.request_slots` carries it per row), and `release_request(slot)` runs when the sequence ends."""

    def can_admit_request(self) -> bool: ...
    def admit_request(self, state: Any) -> int: ...
    def release_request(self, slot: int) -> None: ...
    @property
    def num_used_request_slots(self) -> int: ...  # held now (the `mstar_state_slots_used` gauge)


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_num_seqs: int, max_batch_tokens: int,
                 request_hooks: RequestHooks | None = None) -> None:
        self.allocator = allocator
        self.request_hooks = request_hooks
        self.refused: list[tuple[Sequence, str]] = []  # admitted but refused by `admit_request`; the engine ends them
        self.max_num_seqs, self.max_batch_tokens = max_num_seqs, max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def footprint(self, seq: Sequence) -> int:
        return self.allocator.pages_for(seq.max_num_tokens)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_batch_tokens
        # decode (a sequence whose last output is already launched only awaits its LENGTH stop)
        for seq in self.running:
            if seq.num_uncomputed_tokens == 1 and budget > 0 and seq.num_output_tokens < seq.params.max_tokens:
                budget -= self._take(plan, seq, 1)
        # prefill of admitted sequences
        for seq in self.running:
            if seq.num_uncomputed_tokens > 1 and budget > 0:
                budget -= self._take(plan, seq, min(seq.num_uncomputed_tokens, budget))
        # admission
        while self.waiting and budget > 0 and self._can_admit(self.waiting[0]):
            seq = self._admit()
            if seq is not None:
                budget -= self._take(plan, seq, min(seq.num_uncomputed_tokens, budget))
        return plan

    def finish(self, seq: Sequence) -> None:
        """Drop `seq` from the queues and free its pages; harmless for a sequence already finished."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.page_table)
        if seq.request_slot >= 0 and self.request_hooks is not None:
            self.request_hooks.release_request(seq.request_slot)
            seq.request_slot = -1
        seq.status = SequenceStatus.FINISHED

    def _can_admit(self, seq: Sequence) -> bool:
        if self.request_hooks is not None and not self.request_hooks.can_admit_request():
            return False
        return len(self.running) < self.max_num_seqs and self.allocator.can_allocate(self.footprint(seq))

    def _admit(self) -> Sequence | None:
        seq = self.waiting.popleft()
        if self.request_hooks is not None:
            try:
                seq.request_slot = self.request_hooks.admit_request(seq.request_state)
            except Exception as exc:  # noqa: BLE001 - a bad request state fails that request only
                logger.exception("admitting request %r failed", seq.request_id)
                self.refused.append((seq, f"{type(exc).__name__}: {exc}"))
                return None
        self.allocator.allocate(seq.page_table, self.footprint(seq))
        # pages whose KV an earlier prompt with the same start left in the prefix index (kv_cache.py); the last
        # prompt token is always computed, since its row samples the first output
        max_pages = (seq.num_prompt_tokens - 1) // self.allocator.page_size
        seq.num_computed_tokens = self.allocator.match_prefix(seq.page_table, seq.token_ids, max_pages)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return seq

    def _take(self, plan: StepPlan, seq: Sequence, num_tokens: int) -> int:
        self.allocator.grow(seq.page_table, seq.num_computed_tokens + num_tokens)
        plan.add(seq, num_tokens)
        return num_tokens
