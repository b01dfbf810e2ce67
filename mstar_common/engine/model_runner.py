"""Runs scheduled steps: packs the chunks into varlen inputs, runs the model (replaying a captured CUDA graph
when the step fits a bucket, eager otherwise), samples, and hands back one token per sampling row.

Launch and collect. `launch(plan)` enqueues a whole step and returns a `PendingStep` at once;
`PendingStep.tokens()` waits for that step's tokens, the one host sync of a step. The engine launches step
N+1 before it collects step N: a decode row whose newest token is still on the device (a placeholder `-1` at
the end of its token list, `seq.pending_row` its row in step N) gets it by a device-side gather from step N's
tokens, so the host prepares step N+1 while step N runs. `run(plan)` is launch-then-collect.

Sampling. On CUDA every filter runs on the device from per-row parameter tensors (`mstar_kernels/sampling.py`),
inside the graph when one is replayed; the draw is keyed by (request seed, output index). On the CPU the
`Sampler` (torch generators) is used. On CUDA a repetition penalty reads the token history from the device
(`penalty.py`), so penalised steps replay graphs and overlap too; on the CPU the Sampler reads host lists.

Per-token scores (optional model hooks). A model with `token_logprobs = True` gets, for every token it samples, the
token's log-probability under its processed logits (after `process_logits`, before any penalty or temperature),
and one with a `probe_token_id` gets `probe(hidden)` evaluated at every prompt position holding that id (whisper:
the no-speech probability at <|startoftranscript|>). Both cross the bus with the step's tokens, in the same
pinned copy behind the same event, and the engine hands them to the model's `note_sampled` / `note_probe`.
Such a model samples on the host after a replay (as one with `process_logits` does: the graphs then stop at the
logits), a step that probes runs eager, and its engine keeps no prefix cache (a probed position inside a reused
prefix would never run).

Logits window. A model may compute logits for the ids `[logits_offset, vocab_size)` only (a speech LM whose
head covers its audio tokens): sampling runs over that window and the offset is added to the sampled index.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from mstar_common.engine.attention import AttentionBackend, AttentionMetadata, build_attention_metadata
from mstar_common.engine.kv_cache import KVCache, KVSpec
from mstar_common.engine.penalty import PenaltyState
from mstar_common.engine.sampler import Sampler, apply_repetition_penalty
from mstar_common.engine.scheduler import StepPlan
from mstar_common.engine.sequence import Sequence

PLACEHOLDER = -1  # a sampled token still on the device
_SEED_MIX = 0x9E3779B97F4A7C15
_INT63 = (1 << 63) - 1


class CausalLM(Protocol):
    """What the engine needs from a decoder-only model (see `layers/causal_lm.py`)."""

    kv_spec: KVSpec
    max_position_embeddings: int
    attn_backend: AttentionBackend

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                 kv_cache: KVCache) -> torch.Tensor:
        """`input_ids`/`positions` `[T]` -> hidden states `[T, hidden]`."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[B, hidden]` -> `[B, vocab - logits_offset]` (`logits_offset`, optional, defaults to 0)."""

    # Optional: `gathers_input_ids = True` when `__call__` also takes `gather=(dst, src, count, previous)` and sets
    # `input_ids[dst[i]] = previous[src[i]]` for `i < count[0]` itself (a captured step's overlap gather, then
    # inside the embedding's launch); without it the graph runs mstar_kernels/gather_tokens.py before the model.


@dataclass(slots=True)
class HostBatch:
    """One step's inputs on the host, in plan order."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    page_tables: list[list[int]] = field(default_factory=list)
    request_slots: list[int] = field(default_factory=list)  # each row's `seq.request_slot`
    sample_indices: list[int] = field(default_factory=list)  # packed index of each sampling row's last token
    sampling_seqs: list[Sequence] = field(default_factory=list)
    gather_dst: list[int] = field(default_factory=list)  # packed index whose id is the previous step's ...
    gather_src: list[int] = field(default_factory=list)  # ... token of this row
    penalty_slots: list[int] = field(default_factory=list)  # per sampling row (PenaltyState; device history)
    penalties: list[float] = field(default_factory=list)  # per sampling row, 1.0 = off
    history_on_device: bool = False
    probe_indices: list[int] = field(default_factory=list)  # packed index of each prompt position to probe ...
    probe_seqs: list[Sequence] = field(default_factory=list)  # ... and its sequence (model.probe_token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_rows(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @property
    def is_greedy(self) -> bool:
        return all(seq.params.is_greedy for seq in self.sampling_seqs)

    def filters(self, vocab_size: int) -> bool:
        return asks_for_filters(self.sampling_seqs, vocab_size)

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the rows' token history on the host (repetition penalty)."""
        return not self.history_on_device and any(seq.params.repetition_penalty != 1.0 for seq in self.sampling_seqs)


@dataclass(slots=True)
class SamplingColumns:
    """Per-row sampling parameters as host lists; the device sampler's inputs."""

    is_greedy: list[int]
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    seeds: list[int]


def asks_for_filters(seqs: list[Sequence], vocab_size: int) -> bool:
    """Whether a sampling row asks for top-k, top-p or min-p (else the sampler's filters can be left out)."""
    return any(not p.is_greedy and (0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0)
               for p in (seq.params for seq in seqs))


def sampling_columns(seqs: list[Sequence], vocab_size: int) -> SamplingColumns:
    cols = SamplingColumns([], [], [], [], [], [])
    for seq in seqs:
        p = seq.params
        greedy = p.is_greedy
        cols.is_greedy.append(int(greedy))
        cols.temperature.append(1.0 if greedy else p.temperature)
        cols.top_k.append(p.top_k if 0 < p.top_k < vocab_size and not greedy else vocab_size)
        cols.top_p.append(1.0 if greedy else p.top_p)
        cols.min_p.append(0.0 if greedy else p.min_p)
        # The draw for output index i of a request depends only on (its seed, i).
        cols.seeds.append((seq.seed * _SEED_MIX + seq.num_output_tokens) & _INT63)
    return cols


@dataclass(slots=True)
class StepCounts:
    """Running totals of the steps a runner launched, for the component's metrics (backends/metrics.py): the
    steps a captured graph replayed, the rows and packed tokens the steps computed, and the padding the replays
    computed besides (a decode graph's rows, or a prefill/mixed graph's tokens, beyond the step's own)."""

    graph_steps: int = 0
    rows: int = 0
    tokens: int = 0
    padding: int = 0

    def add(self, kind: tuple[str, int], rows: int, tokens: int) -> None:
        """A launched step: `kind` is what ran it, a graph's (kind, size) or ("eager", 0)."""
        self.rows += rows
        self.tokens += tokens
        name, size = kind
        if name != "eager":
            self.graph_steps += 1
            self.padding += size - (rows if name == "decode" else tokens)


class PendingStep:
    """A launched step: `tokens()` waits for it and returns one token per sampling row, in plan order.

    With a model's per-token scores (module docstring) `floats` holds the sampled tokens' log-probabilities
    (`num_logprobs`, one per sampling row) followed by one probe value per `probe_seqs` entry."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor, event=None, floats: torch.Tensor | None = None,
                 num_logprobs: int = 0, probe_seqs: list[Sequence] | None = None) -> None:
        self.seqs = seqs
        self.kind = ("eager", 0)  # what ran: a graph's (kind, size), or eager (MSTAR_STEP_TIMES' breakdown)
        self.num_tokens = 0  # the step's packed tokens (a graph's size counts the padding too)
        self.indices: list[int] = []  # where each row's token goes in its token list (set by the engine)
        self.written: list[tuple[Sequence, int]] = []  # each chunk's sequence, and its tokens with KV after this step
        self._tokens, self.event = tokens, event
        self._floats, self.num_logprobs, self.probe_seqs = floats, num_logprobs, probe_seqs or []

    def tokens(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self._tokens.tolist()

    def scores(self) -> tuple[list[float] | None, list[float]]:
        """(each sampling row's log-probability, or None; each probe's value), once `tokens()` has returned."""
        if self._floats is None:
            return None, []
        values = self._floats.tolist()
        return (values[: self.num_logprobs] if self.num_logprobs else None), values[self.num_logprobs:]


class TokenReadback:
    """Copies each step's tokens into one of two pinned host buffers without blocking, behind an event.

    Two buffers suffice: the engine collects step N before it launches step N+2. The buffers take the tokens'
    dtype (a replayed graph's int32, an eager step's int64), so the copy is one device-to-host transfer; into a
    buffer of another dtype torch would first launch a conversion kernel on the stream, between two replays
    (`MSTAR_READBACK_NATIVE=0` keeps int64 buffers, for A/Bs).
    """

    def __init__(self, max_rows: int, device: torch.device, timing: bool = False) -> None:
        from mstar_common.config import env_switch

        self._max_rows = max_rows
        self._native = env_switch("MSTAR_READBACK_NATIVE", True)
        self._buffers: dict[torch.dtype, list[torch.Tensor]] = {}
        self._parity = 0
        self.device = device
        self.timing = timing  # events that can be timed (MSTAR_STEP_TIMES)

    def _pair(self, dtype: torch.dtype, size: int) -> list[torch.Tensor]:
        """The two buffers of `dtype`, of at least `size` elements: a step of more rows (or scores) than the pair
        holds gets a larger pair; the old one stays alive in the steps that still read it."""
        dtype = dtype if self._native or dtype.is_floating_point else torch.int64
        pair = self._buffers.get(dtype)
        if pair is None or pair[0].numel() < size:
            rows = max(size, self._max_rows, 2 * pair[0].numel() if pair is not None else 0)
            pair = self._buffers[dtype] = [torch.empty(rows, dtype=dtype, pin_memory=True) for _ in range(2)]
        return pair

    def start(self, seqs: list[Sequence], tokens: torch.Tensor, published: torch.Tensor | None = None,
              floats: torch.Tensor | None = None, num_logprobs: int = 0,
              probe_seqs: list[Sequence] | None = None) -> PendingStep:
        """The step's tokens behind an event: copied from `tokens` (device), or, where a replayed graph wrote them
        into page-locked memory itself (`published`, mstar_kernels/step_io.py), read there with nothing copied.
        A model's per-token scores (`floats`, float32 on the device) are copied beside them, behind the same event."""
        buffer = published
        parity = self._parity
        if buffer is None:
            buffer = self._pair(tokens.dtype, len(seqs))[parity][: len(seqs)]
            buffer.copy_(tokens[: len(seqs)], non_blocking=True)
        host_floats = None
        if floats is not None:
            host_floats = self._pair(torch.float32, floats.numel())[parity][: floats.numel()]
            host_floats.copy_(floats, non_blocking=True)
        self._parity ^= 1
        event = torch.cuda.Event(enable_timing=self.timing)
        event.record()
        return PendingStep(seqs, buffer, event, host_floats, num_logprobs, probe_seqs)


def logits_window(model, vocab_size: int) -> tuple[int, int]:
    """(offset, width) of the ids a model's `compute_logits` covers."""
    offset = int(getattr(model, "logits_offset", 0))
    if not 0 <= offset < vocab_size:
        raise ValueError(f"model logits_offset {offset} is outside the vocabulary [0, {vocab_size})")
    return offset, vocab_size - offset


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, sampler: Sampler, device: torch.device,
                 vocab_size: int | None = None, graphs=None, penalty: PenaltyState | None = None,
                 timing_events: bool = False) -> None:
        self.model, self.kv_cache, self.sampler, self.device = model, kv_cache, sampler, device
        self.vocab_size = vocab_size
        self.logits_offset = int(getattr(model, "logits_offset", 0))
        self.penalty = penalty  # the device-side repetition-penalty history (CUDA), or None
        self.graphs = graphs  # a CudaGraphRunner (engine/cuda_graph.py), or None
        self.is_device_sampling = device.type == "cuda" or (graphs is not None and graphs.is_device_sampling)
        self.has_request_slots = hasattr(model, "admit_request")
        self._process_logits = getattr(model, "process_logits", None)  # a model's own logits rules, if any
        # per-token scores (module docstring): the sampled tokens' log-probabilities, and a prompt-position probe
        self._wants_logprobs = bool(getattr(model, "token_logprobs", False))
        self._probe_token = getattr(model, "probe_token_id", None)
        self._step_logprobs: torch.Tensor | None = None  # set by `sample`, taken by `launch`
        self._step_probes: torch.Tensor | None = None  # set by `_run_eager`, taken by `launch`
        self._last_tokens: torch.Tensor | None = None  # device tokens of the last launched step
        self._readback = TokenReadback(4096, device, timing_events) if device.type == "cuda" else None
        self.counts = StepCounts()
        self.last_step: PendingStep | None = None  # the step `run` last ran
        # the last launch's seconds in `prepare` and inside a graph's replay (MSTAR_STEP_TIMES' launch split)
        self.last_prepare_s = self.last_replay_s = 0.0

    def run(self, plan: StepPlan) -> list[int]:
        """One token per sampling row of `plan`, in plan order (rows that only prefill produce nothing); the step
        stays in `last_step` (its per-token scores)."""
        self.last_step = self.launch(plan)
        return self.last_step.tokens()

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> PendingStep:
        started = time.perf_counter()
        batch = self.prepare(plan)
        self.last_prepare_s, self.last_replay_s = time.perf_counter() - started, 0.0
        tokens = published = key = None
        self._step_logprobs = self._step_probes = None
        if self.graphs is not None and not batch.probe_indices:  # a probed prompt runs eager (its hidden states)
            tokens = self.graphs.try_replay(batch, self._last_tokens, self.sample)
            published = self.graphs.last_host_tokens  # None unless a graph published its tokens
            key = self.graphs.last_key
            self.last_replay_s = self.graphs.last_replay_s
        if tokens is None:
            tokens = self._run_eager(batch)
        self._last_tokens = tokens
        floats, num_logprobs = self._step_scores()
        if self._readback is not None:
            pending = self._readback.start(batch.sampling_seqs, tokens, published, floats, num_logprobs,
                                           batch.probe_seqs)
        else:  # a replay's tokens live in a static buffer the next replay overwrites
            pending = PendingStep(batch.sampling_seqs, tokens.clone() if self.graphs is not None else tokens,
                                  floats=floats, num_logprobs=num_logprobs, probe_seqs=batch.probe_seqs)
        pending.kind = ("eager", 0) if key is None else (key[0], key[1])
        pending.num_tokens = batch.num_tokens
        self.counts.add(pending.kind, batch.num_rows, batch.num_tokens)
        return pending

    def _step_scores(self) -> tuple[torch.Tensor | None, int]:
        """The step's per-token scores as one float32 tensor (log-probabilities, then probes), and how many of
        them are log-probabilities."""
        logprobs, probes = self._step_logprobs, self._step_probes
        self._step_logprobs = self._step_probes = None
        parts = [t.float().reshape(-1) for t in (logprobs, probes) if t is not None]
        if not parts:
            return None, 0
        return (torch.cat(parts) if len(parts) > 1 else parts[0]), (0 if logprobs is None else logprobs.numel())

    def release(self, seq: Sequence) -> None:
        """Give back what a finished sequence holds here (its penalty slot)."""
        if self.penalty is not None and seq.penalty_slot >= 0:
            self.penalty.release(seq.penalty_slot)
            seq.penalty_slot = -1

    def prepare(self, plan: StepPlan) -> HostBatch:
        batch = HostBatch(history_on_device=self.penalty is not None)
        page_size = self.kv_cache.page_size
        for chunk in plan.chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            end = start + chunk.num_tokens
            ids = seq.token_ids[start:end]
            if ids[-1] == PLACEHOLDER:  # only ever a decode row's newest token
                batch.gather_dst.append(len(batch.input_ids) + len(ids) - 1)
                batch.gather_src.append(seq.pending_row)
                ids[-1] = 0
            if self._probe_token is not None and start < seq.num_prompt_tokens:
                for offset, token in enumerate(ids[: seq.num_prompt_tokens - start]):
                    if token == self._probe_token:
                        batch.probe_indices.append(len(batch.input_ids) + offset)
                        batch.probe_seqs.append(seq)
            batch.input_ids += ids
            batch.positions += range(start, end)
            pages = seq.page_table.pages
            batch.slot_mapping += [pages[pos // page_size] * page_size + pos % page_size for pos in range(start, end)]
            batch.query_lens.append(chunk.num_tokens)
            batch.context_lens.append(end)
            batch.page_tables.append(seq.page_table.pages)
            batch.request_slots.append(seq.request_slot)
            if chunk.is_sampling:
                batch.sample_indices.append(len(batch.input_ids) - 1)
                batch.sampling_seqs.append(seq)
                if self.penalty is not None:
                    slot, factor = self._penalty_row(seq)
                    batch.penalty_slots.append(slot)
                    batch.penalties.append(factor)
        return batch

    def _penalty_row(self, seq: Sequence) -> tuple[int, float]:
        """(slot, factor) of a sampling row; its slot is taken and filled on its first sampling step."""
        factor = seq.params.repetition_penalty
        if factor == 1.0:
            return self.penalty.scratch, 1.0
        if seq.penalty_slot < 0:
            seq.penalty_slot = self.penalty.acquire(seq.token_ids)
        return seq.penalty_slot, factor

    def _run_eager(self, batch: HostBatch) -> torch.Tensor:
        device = self.device
        input_ids = torch.tensor(batch.input_ids, dtype=torch.int64, device=device)
        if batch.gather_dst:
            dst = torch.tensor(batch.gather_dst, dtype=torch.int64, device=device)
            src = torch.tensor(batch.gather_src, dtype=torch.int64, device=device)
            input_ids[dst] = self._last_tokens[src].to(torch.int64)
        metadata = build_attention_metadata(
            batch.query_lens, batch.context_lens, batch.page_tables,
            page_size=self.kv_cache.page_size, sink_page=self.kv_cache.sink_page, device=device,
        )
        if self.has_request_slots:
            metadata.request_slots = torch.tensor(batch.request_slots, dtype=torch.int32, device=device)
        self.model.attn_backend.prepare(metadata)
        positions = torch.tensor(batch.positions, dtype=torch.int64, device=device)
        hidden = self.model(input_ids, positions, metadata, self.kv_cache)
        if batch.probe_indices:
            self._step_probes = self.model.probe(hidden[torch.tensor(batch.probe_indices, device=device)])
        if not batch.sampling_seqs:
            return torch.empty(0, dtype=torch.int64, device=device)
        sample_indices = torch.tensor(batch.sample_indices, dtype=torch.int64, device=device)
        logits = self.model.compute_logits(hidden[sample_indices]).float()
        return self.sample(logits, batch.sampling_seqs)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """`logits` `[B, width]` fp32 (may be modified) -> one token id per row, after the model's own logits
        rules (ids: the window's offset added)."""
        if self._process_logits is not None:
            logits = self._process_logits(logits, seqs)
        # the scores before any penalty or temperature, in a tensor of their own (a sampler may scale in place)
        logprobs = torch.log_softmax(logits, dim=-1) if self._wants_logprobs else None
        tokens = self._draw(logits, seqs)
        if logprobs is not None:
            self._step_logprobs = logprobs.gather(1, tokens.reshape(-1, 1).to(torch.int64)).reshape(-1)
        offset = self.logits_offset
        return tokens + offset if offset else tokens

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One id per row of the logits window (`logits_offset` not added)."""
        offset = self.logits_offset

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype).to(logits.device, non_blocking=True)

        cols = sampling_columns(seqs, logits.shape[-1]) if self.is_device_sampling else None
        slots = None
        if self.penalty is not None:  # the history is on the device
            rows = [self._penalty_row(s) for s in seqs]
            slots = column([slot for slot, _ in rows], torch.int64)
            factors = column([f for _, f in rows], torch.float32)
            if cols is not None and all(cols.is_greedy):
                return self.penalty.greedy(logits, slots, factors)  # as the captured greedy step does it
            logits = self.penalty.apply(logits, slots, factors)
            history = [[] for _ in seqs]
        else:
            history = [[t - offset for t in s.token_ids if t >= offset] if s.params.repetition_penalty != 1.0 else []
                       for s in seqs]
        if not self.is_device_sampling:
            tokens = self.sampler.sample(logits, [s.params for s in seqs], [s.generator for s in seqs], history)
        else:
            if slots is None:
                logits = apply_repetition_penalty(logits, [s.params.repetition_penalty for s in seqs], history)
            if all(cols.is_greedy):
                from mstar_common.engine.sampler import greedy_tokens

                tokens = greedy_tokens(logits)
            else:
                from mstar_kernels.sampling import sample_on_device

                filters = asks_for_filters(seqs, logits.shape[-1])
                tokens = sample_on_device(
                    logits, column(cols.is_greedy, torch.bool), column(cols.temperature, torch.float32),
                    column(cols.top_k, torch.int32), column(cols.top_p, torch.float32),
                    column(cols.min_p, torch.float32), column(cols.seeds, torch.int64), filters=filters,
                )
        if slots is not None:
            self.penalty.record(slots, tokens)
        return tokens
