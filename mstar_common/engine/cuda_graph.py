"""Captured CUDA graphs for the autoregressive step: capture once at startup, replay when a step fits a bucket.

Buckets. Pure-decode steps are captured per row count (`decode_buckets`, e.g. 1, 2, 4, 8, 16, 24, ... 256);
prefill and mixed steps per packed-token count (`token_buckets`), with up to `min(max_rows, tokens)` rows.
A step pads up to the smallest bucket that holds it: padding tokens write the KV sink page, padding rows
attend one sink token and their samples are dropped. Anything larger runs eager.

Variants. Each bucket is captured greedy (argmax) and, with `capture_sampling`, sampling (temperature,
top-k, top-p, min-p and seeded draws on the device from parameter buffers) and sampling by temperature alone
(the same draws without the filters' launches, for steps where no row asks for top-k, top-p or min-p): the
whole step, sampling included, is one replay. A repetition penalty is applied inside the graphs too, from a
device-side token history (engine/penalty.py, `penalty_slots`). A model with its own logits rules
(`process_logits`) is captured up to the logits; its rules and the sampler run on the replay's logits.

Buffers. Every input of every graph is a typed view into one static flat device buffer with one named layout
(`StepBuffers`); the host fills a page-locked mirror (two, alternating, so a fill never races the previous
step's read). On a GPU, where the graph samples, its first kernel reads the mirror itself and its last writes the
tokens to page-locked memory (mstar_kernels/step_io.py, `MSTAR_ZERO_COPY_STEP_IO`): nothing runs on the stream
between two replays. Otherwise one copy moves a step's inputs before the replay and the tokens are copied back
after it. Outputs land in `out_tokens` (the next step's gather reads them there). All graphs share
one memory pool and are captured largest first. A bucket that runs out of GPU memory while it is captured is
dropped with a warning, and its steps take the next larger captured bucket or run eager;
`MSTAR_REQUIRE_ACCELERATOR_GRAPHS=1` refuses to start instead (capture_policy.py).

On a CPU (tests), `FakeGraph` stands in for `torch.cuda.CUDAGraph`: it re-runs the captured closure, which
exercises the same buffers, padding and bucketing.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from dataclasses import dataclass, field

import numpy as np
import torch

from mstar_common.engine.attention import AttentionMetadata, build_prefill_work, prefill_work_capacity
from mstar_common.engine.capture_policy import capture_or_skip
from mstar_common.engine.kv_cache import KVCache

logger = logging.getLogger(__name__)

DECODE = "decode"
MIXED = "mixed"
GREEDY, SAMPLED, PLAIN = 0, 1, 2  # a graph's sampling variant (its key's third field): argmax; every filter; none
_VARIANT_NAMES = {GREEDY: "", SAMPLED: " (sampling)", PLAIN: " (sampling, temperature alone)"}


def default_decode_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, 96, then steps of 32 to 256, of 64 to 512, of 128 to 1,024, of 256 to 2,048
    and of 512 beyond, up to `max_rows`: past 8 rows a step replays a graph at most 25% (50% below 32) larger."""
    ladder = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    while ladder[-1] < max_rows:
        last = ladder[-1]
        ladder.append(last + (32 if last < 256 else 64 if last < 512 else 128 if last < 1024 else
                              256 if last < 2048 else 512))
    return sorted({b for b in ladder if b < max_rows} | {max_rows})


def default_token_buckets(max_tokens: int) -> list[int]:
    """64, 128, ..., 8,192, then 1.5x and 2x steps (12,288, 16,384, 24,576, ...) up to `max_tokens`."""
    ladder = [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    while ladder[-1] < max_tokens:
        ladder.append(ladder[-1] * 3 // 2 if ladder[-1] & (ladder[-1] - 1) == 0 else ladder[-1] * 4 // 3)
    return sorted({b for b in ladder if b < max_tokens} | {max_tokens})


@dataclass(slots=True)
class GraphConfig:
    decode_buckets: list[int]  # row counts captured for pure-decode steps
    token_buckets: list[int]  # packed-token counts captured for prefill and mixed steps
    capture_sampling: bool = True  # also capture the on-device sampling variant of each bucket


class FakeGraph:
    """`torch.cuda.CUDAGraph` stand-in for CPU tests: `replay()` re-runs the closure captured."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


@dataclass(slots=True)
class _Layout:
    """Named regions of one flat buffer."""

    offsets: dict[str, tuple[int, int]] = field(default_factory=dict)
    size: int = 0

    def add(self, name: str, length: int) -> None:
        self.offsets[name] = (self.size, length)
        self.size += length


class StepBuffers:
    """The static inputs and outputs of every graph, as typed views into one flat byte buffer on the device and
    two page-locked mirrors of it on the host (double-buffered: the host fills step N+1's while step N's copy may
    still be reading the other).

    The regions lie int64 (seeds), then float32 (sampling parameters, penalties), then int32 with the block
    tables last, so that one host-to-device copy of a prefix, ending at the last block-table row in use, moves a
    step's inputs (or, with zero-copy step IO, one kernel reads that prefix from the host mirror)."""

    def __init__(self, max_rows: int, max_tokens: int, max_pages: int, device: torch.device) -> None:
        self.max_rows, self.max_tokens, self.max_pages = max_rows, max_tokens, max_pages
        self.work_capacity = prefill_work_capacity(max_tokens, max_rows)
        ints, floats, longs = _Layout(), _Layout(), _Layout()
        for name, length in (("query_start_loc", max_rows + 1), ("context_lens", max_rows), ("request_slots", max_rows),
                             ("sample_indices", max_rows), ("is_greedy", max_rows), ("top_k", max_rows),
                             ("gather_dst", max_rows), ("gather_src", max_rows), ("gather_count", 1),
                             ("penalty_slots", max_rows),
                             ("work_rows", self.work_capacity),
                             ("work_firsts", self.work_capacity), ("input_ids", max_tokens),
                             ("positions", max_tokens), ("slot_mapping", max_tokens),
                             ("block_tables", max_rows * max_pages)):  # block tables last: copies end early
            ints.add(name, length)
        for name in ("temperature", "top_p", "min_p", "penalty"):
            floats.add(name, max_rows)
        longs.add("seeds", max_rows)
        self.layouts = {"longs": longs, "floats": floats, "ints": ints}  # in the flat buffer's order
        dtypes = {"ints": torch.int32, "floats": torch.float32, "longs": torch.int64}
        self.regions: dict[str, tuple[int, int]] = {}  # byte (start, end) of each dtype's region
        nbytes = 0
        for key, lay in self.layouts.items():
            size = lay.size * dtypes[key].itemsize
            self.regions[key] = (nbytes, nbytes + size)
            nbytes += -(-size // 8) * 8  # the next region 8-byte aligned
        self.raw_device = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        pin = device.type == "cuda"
        self.host_pair = torch.zeros((2, nbytes), dtype=torch.uint8, pin_memory=pin)  # the two host mirrors
        self.raw_host = [self.host_pair[0], self.host_pair[1]]
        # zero-copy step IO (mstar_kernels/step_io.py): the parity whose mirror the next replay reads, and the
        # page-locked arrays its tokens go to
        self.parity = torch.zeros(1, dtype=torch.int32, device=device)
        self.host_tokens = torch.zeros((2, max_rows), dtype=torch.int32, pin_memory=pin)
        self.device = {k: self._typed(self.raw_device, k, dtypes[k]) for k in self.layouts}
        self.host = [{k: self._typed(raw, k, dtypes[k]) for k in self.layouts} for raw in self.raw_host]
        self.views = {}
        for key, lay in self.layouts.items():
            for name, (start, length) in lay.offsets.items():
                self.views[name] = self.device[key][start:start + length]
        self.views["block_tables"] = self.views["block_tables"].view(max_rows, max_pages)
        self.out_tokens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self._host_views = [self._make_host_views(parity) for parity in range(2)]

    def _typed(self, raw: torch.Tensor, key: str, dtype: torch.dtype) -> torch.Tensor:
        start, end = self.regions[key]
        return raw[start:end].view(dtype)

    def host_views(self, parity: int) -> dict[str, np.ndarray]:
        return self._host_views[parity]

    def _make_host_views(self, parity: int) -> dict[str, np.ndarray]:
        views = {}
        for key, lay in self.layouts.items():
            array = self.host[parity][key].numpy()
            for name, (start, length) in lay.offsets.items():
                views[name] = array[start:start + length]
        return views

    def input_bytes(self, num_rows: int) -> int:
        """The length of the flat buffer's prefix a step of `num_rows` rows reads: up to its last block-table row."""
        start, _ = self.layouts["ints"].offsets["block_tables"]
        return self.regions["ints"][0] + (start + num_rows * self.max_pages) * 4

    def mirror(self, parity: int) -> None:
        """The other host mirror := this one (so a replay reads these inputs whichever parity it takes)."""
        self.raw_host[parity ^ 1].copy_(self.raw_host[parity])

    def copy_in(self, parity: int, num_rows: int) -> None:
        """Host mirror -> device: the flat buffer's prefix a step of `num_rows` rows reads, in one copy (the seed and
        float regions ride along whether the step reads them or not: `max_rows` x 24 bytes; one copy against three
        measured the same on the H200, docs/benchmarks.md)."""
        end = self.input_bytes(num_rows)
        self.raw_device[:end].copy_(self.raw_host[parity][:end], non_blocking=True)


class CudaGraphRunner:
    def __init__(self, model, kv_cache: KVCache, config: GraphConfig, max_rows: int, max_model_len: int,
                 vocab_size: int, device: torch.device, penalty=None) -> None:
        """`penalty`: the device-side repetition-penalty history (engine/penalty.py), applied inside the graphs."""
        if not model.attn_backend.is_graph_safe:
            raise ValueError(f"attention backend {model.attn_backend.name!r} cannot be captured in a CUDA graph; "
                             f"use 'triton' (or 'torch_static')")
        self.model, self.kv_cache, self.config, self.device = model, kv_cache, config, device
        self.attn_backend = model.attn_backend  # the backend whose kernels the graphs hold: it plans their replays
        self.vocab_size = vocab_size
        self.logits_offset = int(getattr(model, "logits_offset", 0))
        self.logits_width = vocab_size - self.logits_offset
        self.penalty = penalty
        self.decode_buckets = sorted(b for b in set(config.decode_buckets) if 1 <= b <= max_rows)
        self.token_buckets = sorted(b for b in set(config.token_buckets) if b >= 1)
        max_tokens = max(self.token_buckets + self.decode_buckets)
        self.max_rows, self.max_model_len = max_rows, max_model_len
        self.buffers = StepBuffers(max_rows, max_tokens, -(-max_model_len // kv_cache.page_size), device)
        self.is_device_sampling = device.type == "cuda"
        self.graphs: dict[tuple[str, int, int], object] = {}
        self._parity = 0
        self.sink_slot = kv_cache.sink_page * kv_cache.page_size
        self.num_replays = 0
        # A model with its own logits rules, or one that takes each sampled token's log-probability
        # (`token_logprobs`, model_runner.py), samples on the host after the replay, from the graph's logits.
        self.samples_in_graph = not (hasattr(model, "process_logits") or getattr(model, "token_logprobs", False))
        self.logits_out = None if self.samples_in_graph else torch.zeros(max_rows, self.logits_width, device=device)
        self.has_request_slots = hasattr(model, "admit_request")
        self.uncaptured: list[tuple[str, int, int]] = []  # buckets capture() had to drop (capture_policy.py)
        # The graphs read their inputs from the host mirror and write their tokens to page-locked memory themselves
        # (mstar_kernels/step_io.py), where they sample in the graph; `last_host_tokens`: the last replay's tokens
        # there.
        self.zero_copy = device.type == "cuda" and self.samples_in_graph and zero_copy_step_io()
        self.last_host_tokens: torch.Tensor | None = None
        self.last_replay_s = 0.0  # the last try_replay's seconds inside replay() (MSTAR_STEP_TIMES)
        self.last_key: tuple[str, int, int] | None = None  # the last `try_replay`'s graph, None where none ran

    # ---- capture ---------------------------------------------------------------------------------------------

    def keys(self) -> list[tuple[str, int, int]]:
        variants = [GREEDY, SAMPLED, PLAIN] if self.config.capture_sampling and self.samples_in_graph else [GREEDY]
        mixed = [(MIXED, t, v) for t in reversed(self.token_buckets) for v in variants]
        decode = [(DECODE, b, v) for b in reversed(self.decode_buckets) for v in variants]
        return mixed + decode  # largest first: later graphs fit in the pool the first ones grew

    @torch.inference_mode()
    def capture(self) -> None:
        keys = self.keys()
        is_cuda = self.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if is_cuda else None
        started = time.perf_counter()
        logger.info("[cuda graphs] capturing %d graphs: decode rows %s, prefill/mixed tokens %s, sampling %s",
                    len(keys), self.decode_buckets, self.token_buckets, self.config.capture_sampling)
        undecided = self._mid_rows_to_time()
        # a mixed bucket of as many tokens as an undecided decode bucket is captured after that bucket's choice, so
        # that it holds the projections the choice puts on that many rows (eager mixed steps will run them)
        keys = ([k for k in keys if k[0] != MIXED or k[1] not in undecided]
                + [k for k in keys if k[0] == MIXED and k[1] in undecided])
        for index, key in enumerate(keys, 1):
            t0 = time.perf_counter()
            name = f"{key[0]} {key[1]}{_VARIANT_NAMES[key[2]]}"
            if key[0] == DECODE and key[2] == GREEDY and key[1] in undecided:  # the bucket's other variants follow
                graph = self._capture_choosing_mid(key, pool, f"[cuda graphs] {name}")
            else:
                graph = capture_or_skip(f"[cuda graphs] {name}", lambda key=key: self._capture_one(key, pool))
            if graph is None:
                continue
            self.graphs[key] = graph
            logger.info("[cuda graphs] %d/%d %s captured in %.2f s", index, len(keys), name, time.perf_counter() - t0)
        if is_cuda:
            torch.cuda.synchronize()
        self.resync()  # the warm-ups flipped the device's parity
        self.uncaptured = [key for key in keys if key not in self.graphs]
        logger.info("[cuda graphs] %d of %d graphs captured in %.1f s%s", len(self.graphs), len(keys),
                    time.perf_counter() - started, f"; not captured (out of GPU memory): "
                    f"{[f'{kind} {size}{_VARIANT_NAMES[variant]}' for kind, size, variant in self.uncaptured]}"
                    if self.uncaptured else "")

    def _mid_rows_to_time(self) -> set[int]:
        """With MSTAR_MID_GEMM=auto on a GPU: the decode buckets of `mid_gemm_rows()` rows with no stored choice for
        this model (the stored ones are applied here)."""
        from mstar_common.layers.linear import (
            default_gemv_cache,
            known_mid_choices,
            mid_gemm_auto,
            mid_gemm_rows,
            mid_projections,
        )

        if self.device.type != "cuda" or not mid_gemm_auto() or not mid_projections(self.model):
            return set()
        known = known_mid_choices(self.model, default_gemv_cache())
        low, high = mid_gemm_rows()
        return {b for b in self.decode_buckets if low <= b <= high and b not in known}

    def _capture_choosing_mid(self, key: tuple[str, int, int], pool, what: str):
        """A decode bucket captured with its projections on cuBLAS and on mid_gemm under PDL (and, with
        MSTAR_MID_GEMM_FOLD=auto, on mid_gemm with the folds); the faster by `MID_MIN_GAIN` is kept, the choice
        applied to the model and stored (`choose_mid_form`)."""
        from mstar_common.layers.linear import (
            MID_FORMS,
            choose_mid_form,
            default_gemv_cache,
            mid_fold_auto,
            set_mid_rows,
        )

        rows = key[1]
        cublas = capture_or_skip(what, lambda: self._capture_one(key, pool))
        if cublas is None:
            return None
        set_mid_rows(self.model, rows, True)
        mid = capture_or_skip(f"{what} (mid_gemm)", lambda: self._capture_one(key, pool), kept="cuBLAS")
        if mid is None:
            set_mid_rows(self.model, rows, False)
            return cublas
        graphs = [cublas, mid]
        if mid_fold_auto():
            set_mid_rows(self.model, rows, True, fold=True)
            folded = capture_or_skip(f"{what} (mid_gemm with the folds)", lambda: self._capture_one(key, pool),
                                     kept="cuBLAS and mid_gemm")
            set_mid_rows(self.model, rows, True)
            graphs += [folded] if folded is not None else []
        try:
            context, times = self._time_replays(key, graphs)
        except Exception as exc:  # inputs this model's step cannot take: a speed choice must not stop the start
            logger.warning("[cuda graphs] decode %d: timing mid_gemm against cuBLAS failed (%s: %s); cuBLAS kept, "
                           "nothing stored", rows, type(exc).__name__, exc)
            set_mid_rows(self.model, rows, False)
            self._fill_padding(key)
            return cublas
        cublas_ms, mid_ms, *fold_ms = times
        form = choose_mid_form(self.model, rows, cublas_ms, mid_ms, default_gemv_cache(), *fold_ms)
        folds = f", {fold_ms[0]:.4f} ms with the folds" if fold_ms else ""
        logger.info("[cuda graphs] decode %d: %.4f ms a replay with the projections on mid_gemm under PDL%s, %.4f ms "
                    "on cuBLAS (%d tokens of context a row): %s (MSTAR_MID_GEMM=auto; stored)", rows, mid_ms, folds,
                    cublas_ms, context, form)
        return dict(zip(MID_FORMS, graphs, strict=False))[form]

    def _time_replays(self, key: tuple[str, int, int], graphs, rounds: int = 5,
                      replays: int = 20) -> tuple[int, list[float]]:
        """ms per replay of each graph of a decode bucket (median of `rounds`, the graphs in alternation) on the
        inputs of `_fill_timing`. Returns the context and the times; the capture's safe inputs after."""
        context = self._fill_timing(key)
        times: list[list[float]] = [[] for _ in graphs]
        for _ in range(rounds):
            for graph, kept in zip(graphs, times, strict=True):
                graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(replays):
                    graph.replay()
                end.record()
                end.synchronize()
                kept.append(start.elapsed_time(end) / replays)
        self._fill_padding(key)
        return context, [sorted(kept)[len(kept) // 2] for kept in times]

    def _fill_timing(self, key: tuple[str, int, int]) -> int:
        """A decode bucket's inputs for timing: every row attends over up to `MID_TIMING_CONTEXT` tokens (at most
        the longest sequence served) of pages of its own (the pool holds no request yet, so any page will do; their
        contents do not matter), and the new tokens go to the sink. Returns that context."""
        from mstar_common.layers.linear import MID_TIMING_CONTEXT

        kind, rows, _ = key
        page = self.kv_cache.page_size
        per_row = max(1, min(self.buffers.max_pages, -(-MID_TIMING_CONTEXT // page), self.kv_cache.num_pages // rows))
        context = min(per_row * page, MID_TIMING_CONTEXT, self.max_model_len)  # a position the model can embed

        class _Timing:
            num_tokens = num_rows = rows
            input_ids, positions, slot_mapping = [0] * rows, [context - 1] * rows, [self.sink_slot] * rows
            query_lens, context_lens, request_slots = [1] * rows, [context] * rows, [0] * rows
            page_tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(rows)]
            sample_indices = sampling_seqs = penalty_slots = penalties = gather_dst = gather_src = []

        host = self.buffers.host_views(0)
        self._fill(host, _Timing, (kind, rows, GREEDY))
        self._plan(key, host)
        self._stage_host(rows)
        return context

    def resync(self) -> None:
        """Waits for the device, then the next replay reads host mirror 0, as the host will fill it. After replays
        that did not go through `try_replay` (the capture's warm-ups, a benchmark's bare replays)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # every replay before has read its parity (some may have run on another stream)
            self.buffers.parity.zero_()
            torch.cuda.synchronize()  # done before a replay on any stream (the step loop's thread may use another)
        self._parity = 0

    def _capture_one(self, key: tuple[str, int, int], pool):
        """One bucket's graph (on the CPU a `FakeGraph` that re-runs the step)."""
        self._fill_padding(key)
        self._plan(key, self.buffers.host_views(0))
        fn = self._step_fn(*key)
        if self.device.type != "cuda":
            return FakeGraph(fn)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up: JIT-compiles the Triton kernels and sizes the allocator outside capture
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph

    def _step_fn(self, kind: str, size: int, sampling: int):
        v = self.buffers.views
        model, kv_cache = self.model, self.kv_cache
        rows, tokens = self._shape(kind, size)
        work = prefill_work_capacity(tokens, rows)
        metadata = AttentionMetadata(
            query_start_loc=v["query_start_loc"][: rows + 1], context_lens=v["context_lens"][:rows],
            block_tables=v["block_tables"][:rows], slot_mapping=v["slot_mapping"][:tokens],
            max_query_len=1 if kind == DECODE else tokens, max_context_len=0,
            query_start_loc_host=[], context_lens_host=[], is_decode=kind == DECODE,
            work_rows=v["work_rows"][:work], work_firsts=v["work_firsts"][:work],
            request_slots=v["request_slots"][:rows] if self.has_request_slots else None,
        )
        out = self.buffers.out_tokens[:rows]
        logits_out = None if self.logits_out is None else self.logits_out[:rows]
        penalty, offset = self.penalty, self.logits_offset

        gather = (v["gather_dst"][:rows], v["gather_src"][:rows], v["gather_count"], self.buffers.out_tokens)

        in_model = getattr(model, "gathers_input_ids", False)  # in its embedding's launch (mstar_kernels/embedding.py)
        buffers = self.buffers
        input_words = buffers.input_bytes(rows) // 4

        zero_copy = self.zero_copy

        def step() -> None:
            if not zero_copy:  # the inputs were copied in before the replay, the tokens are copied out after it
                run()
                return
            from mstar_kernels.step_io import publish_tokens, pull_inputs

            pull_inputs(buffers.host_pair.view(torch.int32), buffers.raw_device.view(torch.int32), buffers.parity,
                        input_words, rows)
            run()
            publish_tokens(out, buffers.host_tokens, buffers.parity)

        def run() -> None:
            # decode rows' newest ids: the previous step's tokens
            if in_model:
                hidden = model(v["input_ids"][:tokens], v["positions"][:tokens], metadata, kv_cache, gather=gather)
            else:
                _gather_tokens(v["input_ids"], *gather)
                hidden = model(v["input_ids"][:tokens], v["positions"][:tokens], metadata, kv_cache)
            if kind == MIXED:
                hidden = hidden[v["sample_indices"][:rows]]
            logits = model.compute_logits(hidden)
            if logits_out is not None:  # the model's logits rules and the sampler run after the replay
                logits_out.copy_(logits.float())
                return
            if not sampling:  # greedy: the argmax reads the model-dtype logits (and applies the penalty) itself
                into = None if offset else out  # the CUDA argmax stores into the token buffer: no copy kernel after
                if penalty is not None:
                    sampled = penalty.greedy(logits, v["penalty_slots"][:rows], v["penalty"][:rows], into)
                else:
                    from mstar_common.engine.sampler import greedy_tokens

                    sampled = greedy_tokens(logits, into)
                if sampled is not out:
                    out.copy_(sampled + offset if offset else sampled)
                return
            if penalty is not None:
                logits = penalty.apply(logits, v["penalty_slots"][:rows], v["penalty"][:rows])  # fp32
            from mstar_kernels.sampling import sample_on_device

            sampled = sample_on_device(logits, v["is_greedy"][:rows], v["temperature"][:rows],
                                       v["top_k"][:rows], v["top_p"][:rows], v["min_p"][:rows], v["seeds"][:rows],
                                       filters=sampling != PLAIN)
            if penalty is not None:
                penalty.record(v["penalty_slots"][:rows], sampled)
            out.copy_(sampled + offset if offset else sampled)

        return step

    def _shape(self, kind: str, size: int) -> tuple[int, int]:
        """(rows, tokens) of a bucket."""
        return (size, size) if kind == DECODE else (min(self.max_rows, size), size)

    # ---- replay ----------------------------------------------------------------------------------------------

    def pick(self, batch) -> tuple[str, int, int] | None:
        """The smallest captured bucket that holds `batch`, or None (run it eager). A bucket that could not be
        captured (out of GPU memory at startup) is passed over for the next larger one; a step with no filtering
        row takes the temperature-alone variant, or the full sampler where that one was not captured."""
        variants = (GREEDY,)
        if self.samples_in_graph:
            if batch.needs_history:
                return None
            if not batch.is_greedy:
                if not self.config.capture_sampling:
                    return None
                variants = (SAMPLED,) if batch.filters(self.logits_width) else (PLAIN, SAMPLED)
        if batch.is_decode:
            sizes = self.decode_buckets[bisect_left(self.decode_buckets, batch.num_rows):]
            key = next((k for k in ((DECODE, size, v) for size in sizes for v in variants) if k in self.graphs), None)
            if key is not None:
                return key
        sizes = self.token_buckets[bisect_left(self.token_buckets, batch.num_tokens):]
        return next((k for k in ((MIXED, size, v) for size in sizes for v in variants)
                     if k in self.graphs and batch.num_rows <= self._shape(MIXED, k[1])[0]), None)

    def try_replay(self, batch, last_tokens: torch.Tensor | None, sample=None) -> torch.Tensor | None:
        """Replay the bucket that holds `batch` and return its tokens (device), or None if none does.
        `sample(logits, seqs)` samples after the replay when the model has its own logits rules."""
        self.last_host_tokens = self.last_key = None
        self.last_replay_s = 0.0
        key = self.pick(batch)
        if key is None or key not in self.graphs:
            return None
        self.last_key = key
        parity = self._parity  # flipped once the replay is launched, as the graph flips the device's (zero-copy)
        rows, _ = self._shape(key[0], key[1])
        self._fill(self.buffers.host_views(parity), batch, key)
        self._plan(key, self.buffers.host_views(parity))
        if not self.zero_copy:  # else the graph reads the host mirror itself
            self.buffers.copy_in(parity, rows)
        previous = self.buffers.out_tokens
        if batch.gather_dst and last_tokens.data_ptr() != previous.data_ptr():  # the last step ran eager
            previous[: last_tokens.numel()].copy_(last_tokens)
        replaying = time.perf_counter()
        self.graphs[key].replay()
        self.last_replay_s = time.perf_counter() - replaying
        self._parity ^= 1
        self.num_replays += 1
        num_sampling = len(batch.sampling_seqs)
        if self.logits_out is not None:
            return sample(self.logits_out[:num_sampling], batch.sampling_seqs)
        self.last_host_tokens = self.buffers.host_tokens[parity, :num_sampling] if self.zero_copy else None
        return self.buffers.out_tokens[:num_sampling]

    def _plan(self, key: tuple[str, int, int], host: dict[str, np.ndarray]) -> None:
        """The attention backend's per-replay planning (a no-op but for FlashInfer's)."""
        rows, tokens = self._shape(key[0], key[1])
        self.attn_backend.plan_graph_step(key, rows, tokens, host, self.buffers.max_pages, self.kv_cache.page_size,
                                          self.kv_cache.sink_page)

    def _fill(self, h: dict[str, np.ndarray], batch, key: tuple[str, int, int]) -> None:
        kind, size, sampling = key
        rows, tokens = self._shape(kind, size)
        num_tokens, num_rows, width = batch.num_tokens, batch.num_rows, self.buffers.max_pages
        h["input_ids"][:num_tokens] = batch.input_ids
        h["input_ids"][num_tokens:tokens] = 0
        h["positions"][:num_tokens] = batch.positions
        h["positions"][num_tokens:tokens] = 0
        h["slot_mapping"][:num_tokens] = batch.slot_mapping
        h["slot_mapping"][num_tokens:tokens] = self.sink_slot
        h["query_start_loc"][0] = 0
        np.cumsum(batch.query_lens, out=h["query_start_loc"][1: num_rows + 1])
        h["query_start_loc"][num_rows + 1: rows + 1] = num_tokens
        h["context_lens"][:num_rows] = batch.context_lens
        h["context_lens"][num_rows:rows] = 1
        if self.has_request_slots:  # padding rows read slot 0's cross state and are dropped
            h["request_slots"][:num_rows] = batch.request_slots
            h["request_slots"][num_rows:rows] = 0
        table = h["block_tables"]
        for row, pages in enumerate(batch.page_tables):
            table[row * width: row * width + len(pages)] = pages
        table[num_rows * width: rows * width: width] = self.kv_cache.sink_page
        num_sampling = len(batch.sampling_seqs)
        h["sample_indices"][:num_sampling] = batch.sample_indices
        h["sample_indices"][num_sampling:rows] = 0
        if self.penalty is not None:  # padding rows: the scratch slot, penalty off
            h["penalty_slots"][:num_sampling] = batch.penalty_slots
            h["penalty_slots"][num_sampling:rows] = self.penalty.scratch
            h["penalty"][:num_sampling] = batch.penalties
            h["penalty"][num_sampling:rows] = 1.0
        h["gather_count"][0] = len(batch.gather_dst)
        if batch.gather_dst:
            h["gather_dst"][: len(batch.gather_dst)] = batch.gather_dst
            h["gather_src"][: len(batch.gather_src)] = batch.gather_src
        if kind == MIXED:
            work_rows, work_firsts = build_prefill_work(batch.query_lens, prefill_work_capacity(tokens, rows),
                                                        skip_single=True)
            h["work_rows"][: len(work_rows)] = work_rows
            h["work_firsts"][: len(work_firsts)] = work_firsts
        if sampling:
            self._fill_sampling(h, batch, rows)

    def _fill_sampling(self, h: dict[str, np.ndarray], batch, rows: int) -> None:
        from mstar_common.engine.model_runner import sampling_columns

        cols = sampling_columns(batch.sampling_seqs, self.logits_width)
        n = len(cols.seeds)
        for name, values, pad in (("is_greedy", cols.is_greedy, 1), ("temperature", cols.temperature, 1.0),
                                  ("top_k", cols.top_k, self.logits_width), ("top_p", cols.top_p, 1.0),
                                  ("min_p", cols.min_p, 0.0), ("seeds", cols.seeds, 0)):
            h[name][:n] = values
            h[name][n:rows] = pad

    def _fill_padding(self, key: tuple[str, int, int]) -> None:
        """Safe inputs for capture: every token writes the sink, every row reads one sink token."""
        kind, size, sampling = key
        rows, tokens = self._shape(kind, size)

        class _Empty:
            input_ids = positions = slot_mapping = sample_indices = gather_dst = gather_src = request_slots = []
            query_lens = context_lens = page_tables = sampling_seqs = penalty_slots = penalties = []
            num_tokens = num_rows = 0

        host = self.buffers.host_views(0)
        self._fill(host, _Empty, (kind, size, GREEDY))
        if sampling:
            self._fill_sampling(host, _Empty, rows)
        self._stage_host(rows)

    def _stage_host(self, rows: int) -> None:
        """Host mirror 0 (filled for a capture, a warm-up or a timing) into the other mirror, since a replay that
        reads its inputs itself may take either, and onto the device; waits for it."""
        self.buffers.mirror(0)
        self.buffers.copy_in(0, rows)
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def zero_copy_step_io() -> bool:
    """`MSTAR_ZERO_COPY_STEP_IO` (default 1; 0: a host-to-device copy before each replay and a device-to-host copy of
    its tokens after it): a captured step reads its inputs from the page-locked host mirror and writes its tokens to
    page-locked memory inside the graph (mstar_kernels/step_io.py)."""
    from mstar_common.config import env_switch

    return env_switch("MSTAR_ZERO_COPY_STEP_IO", True)


def _gather_tokens(input_ids: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, count: torch.Tensor,
                   previous: torch.Tensor) -> None:
    """`input_ids[dst[i]] = previous[src[i]]` for `i < count[0]`: one launch inside the graph on CUDA
    (mstar_kernels/gather_tokens.py); torch ops on the CPU stand-in, which replays eagerly."""
    if input_ids.is_cuda:
        from mstar_kernels.gather_tokens import gather_tokens

        gather_tokens(input_ids, dst, src, count, previous)
        return
    from mstar_common.layers.embedding import gather_ids

    gather_ids(input_ids, dst, src, count, previous)


def configure_fast_path(model, component, device: str, max_rows: int, max_tokens: int) -> GraphConfig | None:
    """Apply a component's GPU knobs (`config.ComponentConfig`) to a loaded model: its attention backend and
    fused ops; returns the graph buckets to capture, or None (no graphs: CPU, or `cuda_graphs: false`)."""
    from mstar_common.engine.attention import _has_triton, select_attention_backend
    from mstar_common.layers.linear import use_gemv_from_env

    model.attn_backend = select_attention_backend(device, component.attention_backend)
    is_cuda = torch.device(device).type == "cuda"
    fused = bool(component.fused_ops and is_cuda and _has_triton())
    model.enable_fused_ops(fused)
    if fused:
        use_gemv_from_env(model)
    if not (component.cuda_graphs and is_cuda):
        return None
    return GraphConfig(
        decode_buckets=component.decode_buckets or default_decode_buckets(max_rows),
        token_buckets=component.prefill_token_buckets or default_token_buckets(max_tokens),
        capture_sampling=component.capture_sampling,
    )
