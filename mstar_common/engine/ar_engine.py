"""The autoregressive engine: request intake, the step loop thread, and output delivery.

Threads. `add_request` and `cancel` run on the caller's threads: they validate, then hand the request or
the cancellation to the loop through an inbox guarded by `_cond`. Everything else (scheduler, pages, model,
callbacks) runs on the loop thread inside `step()`, serialised by `_step_lock`, so tests can drive `step()`
directly without starting the thread.

Outputs. After each step, `on_output(request_id, [token], finish_reason, error)` is called once per row that
produced a token. Every request gets exactly one call with `finish_reason` set (STOP, LENGTH, CANCELLED or
ERROR), and its pages are freed before that call is made.

Overlap (on CUDA). Each `step()` launches the next step before it collects the previous one, so the host
schedules and packs step N+1 while the GPU runs step N; the only host sync is reading step N's tokens. Rows
awaiting a token carry a placeholder (see `model_runner.py`); a row that stops on EOS costs one wasted row in
the step already launched, and a row's LENGTH stop is known in advance, so it is never over-scheduled. The
repetition penalty's history lives on the device (`penalty.py`), so penalised rows overlap too; only a model
whose own logits rules read host history (`logits_need_history`) makes a step wait for the previous one. On
the CPU the step is synchronous: launch, collect, deliver.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import random
import threading
import time
import uuid
from collections.abc import Sequence as SequenceOf
from typing import Any

import torch

from mstar_common.config import DeploymentError
from mstar_common.devices import on_device
from mstar_common.engine import kv_sizing, loop_times
from mstar_common.engine.admission import Admission, EngineUnavailable
from mstar_common.engine.cuda_graph import CudaGraphRunner, GraphConfig
from mstar_common.engine.kv_cache import KVCache, PageAllocator, pages_for
from mstar_common.engine.model_runner import PLACEHOLDER, CausalLM, ModelRunner, PendingStep, logits_window
from mstar_common.engine.penalty import PenaltyState
from mstar_common.engine.sampler import Sampler, make_generator
from mstar_common.engine.scheduler import Scheduler, StepPlan
from mstar_common.engine.sequence import OutputCallback, Sequence, SequenceStatus
from mstar_common.engine.types import AdmissionError, EngineConfig, FinishReason, SamplingParams
from mstar_common.switches import check_switches

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}  # beside "auto"
EXPIRY_WAIT_S = 0.05  # an idle loop with live (waiting) requests wakes this often to check their limits


class AREngine:
    def __init__(self, model: CausalLM, config: EngineConfig, eos_token_ids: SequenceOf[int], vocab_size: int,
                 graphs: GraphConfig | None = None, overlap: bool | None = None,
                 device_penalty: bool | None = None) -> None:
        """`graphs`: capture CUDA graphs for these buckets at startup (CUDA, or the CPU stand-in in tests).
        `overlap`: launch step N+1 before collecting step N (default: on CUDA only).
        `device_penalty`: keep the repetition-penalty history as device masks (default: on CUDA only)."""
        _check_config(config)
        check_switches(model)  # a misspelt switch refuses the model here, not at a request or a capture
        _check_kv_dtype(config)
        self.config, self.vocab_size = config, vocab_size
        self.device = torch.device(config.device)
        self.max_model_len = _resolve_max_model_len(model, config)
        self.eos_token_ids = frozenset(_check_eos(eos_token_ids, vocab_size))
        dtype = _DTYPES[config.dtype]
        _check_model_placement(model, dtype, self.device)
        hooks = model if hasattr(model, "admit_request") else None  # scheduler.RequestHooks
        caches_prefixes = _prefix_caching(model, config, hooks)
        kv_dtype = dtype if config.kv_dtype == "auto" else _KV_DTYPES[config.kv_dtype]
        reserve = 0 if self.device.type != "cuda" else kv_sizing.step_reserve_bytes(
            model, config.max_batch_tokens, config.max_num_seqs, vocab_size, dtype)
        num_pages = kv_sizing.pool_pages(
            config.num_kv_pages, spec=model.kv_spec, page_size=config.page_size, kv_dtype=kv_dtype, reserve=reserve,
            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len, caches_prefixes=caches_prefixes,
            share=config.gpu_memory_share, device=self.device)
        self.config = config = dataclasses.replace(config, num_kv_pages=num_pages)  # from here on a count
        self.allocator = PageAllocator(config.num_kv_pages, config.page_size, prefix_caching=caches_prefixes)
        self.kv_cache = KVCache(model.kv_spec, config.num_kv_pages, config.page_size, kv_dtype, self.device)
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_batch_tokens, hooks)
        self._needs_history = getattr(model, "logits_need_history", None)
        # a model's per-token scores (model_runner's docstring): handed over as each step is collected
        self._note_sampled = getattr(model, "note_sampled", None)
        self._note_probe = getattr(model, "note_probe", None)
        offset, width = logits_window(model, vocab_size)
        if device_penalty is None:
            device_penalty = self.device.type == "cuda"
        penalty = PenaltyState(config.max_num_seqs, width, offset, self.device) if device_penalty else None
        graph_runner = None
        if graphs is not None:
            graph_runner = CudaGraphRunner(model, self.kv_cache, graphs, config.max_num_seqs, self.max_model_len,
                                           vocab_size, self.device, penalty)
            graph_runner.capture()
        if self.device.type == "cuda":
            kv_sizing.log_memory(self.device, "after the pool and the graphs")
        self.times = loop_times.LoopTimes() if loop_times.enabled() else None  # MSTAR_STEP_TIMES=1
        self.runner = ModelRunner(model, self.kv_cache, Sampler(), self.device, vocab_size, graph_runner, penalty,
                                  timing_events=self.times is not None)
        self.is_overlapped = self.device.type == "cuda" if overlap is None else overlap
        self._pending: PendingStep | None = None  # the launched step not yet collected (overlap only)
        self._seeds = random.Random()
        self.admission = Admission(config.max_num_seqs, config.max_queue, config.queue_timeout_s,
                                   config.request_timeout_s)
        self.num_steps = 0
        self._cond = threading.Condition()  # guards _inbox, _cancels, _live, _is_stopping, _is_closed
        self._inbox: list[Sequence] = []
        self._cancels: list[str] = []
        self._live: dict[str, Sequence] = {}  # from add_request until the final on_output call
        self._is_stopping = self._is_closed = False
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ---- caller threads -------------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, on_output: OutputCallback,
        timeout_s: float | None = None, request_state: Any = None,
    ) -> None:
        """Validate and queue a request; raises ValueError/AdmissionError naming the field and the rule, and
        AdmissionRefused (EngineOverloaded, EngineUnavailable) when the component cannot take it now.
        `timeout_s` is the client's deadline (capped by the config's request_timeout_s). `request_state` is the
        model's own per-request state (its `admit_request` hook and `process_logits` read it)."""
        prompt_ids = self._validate(prompt_ids, params)
        generator = make_generator(params.seed, self.device)
        seq = Sequence(request_id, prompt_ids, len(prompt_ids), params, on_output, generator)
        seq.seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        seq.request_state = request_state
        with self._cond:
            if self._is_closed:
                raise EngineUnavailable("the component is shut down and accepts no requests")
            if request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already in use by a live request")
            self.admission.check_capacity(len(self._live))
            self.admission.track(request_id, time.monotonic(), timeout_s)
            self._live[request_id] = seq
            self._inbox.append(seq)
            self._cond.notify()

    def cancel(self, request_id: str) -> None:
        """Cancel a live request within one step (one CANCELLED call); unknown or finished ids are ignored."""
        with self._cond:
            self._cancels.append(request_id)
            self._cond.notify()

    def start(self) -> None:
        with self._cond:
            if self._thread is not None or self._is_closed:
                raise RuntimeError("the engine's step loop was already started or shut down")
            self._thread = threading.Thread(target=on_device(self._loop, self.device), name="ar-engine-step",
                                            daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loop; every request not yet finished gets CANCELLED. Safe to call more than once, and
        from an `on_output` callback of a started engine's loop (which then cancels what is left as it exits); not
        from a callback of a `step()` driven by hand without `start()`, which holds the step lock this takes."""
        with self._cond:
            self._is_stopping = self._is_closed = True
            self._cond.notify_all()
        if self._thread is threading.current_thread():
            return
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("step loop did not stop within %.1f s; leaving its requests to it", timeout)
                return
        self._cancel_everything()

    @property
    def num_live(self) -> int:
        """Requests admitted and not yet finished (queued, waiting or running)."""
        return len(self._live)

    def stats(self) -> dict:
        with self._cond:
            num_inbox = len(self._inbox)
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting + num_inbox,
            "num_used_pages": self.allocator.num_used_pages,
            "num_reserved_pages": self.allocator.num_reserved_pages,
            "num_free_pages": self.allocator.num_free_pages,
            "num_cached_pages": self.allocator.num_cached_pages,
            "num_used_state_slots": hooks.num_used_request_slots if (hooks := self.scheduler.request_hooks) else 0,
            "prefix_cache_queried_tokens": self.allocator.num_prefix_queried_tokens,
            "prefix_cache_hit_tokens": self.allocator.num_prefix_hit_tokens,
            "prefix_cache_evicted_pages": self.allocator.num_evicted_pages,
            "num_steps": self.num_steps,
            "num_graph_steps": self.runner.counts.graph_steps,
            "num_rows_stepped": self.runner.counts.rows,
            "num_tokens_stepped": self.runner.counts.tokens,
            "num_graph_padding_tokens": self.runner.counts.padding,
            "num_refused": self.admission.num_refused,
            "num_expired": self.admission.num_expired,
        }

    # ---- the step -------------------------------------------------------------------------------------------

    def step(self) -> bool:
        """Intake, schedule, run, deliver. Returns whether anything was done."""
        if self.is_overlapped:
            return self._step_overlapped()
        with self._step_lock:
            did_intake = self._intake()
            did_intake |= self._expire()
            plan = self._schedule()
            if plan.is_empty:
                return did_intake
            self.num_steps += 1
            tokens = self._run(plan)
            if tokens is not None:
                self._postprocess(plan, tokens)
            return True

    def _step_overlapped(self) -> bool:
        """Launch step N+1, then collect and deliver step N."""
        times = self.times
        with self._step_lock:
            started = time.perf_counter()
            did_intake = self._intake()
            did_intake |= self._expire()
            previous, self._pending = self._pending, None
            if previous is not None and self._needs_host_tokens():
                self._collect(previous)
                previous = None
            plan = self._schedule()
            if not plan.is_empty:
                self.num_steps += 1
                launched = time.perf_counter()
                self._pending = self._launch(plan)
                if times is not None:
                    times.launched(started, launched, time.perf_counter(), self.runner.last_prepare_s,
                                   self.runner.last_replay_s)
            if previous is not None:
                self._collect(previous)
            return did_intake or not plan.is_empty or previous is not None

    def _schedule(self) -> StepPlan:
        plan = self.scheduler.schedule()
        refused, self.scheduler.refused = self.scheduler.refused, []
        for seq, error in refused:
            self._finish(seq, FinishReason.ERROR, error=error)
        return plan

    def _needs_host_tokens(self) -> bool:
        """Whether the next step's sampling reads token values still on the device (so it cannot overlap)."""
        needs_history = self._needs_history
        penalty_on_host = self.runner.penalty is None
        return any((penalty_on_host and seq.params.repetition_penalty != 1.0)
                   or (needs_history is not None and needs_history(seq)) for seq in self.scheduler.running)

    def _launch(self, plan: StepPlan) -> PendingStep | None:
        try:
            pending = self.runner.launch(plan)
        except Exception:
            self._fail_step(plan)
            return None
        for chunk in plan.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            pending.written.append((chunk.seq, chunk.seq.num_computed_tokens))
        for row, seq in enumerate(pending.seqs):
            pending.indices.append(len(seq.token_ids))
            seq.token_ids.append(PLACEHOLDER)
            seq.pending_row = row
        return pending

    def _collect(self, pending: PendingStep) -> None:
        times = self.times
        try:
            waited = time.perf_counter()
            tokens = pending.tokens()
            delivered = time.perf_counter()
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            logger.exception("collecting step tokens failed (error id %s)", error_id)
            # as `_fail_step`: the KV of every row the step ran is unknown, its prefill-only chunks' too
            for seq, _ in pending.written:
                self._finish(seq, FinishReason.ERROR, error=f"engine step failed (error id {error_id})")
            return
        if times is not None:
            times.tokens_ready(pending.event, delivered - waited, pending.kind, pending.num_tokens)
        self._commit(pending.written)  # the step has run: its KV is written
        logprobs = self._note_scores(pending)
        for row, (seq, index, token) in enumerate(zip(pending.seqs, pending.indices, tokens, strict=True)):
            if seq.is_finished:
                continue  # stopped (or cancelled) while this step was in flight: its row was wasted
            seq.token_ids[index] = token
            if logprobs is not None:
                self._note_sampled(seq, index, token, logprobs[row])
            reason = self._finish_reason(seq, token, index + 1 - seq.num_prompt_tokens)
            if reason is None:
                self._deliver(seq, [token], None, None)
            else:
                del seq.token_ids[index + 1:]
                self._finish(seq, reason, [token])
        if times is not None:
            times.deliver_s += time.perf_counter() - delivered

    def _intake(self) -> bool:
        with self._cond:
            new, cancels = self._inbox, self._cancels
            self._inbox, self._cancels = [], []
            cancelled = [self._live[rid] for rid in dict.fromkeys(cancels) if rid in self._live]
        for seq in new:
            if not seq.is_finished:  # ended while in the inbox (expired between a step's intake and its expiry)
                self.scheduler.add(seq)
        for seq in cancelled:
            self._finish(seq, FinishReason.CANCELLED)
        return bool(new or cancels)

    def _expire(self) -> bool:
        """End requests past their queue wait or deadline (an error naming the limit); frees their pages."""
        with self._cond:
            expired = self.admission.expired(time.monotonic(), self._is_waiting)
            seqs = [(self._live[rid], error) for rid, error in expired if rid in self._live]
        for seq, error in seqs:
            self._finish(seq, FinishReason.ERROR, error=error)
        return bool(seqs)

    def _is_waiting(self, request_id: str) -> bool:
        seq = self._live.get(request_id)
        return seq is not None and seq.status is SequenceStatus.WAITING

    def _run(self, plan: StepPlan) -> list[int] | None:
        self.runner.last_step = None  # set by `run`: its per-token scores, read in `_postprocess`
        try:
            return self.runner.run(plan)
        except Exception:
            self._fail_step(plan)
            return None

    def _note_scores(self, pending: PendingStep) -> list[float] | None:
        """Hand a collected step's probes to the model (before any of its rows is delivered or finished), and
        return its rows' log-probabilities when the model takes them (`note_sampled`), else None."""
        if pending.num_logprobs == 0 and not pending.probe_seqs:
            return None
        logprobs, probes = pending.scores()
        if self._note_probe is not None:
            for seq, value in zip(pending.probe_seqs, probes, strict=True):
                if not seq.is_finished:
                    self._note_probe(seq, value)
        return logprobs if self._note_sampled is not None else None

    def _fail_step(self, plan: StepPlan) -> None:
        # The batch's KV and outputs are unknown now: fail exactly the rows of this step, keep the rest.
        error_id = uuid.uuid4().hex[:12]
        logger.exception("step %d failed (error id %s); failing its %d requests",
                         self.num_steps, error_id, len(plan.chunks))
        for chunk in plan.chunks:
            self._finish(chunk.seq, FinishReason.ERROR, error=f"engine step failed (error id {error_id})")

    def _postprocess(self, plan: StepPlan, tokens: list[int]) -> None:
        sampling = [chunk.seq for chunk in plan.chunks if chunk.is_sampling]
        for chunk in plan.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
        self._commit([(chunk.seq, chunk.seq.num_computed_tokens) for chunk in plan.chunks])
        pending = self.runner.last_step
        logprobs = None if pending is None else self._note_scores(pending)
        for row, (seq, token) in enumerate(zip(sampling, tokens, strict=True)):
            if logprobs is not None:
                self._note_sampled(seq, len(seq.token_ids), token, logprobs[row])
            seq.token_ids.append(token)
            reason = self._finish_reason(seq, token, seq.num_output_tokens)
            if reason is None:
                self._deliver(seq, [token], None, None)
            else:
                self._finish(seq, reason, [token])

    def _commit(self, written: list[tuple[Sequence, int]]) -> None:
        """Key the pages whose KV a completed step wrote in the prefix index (before any of them ends)."""
        if not self.allocator.prefix_caching:
            return
        for seq, num_tokens in written:
            if not seq.is_finished:
                self.allocator.commit(seq.page_table, seq.token_ids, num_tokens)

    def _finish_reason(self, seq: Sequence, token: int, num_output_tokens: int) -> FinishReason | None:
        """Why `seq` ends at `token`, its `num_output_tokens`-th output, or None."""
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason, tokens: list[int] | None = None,
                error: str | None = None) -> None:
        """Free the sequence's pages, forget it, then make its one final call."""
        if seq.is_finished:
            return
        self.scheduler.finish(seq)
        self.runner.release(seq)
        with self._cond:
            self._live.pop(seq.request_id, None)
            self.admission.forget(seq.request_id)
        self._deliver(seq, tokens or [], reason, error)

    def _deliver(self, seq: Sequence, tokens: list[int], reason: FinishReason | None, error: str | None) -> None:
        try:
            seq.on_output(seq.request_id, tokens, reason, error)
        except Exception:
            logger.exception("on_output for request %r raised", seq.request_id)
            if reason is None:  # the request can no longer be streamed: end it here
                self._finish(seq, FinishReason.ERROR, error="delivering the output failed")

    # ---- the loop thread ------------------------------------------------------------------------------------

    def _loop(self) -> None:
        logger.info("step loop started")
        while not self._is_stopping:
            try:
                did_work = self.step()
            except Exception:
                logger.exception("engine step raised outside the model run; failing every request")
                self._fail_everything()
                did_work = True
            if self.times is not None:
                self.times = self.times.maybe_log("ar-engine", idle=not did_work)
            if not did_work:
                self._wait_for_work()
        self._cancel_everything()
        logger.info("step loop stopped after %d steps", self.num_steps)

    def _wait_for_work(self) -> None:
        with self._cond:
            while not (self._is_stopping or self._inbox or self._cancels or self._pending is not None):
                # Queued requests that cannot be admitted still need their queue limits checked.
                self._cond.wait(EXPIRY_WAIT_S if self._live else None)
                if self._live:
                    return

    def _cancel_everything(self) -> None:
        with self._step_lock:
            self._intake()
            for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
                self._finish(seq, FinishReason.CANCELLED)

    def _fail_everything(self) -> None:
        error_id = uuid.uuid4().hex[:12]
        logger.error("failing all requests (error id %s)", error_id)
        with self._step_lock:
            self._intake()
            for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
                self._finish(seq, FinishReason.ERROR, error=f"engine step failed (error id {error_id})")

    # ---- validation -----------------------------------------------------------------------------------------

    def _validate(self, prompt_ids: SequenceOf[int], params: SamplingParams) -> list[int]:
        return check_request(prompt_ids, params, self.vocab_size, self.max_model_len, self.config.page_size,
                             self.config.num_kv_pages)


def check_request(prompt_ids: SequenceOf[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                  page_size: int, num_kv_pages: int) -> list[int]:
    """The prompt as a list of token ids, once the request passes the engine's rules (a ValueError or an
    AdmissionError naming the field and the rule otherwise). Also what a component whose engine runs in a
    process of its own checks before it hands the request over (engine_process.py)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    params.validate(vocab_size)
    prompt = _token_ids(prompt_ids, vocab_size)
    num_tokens = len(prompt) + params.max_tokens
    if num_tokens > max_model_len:
        raise AdmissionError(
            f"max_tokens ({params.max_tokens}) plus the prompt's {len(prompt)} tokens must be <= "
            f"max_model_len ({max_model_len}); lower max_tokens to at most {max_model_len - len(prompt)}"
        )
    footprint = pages_for(num_tokens, page_size)
    if footprint > num_kv_pages:
        raise AdmissionError(
            f"max_tokens ({params.max_tokens}) plus the prompt's {len(prompt)} tokens needs {footprint} KV "
            f"pages of {page_size} tokens, more than the pool's num_kv_pages ({num_kv_pages})"
        )
    return prompt


def _token_ids(prompt_ids: SequenceOf[int], vocab_size: int) -> list[int]:
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids must not be empty")
    try:
        ids = [operator.index(t) for t in prompt_ids]
    except TypeError:
        raise ValueError("prompt_ids must be integers") from None
    if not all(0 <= t < vocab_size for t in ids):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ValueError(f"prompt_ids must be token ids in [0, {vocab_size - 1}], got {bad}")
    return ids


def _check_kv_dtype(config: EngineConfig) -> None:
    """An fp8 pool on a GPU whose kernels cannot read e4m3 (compute capability < 8.9) is refused at load, naming
    the key, not at the first compile of an attention kernel."""
    device = torch.device(config.device)
    if config.kv_dtype == "fp8_e4m3" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise DeploymentError(
                f"resources.kv_cache.dtype: fp8_e4m3 needs a GPU of compute capability >= 8.9 (its attention "
                f"kernels read e4m3); {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: "
                f"use auto")


def _check_config(config: EngineConfig) -> None:
    for name in ("num_kv_pages", "page_size", "max_num_seqs", "max_batch_tokens"):
        value = getattr(config, name)
        if name == "num_kv_pages" and value == kv_sizing.AUTO:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"EngineConfig.{name} must be an integer >= 1, got {value!r}")
    if config.max_batch_tokens < config.max_num_seqs:
        # Every running decode must fit in one step, or a decode could wait behind its batch-mates forever.
        raise ValueError(f"EngineConfig.max_batch_tokens ({config.max_batch_tokens}) must be >= max_num_seqs "
                         f"({config.max_num_seqs})")
    if config.dtype not in _DTYPES:
        raise ValueError(f"EngineConfig.dtype must be one of {sorted(_DTYPES)}, got {config.dtype!r}")
    if config.kv_dtype != "auto" and config.kv_dtype not in _KV_DTYPES:
        raise ValueError(f"EngineConfig.kv_dtype must be 'auto' or one of {sorted(_KV_DTYPES)}, "
                         f"got {config.kv_dtype!r}")
    if config.max_queue is not None and (isinstance(config.max_queue, bool) or not isinstance(config.max_queue, int)
                                         or config.max_queue < 0):
        raise ValueError(f"EngineConfig.max_queue must be None or an integer >= 0, got {config.max_queue!r}")
    for name in ("queue_timeout_s", "request_timeout_s"):
        value = getattr(config, name)
        if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
            raise ValueError(f"EngineConfig.{name} must be None or a finite number > 0, got {value!r}")


def _prefix_caching(model: CausalLM, config: EngineConfig, hooks: Any) -> bool:
    """Whether the prefix cache may key this model's pages: its KV must be a function of the token ids alone
    (`supports_prefix_caching`), and a model with per-request state beside the pages (request hooks, e.g.
    Whisper's cross-attention to its audio) never is; nor is one that probes prompt positions (`probe_token_id`:
    a position inside a reused prefix never runs, so its probe would never reach the model). Asked for (`True`) on
    such a model: a ValueError."""
    if config.prefix_caching is False:
        return False
    if getattr(model, "probe_token_id", None) is not None:
        if config.prefix_caching:
            raise ValueError("prefix_caching: true, but this model probes prompt positions (probe_token_id), and a "
                             "position inside a reused prefix would never be probed")
        logger.info("prefix caching off: this model probes prompt positions")
        return False
    if not getattr(model, "supports_prefix_caching", False) or hooks is not None:
        if config.prefix_caching:
            raise ValueError("prefix_caching: true, but this model's KV depends on more than its token ids "
                             "(per-request inputs beside them), so no prompt prefix of it can be reused")
        logger.info("prefix caching off: this model's KV depends on more than the token ids")
        return False
    return True


def _resolve_max_model_len(model: CausalLM, config: EngineConfig) -> int:
    limit = model.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if not 1 <= config.max_model_len <= limit:
        raise ValueError(f"EngineConfig.max_model_len ({config.max_model_len}) must be in [1, {limit}] "
                         f"(the checkpoint's max_position_embeddings)")
    return config.max_model_len


def _check_eos(eos_token_ids: SequenceOf[int], vocab_size: int) -> list[int]:
    ids = [operator.index(t) for t in eos_token_ids]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"eos_token_ids {bad} are outside the vocabulary [0, {vocab_size - 1}]")
    return ids


def _check_model_placement(model: CausalLM, dtype: torch.dtype, device: torch.device) -> None:
    param = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
    if param is None:
        return
    if param.dtype != dtype:
        raise ValueError(f"EngineConfig.dtype is {dtype} but the model's weights are {param.dtype}")
    if param.device.type != device.type:
        raise ValueError(f"EngineConfig.device is {device} but the model's weights are on {param.device}")
