"""Speech methods of `MStarClient` (native /generate with audio output).

    client.tts("Hello there", voice="tara").to_wav("out.wav")
    result = client.tts("Hi", voice="leo", temperature=0.6, max_tokens=600, seed=1)   # result.pcm: int16 samples
"""

from __future__ import annotations

import base64
import io
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mstar_common.client.types import set_knobs


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


class SpeechMethods:
    """Mixed into MStarClient: uses its `_model`, `_post` and `_json`."""

    def tts(self, text: str, voice: str | None = None, *, model: str | None = None, **knobs: Any) -> SpeechResult:
        """Text to speech. `knobs`: temperature, top_p, top_k, min_p, repetition_penalty, max_tokens, seed,
        return_token_ids."""
        kwargs = set_knobs({**knobs, "voice": voice})
        body: dict[str, Any] = {"text": text, "output_modalities": ["audio"], "model_kwargs": kwargs}
        if (name := self._model(model)) is not None:
            body["model"] = name
        data = self._json(self._post(json=body))
        audio = data["outputs"]["audio"][0]
        return SpeechResult(wav=base64.b64decode(audio["data"]), sample_rate=int(audio["sample_rate"]),
                            finish_reason=data["finish_reason"], usage=data.get("usage", {}),
                            token_ids=data.get("token_ids"))
