"""LM tokens -> codec windows -> audio responses, one codec call per step (the StreamEdge of a speech walk).

The engine's loop thread only queues each row's new tokens (`on_output`, inherited from OutputPump). This
pump drains everything queued, which is one engine step or several when the codec is the slower side,
feeds each stream's chunker, and sends every window that became ready, across all streams, to the codec
in ONE call (on Triton a BLS request to the codec component): hops are per step, never per request or per
token, and the codec sees the whole step's batch. Each stream then gets its audio in play order, as soon
as it is decoded (several frames per response when it fell behind), and a finished stream's FINAL follows
its last audio. A stream's first response can be held until it carries `first_chunk_frames` frames (a
deployment knob; 3 in the orpheus family, 1 where a runtime is built without it): a playback buffer that trades
first-audio latency for no gap when many streams start at once and the first frames come faster than the ones
right after. With `first_chunk_frames` None
("auto"), the hold is set when the stream's first frame is decoded, from how many streams the pump serves then
(`auto_first_chunk_frames`): one frame for a lone stream, a longer buffer under load; until the stream's first
response goes out, it grows if more streams join meanwhile (it never shrinks).

Cancellation: the inherited poll drops the stream (its chunker is the stream's codec state, so nothing of
it is decoded any more), closes the request and cancels it in the engine, which frees its KV pages within
a step. Errors the engine reports end a stream by the text pump's rule.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from mstar_common import wire
from mstar_common.engine.output_pump import LatencySamples, OutputPump, Sink
from mstar_common.engine.types import FinishReason

logger = logging.getLogger(__name__)

PCM_SCALE = 32767  # float [-1, 1] -> int16, truncating toward zero as the reference does
AUTO_STREAMS_PER_FRAME = 40  # "auto" first chunk: one more held frame per this many streams being served
AUTO_MAX_FRAMES = 8  # ... up to 8 frames (683 ms)


def auto_first_chunk_frames(num_streams: int) -> int:
    """The "auto" first-chunk hold: 1 frame below 40 streams, 2 from 40, 3 from 80, 4 from 120, 5 from 160, 6 from
    200, 7 (597 ms) from 240 and at most 8. On the H200 (docs/benchmarks.md) one frame kept 64/64 streams
    without a gap and none of 192; three kept 148/192; at 256 streams with an fp8 KV pool, seven (this rule)
    kept 256/256 in every run of the committed code."""
    return min(AUTO_MAX_FRAMES, 1 + num_streams // AUTO_STREAMS_PER_FRAME)


class Chunker(Protocol):
    """One stream's codec state: tokens in, codec windows out (see families/orpheus/codes.py)."""

    def push(self, token_ids: list[int]) -> np.ndarray: ...
    def close(self) -> np.ndarray: ...


class Codec(Protocol):
    """`decode(windows [N, ...]) -> audio [N, samples]` float32; one call per step."""

    def decode(self, windows: np.ndarray) -> np.ndarray: ...


@dataclass(slots=True)
class AudioStream:
    request_id: str
    sink: Sink
    chunker: Chunker
    sample_rate: int
    num_prompt_tokens: int
    num_completion_tokens: int = 0
    pending_ids: list[int] = field(default_factory=list)  # tokens not yet reported in a response
    arrival: float = field(default_factory=time.monotonic)
    is_audio_started: bool = False
    first_chunk_frames: int | None = 1  # frames the first audio response carries (a playback buffer; None: auto)
    is_auto_hold: bool = False  # first_chunk_frames came from "auto": it may still grow until the first response
    held: list[np.ndarray] = field(default_factory=list)  # decoded frames waiting for the first response

    def take_first_chunk(self, chunk: np.ndarray, is_last: bool) -> np.ndarray | None:
        """Until the first response: hold decoded frames until `first_chunk_frames` are ready (or the stream
        ends), then return them all; None while holding. Afterwards `chunk` passes through."""
        if self.is_audio_started or (not self.held and len(chunk) >= self.first_chunk_frames):
            return chunk
        if len(chunk):
            self.held.append(chunk)
        if not is_last and sum(len(c) for c in self.held) < self.first_chunk_frames:
            return None
        held, self.held = self.held, []
        return np.concatenate(held) if held else chunk

    def outputs(self, audio: np.ndarray, finish: FinishReason | None) -> dict[str, np.ndarray]:
        pcm = (audio.reshape(-1) * PCM_SCALE).astype(np.int16)
        token_ids, self.pending_ids = self.pending_ids, []
        return {
            wire.AUDIO_CHUNK: pcm,
            wire.SAMPLE_RATE: np.array([self.sample_rate], dtype=np.int32),
            wire.TOKEN_IDS: np.asarray(token_ids, dtype=np.int32),
            wire.FINISH_REASON: np.array([(finish.value if finish else "").encode()], dtype=np.object_),
            wire.PROMPT_TOKENS: np.array([self.num_prompt_tokens], dtype=np.int32),
            wire.COMPLETION_TOKENS: np.array([self.num_completion_tokens], dtype=np.int32),
        }


class SpeechLatency(LatencySamples):
    def __init__(self) -> None:
        super().__init__()
        self.first_audio: deque[float] = deque(maxlen=self.MAX_SAMPLES)  # arrival -> first audio sent, seconds


@dataclass(slots=True)
class _Ready:
    stream: AudioStream
    finish: FinishReason | None
    windows: np.ndarray


class CodecPump(OutputPump):
    def __init__(self, engine: Any, codec: Codec, name: str = "codec-pump", watch: Any = None) -> None:
        super().__init__(engine, name=name, watch=watch)
        self.latency = SpeechLatency()
        self._codec = codec
        self.num_codec_calls = 0
        self.num_windows = 0

    def _send_round(self) -> None:
        """Every pending stream at once: their codec windows decode in one batched call."""
        self._send_all()

    def _deliver(self, merged: dict[str, tuple[list[int], FinishReason | None, str | None]]) -> None:
        ready: list[_Ready] = []
        for request_id, (new_ids, finish, error) in merged.items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # ended already: a client's cancel is dropped without decoding what it still held
            if error is not None or finish is FinishReason.CANCELLED:  # the text pump's rule: a client-facing
                super()._deliver({request_id: (new_ids, finish, error)})  # limit, a server fault, or a shutdown
                continue
            stream.num_completion_tokens += len(new_ids)
            stream.pending_ids += new_ids
            windows = stream.chunker.push(new_ids)
            if finish is not None:
                windows = np.concatenate([windows, stream.chunker.close()])
            if len(windows) or finish is not None:
                ready.append(_Ready(stream, finish, windows))
        if ready:
            self._decode_and_send(ready)

    def _decode_and_send(self, ready: list[_Ready]) -> None:
        batch = [r.windows for r in ready if len(r.windows)]
        started = time.perf_counter()
        try:
            audio = self._codec.decode(np.concatenate(batch)) if batch else np.zeros((0, 0), np.float32)
        except Exception as exc:  # noqa: BLE001 - the streams of this step end; the pump keeps serving others
            message = str(exc)
            # The codec component's own answer of a class (its `unavailable:` when it stopped mid-drain) keeps that
            # class, as the text pump keeps a limit's: a 503 the client may retry, not a 500 with an error id.
            prefix = wire.error_class(message)
            if prefix is None:
                logger.exception("codec call for %d streams failed", len(ready))
            else:
                logger.warning("codec call for %d streams refused: %s", len(ready), message)
            for r in ready:
                self.unregister(r.stream.request_id)
                if r.finish is None:
                    self._engine.cancel(r.stream.request_id)
                if prefix is None:
                    r.stream.sink.send_server_error(exc)
                else:
                    r.stream.sink.send_error(message[message.find(prefix):])
            return
        self.times.codec_s += time.perf_counter() - started
        if batch:
            self.num_codec_calls += 1
            self.num_windows += len(audio)
        offset = 0
        for r in ready:
            chunk, offset = audio[offset:offset + len(r.windows)], offset + len(r.windows)
            if r.stream.first_chunk_frames is None:  # "auto": decided now, from the load its first frame meets
                r.stream.is_auto_hold, r.stream.first_chunk_frames = True, 0
            if r.stream.is_auto_hold and not r.stream.is_audio_started:  # ... and raised while streams keep joining
                hold = auto_first_chunk_frames(self.num_streams)
                r.stream.first_chunk_frames = max(r.stream.first_chunk_frames, hold)
            chunk = r.stream.take_first_chunk(chunk, is_last=r.finish is not None)
            if chunk is None:
                continue  # held for a fuller first response
            outputs = r.stream.outputs(chunk, r.finish)
            self.times.responses += 1
            if len(chunk) and not r.stream.is_audio_started:
                r.stream.is_audio_started = True
                self.latency.first_audio.append(time.monotonic() - r.stream.arrival)
            sending = time.perf_counter()
            if r.finish is None:
                r.stream.sink.send_chunk(outputs)
            else:
                self.unregister(r.stream.request_id)
                r.stream.sink.send_final(outputs)
            self.times.send_s += time.perf_counter() - sending
