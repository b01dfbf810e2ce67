"""The Whisper walk: one upload's path through the encoder and decoder components, window by window.

    parse (a ValueError names the field and the rule) ─ decode + resample (in a thread) ─ check the caps
    cut into windows (≤ 30 s, at quiet moments)
    for every window at once (at most `max_parallel_windows` in flight per upload):
        encoder ─▶ encoder_output ─▶ decoder stream (token ids)
    stream text deltas in window order; the last response carries language, duration and segments

Language: without one, window 0's decoder detects it (its first token, greedy; a one-token decode of its own where
the window's first decode samples or has a prompt) and the other windows, and window 0's retries, start forced to
it. Joining: each window's text is stripped of leading blanks and windows are joined with one space, so the
streamed deltas add up exactly to the final text. Temperature fallback (OpenAI Whisper's `transcribe` rules:
re-decode a window at 0.2, 0.4, … 1.0 while its compression ratio exceeds 2.4 or its avg_logprob is below -1,
unless it looks like silence: no_speech_prob above 0.6 with that low avg_logprob; a window that still looks like
silence at the end is dropped) runs only for timestamped requests that set no temperature. A timestamped request
with a temperature decodes each window once, and a window that looks like silence is dropped all the same;
timestamped requests stream a window's text once it is kept. Untimed requests decode once and keep every window
(the spec disables the retry for untimed decoding), and so stream each window's text as it is decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mstar_common import wire
from mstar_common.engine.detokenizer import IncrementalDetokenizer
from mstar_common.families.text import max_token_bytes
from mstar_common.families.whisper import graph as g
from mstar_common.families.whisper.audio import (
    TARGET_RATE,
    AudioLimits,
    Window,
    decode_upload,
    split_windows,
    to_model_pcm,
)
from mstar_common.families.whisper.decoding import (
    LANGUAGE,
    DecoderPrompt,
    WhisperTokens,
    build_prompt,
    compression_ratio,
    split_segments,
)
from mstar_common.families.whisper.requests import TranscriptionRequest, parse_request
from mstar_common.walk_api import Call, LastResponse, QueueWaitExpired

CallStream = Callable[[str, dict[str, Any]], AsyncIterator[dict[str, Any]]]
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@dataclass(frozen=True, slots=True)
class FallbackRules:
    """The temperature fallback's thresholds (OpenAI Whisper's `transcribe` defaults; `model_kwargs` of the same
    names); None turns a rule off, as in OpenAI Whisper and transformers."""

    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6

    def needs_fallback(self, text: str, scores: _Scores) -> bool:
        """Whether a window decoded at one temperature is decoded again at the next: too repetitive (its compression
        ratio over the threshold) or too unsure (its avg_logprob under it), but not when it looks like silence
        (no_speech_prob over its threshold with that low avg_logprob)."""
        avg, no_speech = scores.avg_logprob, scores.no_speech_prob
        is_unsure = self.logprob_threshold is not None and avg is not None and avg < self.logprob_threshold
        if is_unsure and self.no_speech_threshold is not None and no_speech is not None \
                and no_speech > self.no_speech_threshold:
            return False
        is_repetitive = (self.compression_ratio_threshold is not None
                         and compression_ratio(text) > self.compression_ratio_threshold)
        return is_unsure or is_repetitive

    def should_skip(self, scores: _Scores) -> bool:
        """Whether the kept decode of a window is dropped as silence: no_speech_prob over its threshold, unless the
        avg_logprob is over its own (the model was sure of what it heard)."""
        avg, no_speech = scores.avg_logprob, scores.no_speech_prob
        if self.no_speech_threshold is None or no_speech is None or no_speech <= self.no_speech_threshold:
            return False
        return not (self.logprob_threshold is not None and avg is not None and avg > self.logprob_threshold)


_DONE = object()


@dataclass(frozen=True, slots=True)
class WalkOptions:
    limits: AudioLimits
    max_parallel_windows: int = 16  # windows of one upload in flight at once (bounds the walk's memory)
    window_seconds: float = 30.0
    # windows of all uploads in flight at once in this walk instance: its share of what the decoder runs, so that
    # an admitted upload's windows wait here rather than being refused by the decoder's own admission (a 429)
    max_windows_in_flight: int = 16
    fallback: FallbackRules = FallbackRules()  # timestamped requests without a temperature
    # admission.queue_timeout_s: the longest an upload waits for its first window slot (the decoder's own queue
    # never fills, since the walk holds its load to the decoder's cap); None: no limit
    queue_timeout_s: float | None = None


class WhisperWalk:
    input_names = tuple(spec.name for spec in g.WALK.inputs)

    def __init__(self, tokenizer: Any, tokens: WhisperTokens, options: WalkOptions) -> None:
        self.tokenizer, self.tokens, self.options = tokenizer, tokens, options
        self.max_prompt_tokens = tokens.max_length // 2 - 1
        self.max_prompt_bytes = self.max_prompt_tokens * max_token_bytes(tokenizer)  # a longer prompt cannot fit
        self.windows = asyncio.Semaphore(options.max_windows_in_flight)  # shared by every upload of this walk

    async def stream(self, inputs: dict[str, np.ndarray], call: Call,
                     call_stream: CallStream) -> AsyncIterator[dict[str, np.ndarray]]:
        """Responses for one request: text deltas, then a last one with the metadata (and any remaining text)."""
        arrival = time.monotonic()  # the queue wait counts from here: the upload's decode is part of it
        req = parse_request(inputs, self.tokenizer, self.tokens, self.max_prompt_tokens, self.max_prompt_bytes)
        self._check_max_tokens(req)
        pcm = await asyncio.to_thread(self._load_audio, req)
        windows = split_windows(pcm, self.options.window_seconds)
        job = _Transcription(self, req, pcm, windows, call, call_stream, arrival)
        # closed here when this stream is (its client left): the window tasks and their decoder hops are cancelled
        # then, not when the collector or asyncio's finalizer hook gets to the dropped generator
        async with contextlib.aclosing(job.run()) as events:
            async for outputs in events:
                yield outputs

    async def run(self, inputs: dict[str, np.ndarray], call: Call, call_stream: CallStream) -> dict[str, np.ndarray]:
        """The whole transcription as one response (the streamed deltas joined)."""
        text, last = [], None
        async with contextlib.aclosing(self.stream(inputs, call, call_stream)) as events:
            async for outputs in events:
                text.append(outputs[g.TEXT_OUTPUT][0].decode("utf-8"))
                last = outputs
        return {**last, g.TEXT_OUTPUT: _bytes("".join(text))}

    def _check_max_tokens(self, req: TranscriptionRequest) -> None:
        """A `max_tokens` past what a window's decoder positions leave after its prompt is refused, not cut to it
        (ENGINE.md: refuse rather than truncate). Every window's prompt is as long: the language a window is
        forced to stands where window 0's detected one does, and a retry keeps the prompt."""
        if req.max_tokens is None:
            return
        prompt = build_prompt(self.tokens, language=None, task=req.task, timestamps=req.timestamps,
                              prompt_ids=req.prompt_ids)
        room = self.tokens.max_length - prompt.begin_index
        if req.max_tokens > room:
            raise ValueError(f"{g.MAX_TOKENS}: at most {room} tokens a window with this prompt (the decoder's "
                             f"{self.tokens.max_length} positions less its {prompt.begin_index} prompt tokens), got "
                             f"{req.max_tokens}")

    def _load_audio(self, req: TranscriptionRequest) -> np.ndarray:
        if req.audio is not None:
            return decode_upload(req.audio, self.options.limits, field=g.AUDIO)
        return to_model_pcm(req.pcm, req.sample_rate, self.options.limits, field=g.AUDIO_PCM)


@dataclass(slots=True)
class _WindowResult:
    window: Window
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # text ids lists, then _DONE (or an exception)
    free_ids: list[int] = field(default_factory=list)  # everything after the forced tokens, EOT excluded
    finish_reason: str = "stop"
    temperature: float = 0.0
    scores: _Scores | None = None  # the kept decode's avg_logprob and no_speech_prob
    compression_ratio: float = 0.0  # the kept decode's text's (every segment of the window carries it, as OpenAI's)


@dataclass(frozen=True, slots=True)
class _Scores:
    """OpenAI Whisper's per-window scores, as the decoder reports them on its last response (None: not computed)."""

    avg_logprob: float | None = None
    no_speech_prob: float | None = None


class _Transcription:
    """One request's windows in flight: decode tasks feed per-window queues that `run` drains in order."""

    def __init__(self, walk: WhisperWalk, req: TranscriptionRequest, pcm: np.ndarray, windows: list[Window],
                 call: Call, call_stream: CallStream, arrival: float) -> None:
        self.walk, self.tokens, self.req, self.pcm = walk, walk.tokens, req, pcm
        self.call, self.call_stream = call, call_stream
        self.results = [_WindowResult(w) for w in windows]
        self.language: asyncio.Future = asyncio.get_running_loop().create_future()
        if req.language is not None or not self.tokens.is_multilingual:
            self.language.set_result(req.language or "en")
        self.slots = asyncio.Semaphore(walk.options.max_parallel_windows)
        # untimed: stream each window's text as it decodes; timestamped: a window's text once it is kept (it may be
        # decoded again at a higher temperature, or dropped as silence)
        self.is_live = not req.timestamps
        self.any_text = False
        self.num_tokens = 0
        queue_timeout_s = walk.options.queue_timeout_s
        # from the request's arrival at the walk (`arrival`, monotonic), its upload's decode included
        self.queue_deadline = arrival + queue_timeout_s if queue_timeout_s else None
        self.is_admitted = False  # one of its windows has had a slot: it is served, no longer waiting
        self.failure: BaseException | None = None  # the first window's failure, which ends the request (`_fail`)

    @contextlib.asynccontextmanager
    async def _window_slot(self) -> AsyncIterator[None]:
        """One of the walk's window slots, for one component call. Until the upload's first call has one, the
        upload is waiting for admission, at most `queue_timeout_s` from its arrival: then it ends as a queue wait
        does in a component (`unavailable:`, the proxy's 503 with Retry-After), not at the request's deadline."""
        slots = self.walk.windows
        if self.is_admitted or self.queue_deadline is None or not slots.locked():
            await slots.acquire()
        else:
            try:
                await asyncio.wait_for(slots.acquire(), max(0.0, self.queue_deadline - time.monotonic()))
            except TimeoutError:
                if not self.is_admitted:
                    waited = self.walk.options.queue_timeout_s
                    raise QueueWaitExpired("walk", f"{wire.UNAVAILABLE_PREFIX}the upload waited {waited:g} s for "
                                                 f"admission (queue_timeout_s={waited:g}): every decoder slot of "
                                                 "this walk is busy; retry later") from None
                await slots.acquire()  # another of its windows got in meanwhile: this one is served, and waits
        if self.failure is not None:  # another window failed while this one waited: no more hops for the request
            slots.release()
            raise self.failure
        self.is_admitted = True
        try:
            yield
        finally:
            slots.release()

    async def run(self) -> AsyncIterator[dict[str, np.ndarray]]:
        tasks = [asyncio.create_task(self._decode_window(i, r)) for i, r in enumerate(self.results)]
        try:
            for result in self.results:
                detok = IncrementalDetokenizer(self.walk.tokenizer)
                is_started = False
                while (event := await result.events.get()) is not _DONE:
                    if isinstance(event, BaseException):
                        raise event
                    delta, is_started = self._join(detok.push(event), is_started)
                    if delta:
                        yield self._chunk(delta)
                delta, _ = self._join(detok.flush(), is_started)
                if delta:
                    yield self._chunk(delta)
            yield self._final()
        finally:
            for task in tasks:
                task.cancel()
            if not self.language.done():
                self.language.cancel()
            elif not self.language.cancelled():
                self.language.exception()  # read, so that a failure no window waited for is not logged as lost

    def _join(self, delta: str, is_started: bool) -> tuple[str, bool]:
        """Strip a window's leading blanks; one space between windows."""
        if is_started or not delta:
            return delta, is_started
        delta = delta.lstrip()
        if not delta:
            return "", False
        if self.any_text:
            delta = " " + delta
        self.any_text = True
        return delta, True

    # ---- one window -----------------------------------------------------------------------------------------

    async def _decode_window(self, index: int, result: _WindowResult) -> None:
        try:
            async with self.slots:
                window = result.window
                # Each component call holds one of the walk's window slots while it runs, never while it waits
                # for another window (the language), so no upload's windows can hold every slot and wait.
                async with self._window_slot():
                    encoded = await self.call("encoder", {g.AUDIO_PCM: self.pcm[window.start: window.end]})
                source = encoded[g.ENCODER_OUTPUT]
                temperatures = self._temperatures()
                detects = index == 0 and not self.language.done()
                if detects and (self.req.prompt_ids or temperatures[0] > 0):
                    # Detection reads <|startoftranscript|> alone (as transformers' detect_language), not the
                    # prompt, and takes the most likely language (argmax, as OpenAI Whisper and transformers do),
                    # never a draw at the request's temperature: so it is its own one-token greedy decode here.
                    async with self._window_slot():
                        await self._detect_language(source)
                    detects = False
                language = None if detects else await self.language
                rules = self.walk.options.fallback
                for temperature in temperatures:
                    if language is None and self.language.done():  # detected by this window's first (greedy) decode:
                        language = self.language.result()  # a retry keeps it instead of drawing it again
                    prompt = build_prompt(self.tokens, language=language, task=self.req.task,
                                          timestamps=self.req.timestamps, prompt_ids=self.req.prompt_ids)
                    async with self._window_slot():
                        free, finish, scores = await self._decode(index, result, source, prompt, temperature)
                    text = self.walk.tokenizer.decode(self.tokens.text_ids(free), skip_special_tokens=True).strip()
                    if temperature == temperatures[-1] or not rules.needs_fallback(text, scores):
                        break
                if self.req.timestamps and rules.should_skip(scores):
                    free, text = [], ""  # dropped as silence, as OpenAI Whisper drops it (no text, no segment)
                result.free_ids, result.finish_reason, result.temperature = free, finish, temperature
                result.scores, result.compression_ratio = scores, compression_ratio(text)
                if not self.is_live:
                    result.events.put_nowait(self.tokens.text_ids(free))
                self.num_tokens += len(free)
                if not self.language.done():
                    # This window was to detect the language, and its decode ended without a first token (the
                    # client left and the hop was cancelled): the windows waiting for the language end too. They
                    # waited for ever, holding the walk's admission place and the upload until the deadline.
                    self.language.set_exception(RuntimeError(f"window {index}'s decode ended without a token, so "
                                                             "no language was detected"))
            result.events.put_nowait(_DONE)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - delivered to the consumer
            if not self.language.done():
                self.language.set_exception(exc)
            self._fail(result, exc)

    def _fail(self, result: _WindowResult, exc: BaseException) -> None:
        """A window's failure ends the request at once (docs/reliability.md: the walk ends its stream at the first
        error a component returns): it goes to every window's queue, so `run` raises it after the text already
        queued where it reads, not once the earlier windows have decoded to their ends; the window slots refuse
        the request's later hops. It queued for the consumer only in its own window: a 429 of window 1 reached the
        client after window 0's whole decode, or became a 504 at the deadline, while windows 2.. still started."""
        if self.failure is None:
            self.failure = exc
            for other in self.results:
                if other is not result:
                    other.events.put_nowait(exc)
        result.events.put_nowait(exc)

    def _temperatures(self) -> tuple[float, ...]:
        if self.req.temperature is not None:
            return (self.req.temperature,)
        return FALLBACK_TEMPERATURES if self.req.timestamps else (0.0,)

    async def _decode(self, index: int, result: _WindowResult, source: np.ndarray, prompt: DecoderPrompt,
                      temperature: float) -> tuple[list[int], str, _Scores]:
        inputs = {
            g.ENCODER_OUTPUT: source,
            g.INPUT_IDS: np.asarray(prompt.prompt, np.int32),
            g.FORCED_IDS: np.asarray(prompt.forced, np.int32),
            g.TIMESTAMPS: np.array([self.req.timestamps]),
            g.TEMPERATURE: np.array([temperature], np.float32),
        }
        if self.req.max_tokens is not None:  # within the window's room (`_check_max_tokens`)
            inputs[g.MAX_TOKENS] = np.array([self.req.max_tokens], np.int32)
        if self.req.seed is not None and temperature > 0:
            inputs[g.SEED] = np.array([(self.req.seed + index) % 2**63], np.int64)
        tokens: list[int] = []
        finish = "stop"
        scores = _Scores()
        async for response in self.call_stream("decoder", inputs):
            new = [int(t) for t in np.asarray(response.get("token_ids", [])).reshape(-1)]
            before = len(tokens)
            tokens += new
            self._note_language(prompt, tokens, before)
            if self.is_live:
                free_new = tokens[max(before, len(prompt.forced)):]
                if text := self.tokens.text_ids(free_new):
                    result.events.put_nowait(text)
            reason = _text(response.get("finish_reason"))
            if reason:
                finish = reason
                scores = _Scores(_float(response.get(g.AVG_LOGPROB)), _float(response.get(g.NO_SPEECH_PROB)))
        free = [t for t in tokens[len(prompt.forced):] if t != self.tokens.eot]
        return free, finish, scores

    async def _detect_language(self, source: np.ndarray) -> None:
        inputs = {g.ENCODER_OUTPUT: source, g.INPUT_IDS: np.asarray([self.tokens.sot], np.int32),
                  g.FORCED_IDS: np.asarray([LANGUAGE], np.int32), g.MAX_TOKENS: np.array([0], np.int32)}
        tokens: list[int] = []
        async for response in self.call_stream("decoder", inputs):
            tokens += [int(t) for t in np.asarray(response.get("token_ids", [])).reshape(-1)]
        if not self.language.done():  # another window's failure may have ended the walk's wait meanwhile
            self.language.set_result(self.tokens.code_of(tokens[0]) if tokens else "en")

    def _note_language(self, prompt: DecoderPrompt, tokens: list[int], before: int) -> None:
        if before == 0 and tokens and prompt.forced and prompt.forced[0] == LANGUAGE and not self.language.done():
            self.language.set_result(self.tokens.code_of(tokens[0]) or "en")

    # ---- responses ------------------------------------------------------------------------------------------

    def _chunk(self, text: str) -> dict[str, np.ndarray]:
        return {g.TEXT_OUTPUT: _bytes(text), g.FINISH_REASON: _bytes(""), g.DETECTED_LANGUAGE: _bytes(""),
                g.DURATION: np.array([0.0], np.float32), g.SEGMENTS: _bytes(""),
                g.COMPLETION_TOKENS: np.array([self.num_tokens], np.int32)}

    def _final(self) -> LastResponse:
        finish = "length" if any(r.finish_reason == "length" for r in self.results) else "stop"
        language = self.language.result() if self.language.done() and not self.language.cancelled() else ""
        return LastResponse({
            g.TEXT_OUTPUT: _bytes(""), g.FINISH_REASON: _bytes(finish), g.DETECTED_LANGUAGE: _bytes(language),
            g.DURATION: np.array([self.pcm.shape[0] / TARGET_RATE], np.float32),
            g.SEGMENTS: _bytes(json.dumps(self._segments(), ensure_ascii=False)),
            g.COMPLETION_TOKENS: np.array([self.num_tokens], np.int32)})

    def _segments(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for result in self.results:
            window = result.window
            if self.req.timestamps:
                pieces = split_segments(self.tokens, result.free_ids, window.offset_s, window.duration_s)
            else:
                pieces = [(window.offset_s, window.offset_s + window.duration_s, result.free_ids)]
            lo, hi = window.offset_s, window.offset_s + window.duration_s
            scores = result.scores or _Scores()  # every segment of a window carries the window's (as OpenAI's)
            for piece in pieces:
                start, end, ids = (piece.start, piece.end, piece.token_ids) if self.req.timestamps else piece
                text = self.walk.tokenizer.decode(self.tokens.text_ids(ids), skip_special_tokens=True)
                if not text.strip():
                    continue
                # The model's timestamps count in its 30 s frame: held to the window's audio and in order, so that
                # no cue runs past the upload or starts before the one ahead of it (srt/vtt players need both).
                start = min(max(start, lo), hi)
                end = min(max(end, start), hi)
                lo = end
                out.append({"id": len(out), "seek": window.start // 160, "start": round(start, 3),
                            "end": round(end, 3), "text": text, "tokens": ids, "temperature": result.temperature,
                            "avg_logprob": scores.avg_logprob,
                            "compression_ratio": round(result.compression_ratio, 4),
                            "no_speech_prob": scores.no_speech_prob})
        return out


def _bytes(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


def _float(value: Any) -> float | None:
    """A decoder score tensor -> a float to 6 significant digits, or None (absent, or NaN: not computed)."""
    if value is None:
        return None
    arr = np.asarray(value, dtype=np.float64).reshape(-1)
    return float(f"{arr[0]:.6g}") if arr.size and np.isfinite(arr[0]) else None


def _text(value: Any) -> str:
    if value is None:
        return ""
    arr = np.asarray(value).reshape(-1)
    if arr.size == 0:
        return ""
    item = arr[0]
    return item.decode("utf-8") if isinstance(item, bytes) else str(item)

