"""The autoregressive engine: request intake, the step loop thread, and output delivery.

Threads. `add_request` and `cancel` run on the caller's threads: they validate, then hand the request or
the cancellation to the loop through an inbox guarded by `_cond`. Everything else (scheduler, pages, model,
callbacks) runs on the loop thread inside `step()`, serialised by `_step_lock`, so tests can drive `step()`
directly without starting the thread.

Outputs. After each step, `on_output(request_id, [token], finish_reason, error)` is called once per row that
produced a token. Every request gets exactly one call with `finish_reason` set (STOP, LENGTH, CANCELLED or
ERROR), and its pages are freed before that call is made.
"""

from __future__ import annotations

import logging
import operator
import threading
import uuid
from collections.abc import Sequence as SequenceOf

import torch

from mstar_common.engine.kv_cache import KVCache, PageAllocator
from mstar_common.engine.model_runner import CausalLM, ModelRunner
from mstar_common.engine.sampler import Sampler, make_generator
from mstar_common.engine.scheduler import Scheduler, StepPlan
from mstar_common.engine.sequence import OutputCallback, Sequence
from mstar_common.engine.types import AdmissionError, EngineConfig, FinishReason, SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class AREngine:
    def __init__(self, model: CausalLM, config: EngineConfig, eos_token_ids: SequenceOf[int], vocab_size: int) -> None:
        _check_config(config)
        self.config, self.vocab_size = config, vocab_size
        self.device = torch.device(config.device)
        self.max_model_len = _resolve_max_model_len(model, config)
        self.eos_token_ids = frozenset(_check_eos(eos_token_ids, vocab_size))
        dtype = _DTYPES[config.dtype]
        _check_model_placement(model, dtype, self.device)
        self.allocator = PageAllocator(config.num_kv_pages, config.page_size)
        self.kv_cache = KVCache(model.kv_spec, config.num_kv_pages, config.page_size, dtype, self.device)
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_batch_tokens)
        self.runner = ModelRunner(model, self.kv_cache, Sampler(), self.device)
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
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, on_output: OutputCallback
    ) -> None:
        """Validate and queue a request; raises ValueError/AdmissionError naming the field and the rule."""
        prompt_ids = self._validate(prompt_ids, params)
        generator = make_generator(params.seed, self.device)
        seq = Sequence(request_id, prompt_ids, len(prompt_ids), params, on_output, generator)
        with self._cond:
            if self._is_closed:
                raise RuntimeError("the engine is shut down and accepts no requests")
            if request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already in use by a live request")
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
            self._thread = threading.Thread(target=self._loop, name="ar-engine-step", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loop; every request not yet finished gets CANCELLED. Safe to call more than once, and
        from an `on_output` callback (the loop then cancels what is left as it exits)."""
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

    def stats(self) -> dict:
        with self._cond:
            num_inbox = len(self._inbox)
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting + num_inbox,
            "num_used_pages": self.allocator.num_used_pages,
            "num_reserved_pages": self.allocator.num_reserved_pages,
            "num_free_pages": self.allocator.num_free_pages,
            "num_steps": self.num_steps,
        }

    # ---- the step -------------------------------------------------------------------------------------------

    def step(self) -> bool:
        """Intake, schedule, run, deliver. Returns whether anything was done."""
        with self._step_lock:
            did_intake = self._intake()
            plan = self.scheduler.schedule()
            if plan.is_empty:
                return did_intake
            self.num_steps += 1
            tokens = self._run(plan)
            if tokens is not None:
                self._postprocess(plan, tokens)
            return True

    def _intake(self) -> bool:
        with self._cond:
            new, cancels = self._inbox, self._cancels
            self._inbox, self._cancels = [], []
            cancelled = [self._live[rid] for rid in dict.fromkeys(cancels) if rid in self._live]
        for seq in new:
            self.scheduler.add(seq)
        for seq in cancelled:
            self._finish(seq, FinishReason.CANCELLED)
        return bool(new or cancels)

    def _run(self, plan: StepPlan) -> list[int] | None:
        try:
            return self.runner.run(plan)
        except Exception:
            # The batch's KV and outputs are unknown now: fail exactly the rows of this step, keep the rest.
            error_id = uuid.uuid4().hex[:12]
            logger.exception("step %d failed (error id %s); failing its %d requests",
                             self.num_steps, error_id, len(plan.chunks))
            for chunk in plan.chunks:
                self._finish(chunk.seq, FinishReason.ERROR, error=f"engine step failed (error id {error_id})")
            return None

    def _postprocess(self, plan: StepPlan, tokens: list[int]) -> None:
        sampling = [chunk.seq for chunk in plan.chunks if chunk.is_sampling]
        for chunk in plan.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
        for seq, token in zip(sampling, tokens, strict=True):
            seq.token_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason is None:
                self._deliver(seq, [token], None, None)
            else:
                self._finish(seq, reason, [token])

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason, tokens: list[int] | None = None,
                error: str | None = None) -> None:
        """Free the sequence's pages, forget it, then make its one final call."""
        if seq.is_finished:
            return
        self.scheduler.finish(seq)
        with self._cond:
            self._live.pop(seq.request_id, None)
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
            if not did_work:
                self._wait_for_work()
        self._cancel_everything()
        logger.info("step loop stopped after %d steps", self.num_steps)

    def _wait_for_work(self) -> None:
        with self._cond:
            while not (self._is_stopping or self._inbox or self._cancels):
                self._cond.wait()

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
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        prompt = _token_ids(prompt_ids, self.vocab_size)
        num_tokens = len(prompt) + params.max_tokens
        if num_tokens > self.max_model_len:
            raise AdmissionError(
                f"max_tokens ({params.max_tokens}) plus the prompt's {len(prompt)} tokens must be <= "
                f"max_model_len ({self.max_model_len}); lower max_tokens to at most {self.max_model_len - len(prompt)}"
            )
        footprint = self.allocator.pages_for(num_tokens)
        if footprint > self.config.num_kv_pages:
            raise AdmissionError(
                f"max_tokens ({params.max_tokens}) plus the prompt's {len(prompt)} tokens needs {footprint} KV "
                f"pages of {self.config.page_size} tokens, more than the pool's num_kv_pages "
                f"({self.config.num_kv_pages})"
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


def _check_config(config: EngineConfig) -> None:
    for name in ("num_kv_pages", "page_size", "max_num_seqs", "max_batch_tokens"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"EngineConfig.{name} must be an integer >= 1, got {value!r}")
    if config.max_batch_tokens < config.max_num_seqs:
        # Every running decode must fit in one step, or a decode could wait behind its batch-mates forever.
        raise ValueError(f"EngineConfig.max_batch_tokens ({config.max_batch_tokens}) must be >= max_num_seqs "
                         f"({config.max_num_seqs})")
    if config.dtype not in _DTYPES:
        raise ValueError(f"EngineConfig.dtype must be one of {sorted(_DTYPES)}, got {config.dtype!r}")


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
