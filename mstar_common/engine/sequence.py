"""One request's state inside the autoregressive engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from mstar_common.engine.kv_cache import PageTable
from mstar_common.engine.types import FinishReason, SamplingParams

# on_output(request_id, new_token_ids, finish_reason, error): finish_reason is set on the last call only.
OutputCallback = Callable[[str, list[int], FinishReason | None, str | None], None]


class SequenceStatus(Enum):
    WAITING = "waiting"  # queued, holds no pages
    RUNNING = "running"  # admitted: holds a reservation, being prefilled or decoded
    FINISHED = "finished"


@dataclass(slots=True, eq=False)  # identity equality: queues remove by object
class Sequence:
    """Tokens, progress and pages of one request.

    Prefill and decode are one rule: each step computes some of the tokens whose KV is not yet cached
    (`token_ids[num_computed_tokens:]`); when a step reaches the last token, that row samples the next one.
    A decode step is just the case with one uncomputed token (the last sampled one).

    While a launched step's token is not yet back on the host, `token_ids` ends with a placeholder (-1) and
    `num_computed_tokens` already counts the launched chunk (see `model_runner.py`).
    """

    request_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    params: SamplingParams
    on_output: OutputCallback
    generator: torch.Generator | None = None
    seed: int = 0  # keys the on-device draws (the request's seed, or one the engine drew for it)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or being written by a launched step)
    pending_row: int = -1  # this sequence's row in the in-flight step's tokens while its newest token is pending
    request_state: Any = None  # a model's own per-request state (see `RequestHooks` in scheduler.py)
    request_slot: int = -1  # the slot the model's `admit_request` gave this sequence
    penalty_slot: int = -1  # its repetition-penalty history slot on the device (engine/penalty.py), if any
    page_table: PageTable = field(default_factory=PageTable)
    status: SequenceStatus = SequenceStatus.WAITING

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def max_num_tokens(self) -> int:
        """The most tokens this sequence can ever hold; its KV footprint is sized from it."""
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
