"""Transcription methods of `MStarClient` (native /generate with an audio upload).

    client.transcribe("talk.wav").text
    client.transcribe("talk.flac", language="fr", task="translate", timestamps=True).segments
    for event in client.transcribe("talk.wav", stream=True):
        print(event.text, end="")
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import httpx

from mstar_common.client.types import EventStream, encode_json, read_file_input, sse_events


@dataclass(slots=True)
class TranscriptionResult:
    text: str
    language: str  # ISO-639-1 code of the language transcribed (detected or forced)
    duration: float  # seconds of audio
    finish_reason: str
    segments: list[dict[str, Any]] = field(default_factory=list)  # timed with timestamps=True, else one a window
    usage: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class TranscriptionEvent:
    """One streamed event: new text, or the last event with the finish reason and the metadata."""

    text: str = ""
    finish_reason: str | None = None
    language: str | None = None
    duration: float | None = None
    segments: list[dict[str, Any]] | None = None
    usage: dict[str, int] | None = None


class TranscriptionMethods:
    """Mixed into MStarClient: uses its `_model`, `_post`, `_open_stream` and `_json`."""

    def transcribe(self, audio: str | os.PathLike | bytes | BinaryIO, *, stream: bool = False, model: str | None = None,
                   language: str | None = None, task: str | None = None, prompt: str | None = None,
                   temperature: float | None = None, timestamps: bool = False, max_tokens: int | None = None,
                   seed: int | None = None) -> TranscriptionResult | EventStream[TranscriptionEvent]:
        """Speech to text (`task="translate"`: to English; None: the checkpoint's own task, transcribe unless its
        generation config says otherwise). `audio`: a file path, an open binary file or the file's
        bytes (WAV, FLAC, OGG, MP3, M4A/MP4, WebM, AAC, ...). Uploads over 30 s are cut at quiet moments and
        transcribed in parallel."""
        data = read_file_input(audio, "audio")
        kwargs = {"language": language, "task": task, "prompt": prompt, "temperature": temperature,
                  "timestamps": timestamps, "max_tokens": max_tokens, "seed": seed}
        form = {"model_kwargs": encode_json({k: v for k, v in kwargs.items() if v is not None}),
                "streaming": "true" if stream else "false", "output_modalities": "text"}
        if (name := self._model(model)) is not None:
            form["model"] = name
        files = {"audio": ("audio", data, "application/octet-stream")}
        if stream:
            response = self._open_stream(data=form, files=files)
            return EventStream(response, _events(response))
        return self._json(self._post(data=form, files=files), _result)


def _result(body: dict[str, Any]) -> TranscriptionResult:
    return TranscriptionResult(text="".join(body["outputs"]["text"]), language=body.get("language", ""),
                               duration=float(body.get("duration", 0.0)), finish_reason=body["finish_reason"],
                               segments=body.get("segments", []), usage=body.get("usage", {}))


def _events(response: httpx.Response) -> Iterator[TranscriptionEvent]:
    return sse_events(response, lambda event: TranscriptionEvent(
        text=event.get("text", ""), finish_reason=event.get("finish_reason"), language=event.get("language"),
        duration=event.get("duration"), segments=event.get("segments"), usage=event.get("usage")))
