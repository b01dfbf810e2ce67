"""The repetition penalty's token history, kept on the device so penalised steps replay captured graphs.

HF semantics (`RepetitionPenaltyLogitsProcessor`): at every step, each token id present in the row's prompt
or output so far has its logit divided by the penalty when positive, multiplied by it otherwise. Reading
that history from host lists costs a host sync per step (the newest token) and a per-row Python walk, so
the engine keeps it here instead: a `seen` mask per penalised sequence, filled from its prompt when it
first samples and updated on the device with each sampled token, inside the captured graph.

Slots. A penalised sequence holds one slot from its first sampling step until it ends; every other row
(no penalty, graph padding) points at a scratch slot with penalty 1.0, which leaves its logits as they are.
All writes are stream-ordered after the steps already launched, so a slot freed and handed to a new
sequence is cleared after the old sequence's last in-flight step has recorded into it.

Logits window. A model whose head computes only the ids `[offset, offset + width)` (`logits_offset`) gets
a mask of that width; ids outside the window can never be sampled, so they need no history.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class PenaltyState:
    def __init__(self, num_slots: int, width: int, offset: int, device: torch.device) -> None:
        self.width, self.offset, self.device = width, offset, device
        self.seen = torch.zeros(num_slots + 1, width, dtype=torch.bool, device=device)
        self.scratch = num_slots  # the slot of rows without a penalty
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, token_ids: Iterable[int]) -> int:
        """A cleared slot marking `token_ids` (the prompt and any output already known; -1 placeholders and
        ids outside the window are skipped)."""
        if not self._free:
            raise RuntimeError("no repetition-penalty slot is free (more penalised sequences than max_num_seqs)")
        slot = self._free.pop()
        self.seen[slot].zero_()
        ids = sorted({t - self.offset for t in token_ids if 0 <= t - self.offset < self.width})
        if ids:
            index = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
            self.seen[slot].index_fill_(0, index, True)
        return slot

    def release(self, slot: int) -> None:
        if 0 <= slot < self.scratch:
            self._free.append(slot)

    def apply(self, logits: torch.Tensor, slots: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
        """`logits` `[B, width]` (fp32 or the model's dtype), `slots` `[B]` int, `penalty` `[B]` fp32 -> penalised
        fp32 logits, a new tensor (graph safe). On CUDA one launch (mstar_kernels/penalty.py), the same values."""
        if logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1:
            from mstar_kernels.penalty import penalised_logits

            return penalised_logits(logits, self.seen.view(torch.uint8), slots, penalty)
        logits = logits.float()
        seen = self.seen[slots.long()]
        factor = penalty[:, None]
        penalised = torch.where(logits > 0, logits / factor, logits * factor)
        return torch.where(seen, penalised, logits)

    def greedy(self, logits: torch.Tensor, slots: torch.Tensor, penalty: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's greedy window index under the penalty, recorded: `apply`, argmax and `record` in one
        (graph safe). On CUDA that is mstar_kernels/argmax.py's `penalised_argmax` on the logits as they are (bf16
        read as fp32), two launches, storing into `out` where given; elsewhere the torch ops (`out` not used)."""
        if logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1:
            from mstar_kernels.argmax import penalised_argmax

            return penalised_argmax(logits, self.seen.view(torch.uint8), slots, penalty, out)
        tokens = self.apply(logits.float(), slots, penalty).argmax(dim=-1)
        self.record(slots, tokens)
        return tokens

    def record(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        """Mark each row's sampled window index (graph safe; padding rows write the scratch slot)."""
        if sampled.is_cuda:
            from mstar_kernels.penalty import record_seen

            record_seen(self.seen.view(torch.uint8), slots, sampled)
            return
        flat = slots.long() * self.width + sampled.long()
        self.seen.view(-1).index_fill_(0, flat, True)  # a scalar fill: no host tensor to copy during capture
