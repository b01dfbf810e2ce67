"""Runs one scheduled step: packs the chunks into varlen inputs, runs the model, samples the sampling rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from mstar_common.engine.attention import AttentionBackend, AttentionMetadata, build_attention_metadata
from mstar_common.engine.kv_cache import KVCache, KVSpec
from mstar_common.engine.sampler import Sampler
from mstar_common.engine.scheduler import StepPlan
from mstar_common.engine.sequence import Sequence


class CausalLM(Protocol):
    """What the engine needs from a decoder-only model (see `families/qwen3/modeling.py`)."""

    kv_spec: KVSpec
    max_position_embeddings: int
    attn_backend: AttentionBackend

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                 kv_cache: KVCache) -> torch.Tensor:
        """`input_ids`/`positions` `[T]` -> hidden states `[T, hidden]`."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[B, hidden]` -> `[B, vocab]`."""


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    sample_indices: torch.Tensor  # [B'] int64: packed index of the last token of each sampling row
    sampling_seqs: list[Sequence]


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, sampler: Sampler, device: torch.device) -> None:
        self.model, self.kv_cache, self.sampler, self.device = model, kv_cache, sampler, device

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> list[int]:
        """One token per sampling row of `plan`, in plan order (rows that only prefill produce nothing)."""
        inputs = self.prepare(plan)
        self.model.attn_backend.prepare(inputs.metadata)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata, self.kv_cache)
        if not inputs.sampling_seqs:
            return []
        logits = self.model.compute_logits(hidden[inputs.sample_indices]).float()
        seqs = inputs.sampling_seqs
        tokens = self.sampler.sample(
            logits, [s.params for s in seqs], [s.generator for s in seqs], [s.token_ids for s in seqs]
        )
        return tokens.tolist()

    def prepare(self, plan: StepPlan) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        sample_indices: list[int] = []
        sampling_seqs: list[Sequence] = []
        for chunk in plan.chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            end = start + chunk.num_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            if chunk.is_sampling:
                sample_indices.append(len(input_ids) - 1)
                sampling_seqs.append(seq)
        metadata = build_attention_metadata(
            query_lens=[c.num_tokens for c in plan.chunks],
            context_lens=[c.seq.num_computed_tokens + c.num_tokens for c in plan.chunks],
            page_tables=[c.seq.page_table.pages for c in plan.chunks],
            page_size=self.kv_cache.page_size,
            sink_page=self.kv_cache.sink_page,
            device=self.device,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            metadata=metadata,
            sample_indices=torch.tensor(sample_indices, dtype=torch.int64, device=self.device),
            sampling_seqs=sampling_seqs,
        )
