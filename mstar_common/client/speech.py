"""Speech methods of `MStarClient` (native /generate with audio output).

    client.tts("Hello there", voice="tara").to_wav("out.wav")
    result = client.tts("Hi", voice="leo", temperature=0.6, max_tokens=600, seed=1)   # result.pcm: int16 samples
    for chunk in client.tts("Hello there", voice="tara", stream=True):                # as each chunk is decoded
        play(chunk.pcm, chunk.sample_rate)
"""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mstar_common.client.types import EventStream, set_knobs, sse_events


@dataclass(slots=True)
class SpeechResult:
    wav: bytes  # a PCM16 mono WAV file
    sample_rate: int
    finish_reason: str
    usage: dict[str, int] = field(default_factory=dict)
    token_ids: list[int] | None = None  # only when return_token_ids=True

    @property
    def pcm(self) -> bytes:
        """The raw PCM16 little-endian samples."""
        with wave.open(io.BytesIO(self.wav)) as reader:
            return reader.readframes(reader.getnframes())

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / 2 / self.sample_rate

    def to_wav(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_bytes(self.wav)
        return path


@dataclass(slots=True)
class SpeechChunk:
    """One streamed event: PCM16 samples as they are decoded (and their tokens with return_token_ids=True), or the
    last event with no samples, the finish reason and the usage."""

    pcm: bytes = b""  # raw PCM16 little-endian mono samples
    sample_rate: int | None = None  # of `pcm`; on the last event, that of the chunks before it (None if none came)
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    usage: dict[str, int] | None = None


class SpeechMethods:
    """Mixed into MStarClient: uses its `_model`, `_post`, `_open_stream` and `_json`."""

    def tts(self, text: str, voice: str | None = None, *, stream: bool = False, model: str | None = None,
            **knobs: Any) -> SpeechResult | EventStream[SpeechChunk]:
        """Text to speech. `knobs`: temperature, top_p, top_k, min_p, repetition_penalty, max_tokens, seed,
        ignore_eos, return_token_ids. `stream=True`: the audio as it is decoded (the first chunk comes long before
        the whole clip would), as `SpeechChunk`s whose PCM joined is the whole clip's."""
        kwargs = set_knobs({**knobs, "voice": voice})
        body: dict[str, Any] = {"text": text, "output_modalities": ["audio"], "model_kwargs": kwargs,
                                "streaming": stream}
        if (name := self._model(model)) is not None:
            body["model"] = name
        if stream:
            response = self._open_stream(json=body)
            return EventStream(response, _chunks(response))
        return self._json(self._post(json=body), _result)


def _result(data: dict[str, Any]) -> SpeechResult:
    audio = data["outputs"]["audio"][0]
    return SpeechResult(wav=base64.b64decode(audio["data"], validate=True), sample_rate=int(audio["sample_rate"]),
                        finish_reason=data["finish_reason"], usage=data.get("usage", {}),
                        token_ids=data.get("token_ids"))


def _chunks(response: httpx.Response) -> Iterator[SpeechChunk]:
    """/generate's audio events: {"audio": base64 PCM16, "sample_rate"[, "token_ids"]} per chunk, then
    {"finish_reason", "usage"}."""
    sample_rate = None

    def chunk(event: dict[str, Any]) -> SpeechChunk:
        nonlocal sample_rate
        sample_rate = event.get("sample_rate", sample_rate)
        return SpeechChunk(pcm=base64.b64decode(event.get("audio", ""), validate=True), sample_rate=sample_rate,
                           token_ids=event.get("token_ids"), finish_reason=event.get("finish_reason"),
                           usage=event.get("usage"))

    return sse_events(response, chunk)
