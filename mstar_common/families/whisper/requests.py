"""Parse and validate a transcription request's wire tensors; every refusal names the field and the rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mstar_common.config import is_finite_number
from mstar_common.families.text import check_text_fits, max_token_bytes
from mstar_common.families.whisper import graph as g
from mstar_common.families.whisper.audio import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE
from mstar_common.families.whisper.decoding import TASKS, WhisperTokens

MAX_TEMPERATURE = 1.0  # OpenAI's range for transcriptions, on every surface (the fallback ladder tops at 1.0)
MAX_SEED = 2**63 - 1


@dataclass(slots=True)
class TranscriptionRequest:
    audio: bytes | None  # an encoded file, or
    pcm: np.ndarray | None  # mono samples at `sample_rate`
    sample_rate: int | None
    language: str | None  # the checkpoint's language code; None: detect
    task: str
    prompt_ids: list[int]  # the initial prompt's text tokens (without <|startofprev|>)
    temperature: float | None  # None: not given (0, with fallback when timestamps are on)
    timestamps: bool
    max_tokens: int | None  # free tokens per window
    seed: int | None


def parse_request(inputs: dict[str, np.ndarray], tokenizer: Any, tokens: WhisperTokens,
                  max_prompt_tokens: int, max_prompt_bytes: int | None = None) -> TranscriptionRequest:
    """`max_prompt_bytes`: a prompt longer than this cannot fit `max_prompt_tokens` (`max_token_bytes` times it);
    None: computed here from the tokenizer's vocabulary."""
    audio, pcm, rate = _audio(inputs)
    language = _text(inputs, g.LANGUAGE)
    language, task = tokens.defaults(tokens.language_code(language) if language else None,
                                     (_text(inputs, g.TASK) or "").strip().lower() or None)
    if task not in TASKS:
        raise ValueError(f"{g.TASK}: must be one of {list(TASKS)}, got {task!r}")
    if task == "translate" and not tokens.is_multilingual:
        raise ValueError(f"{g.TASK}: this checkpoint is English-only and cannot translate")
    temperature = _number(inputs, g.TEMPERATURE)
    if temperature is not None and not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise ValueError(f"{g.TEMPERATURE}: must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    max_tokens = _integer(inputs, g.MAX_TOKENS)
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"{g.MAX_TOKENS}: must be >= 1, got {max_tokens}")
    seed = _integer(inputs, g.SEED)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{g.SEED}: must be in [0, {MAX_SEED}], got {seed}")
    timestamps = _scalar(inputs, g.TIMESTAMPS)
    return TranscriptionRequest(
        audio=audio, pcm=pcm, sample_rate=rate, language=language, task=task,
        prompt_ids=prompt_ids(_text(inputs, g.PROMPT) or "", tokenizer, tokens, max_prompt_tokens, max_prompt_bytes),
        temperature=temperature, timestamps=bool(timestamps) if timestamps is not None else False,
        max_tokens=max_tokens, seed=seed,
    )


def prompt_ids(text: str, tokenizer: Any, tokens: WhisperTokens, max_tokens: int,
               max_bytes: int | None = None) -> list[int]:
    """The initial prompt as Whisper reads it: a leading space, then the text (no special tokens allowed)."""
    if not text.strip():
        return []
    if tokens.prev is None:
        raise ValueError(f"{g.PROMPT}: this checkpoint declares no <|startofprev|> token, so it takes no prompt")
    max_bytes = max_tokens * max_token_bytes(tokenizer) if max_bytes is None else max_bytes
    check_text_fits(" " + text.strip(), g.PROMPT, max_tokens, max_bytes)  # before the tokenizer sees it
    ids = list(tokenizer.encode(" " + text.strip(), add_special_tokens=False))
    if special := [i for i in ids if i >= tokens.eot]:
        raise ValueError(f"{g.PROMPT}: must be plain text; it spells the special token "
                         f"{tokenizer.convert_ids_to_tokens(special[0])!r}")
    if len(ids) > max_tokens:
        raise ValueError(f"{g.PROMPT}: {len(ids)} tokens; at most {max_tokens} (half the decoder's window)")
    return ids


def _audio(inputs: dict[str, np.ndarray]) -> tuple[bytes | None, np.ndarray | None, int | None]:
    has_file, has_pcm = g.AUDIO in inputs, g.AUDIO_PCM in inputs
    if has_file == has_pcm:
        raise ValueError(f"{g.AUDIO}: give exactly one of {g.AUDIO} (an encoded audio file) or {g.AUDIO_PCM} "
                         f"(samples, with {g.SAMPLE_RATE})")
    if has_file:
        arr = np.asarray(inputs[g.AUDIO]).reshape(-1)
        if arr.size != 1:
            raise ValueError(f"{g.AUDIO}: expected one file, got {arr.size}")
        if g.SAMPLE_RATE in inputs:  # refused, not dropped: the file's own header gives its rate
            raise ValueError(f"{g.SAMPLE_RATE}: applies only to {g.AUDIO_PCM} (an encoded file in {g.AUDIO} carries "
                             f"its own rate)")
        data = arr[0]
        return (data if isinstance(data, bytes) else str(data).encode()), None, None
    rate = _integer(inputs, g.SAMPLE_RATE)
    if rate is None:
        raise ValueError(f"{g.SAMPLE_RATE}: required with {g.AUDIO_PCM}")
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise ValueError(f"{g.SAMPLE_RATE}: {rate} Hz is outside [{MIN_SAMPLE_RATE}, {MAX_SAMPLE_RATE}]")
    return None, np.asarray(inputs[g.AUDIO_PCM], dtype=np.float32).reshape(-1), rate


def _scalar(inputs: dict[str, np.ndarray], name: str) -> Any:
    if name not in inputs:
        return None
    arr = np.asarray(inputs[name]).reshape(-1)
    if arr.size != 1:
        raise ValueError(f"{name}: expected one value, got {arr.size}")
    return arr[0].item() if hasattr(arr[0], "item") else arr[0]


def _text(inputs: dict[str, np.ndarray], name: str) -> str | None:
    value = _scalar(inputs, name)
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name}: must be UTF-8 text") from None
    return str(value)


def _number(inputs: dict[str, np.ndarray], name: str) -> float | None:
    value = _scalar(inputs, name)
    if value is None:
        return None
    if not is_finite_number(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    if np.asarray(inputs[name]).dtype == np.float32:  # the client's 0.2, not 0.20000000298023224 (what it reports
        return float(str(np.float32(value)))  # back, in a segment's temperature): the shortest float32 decimal
    return float(value)


def _integer(inputs: dict[str, np.ndarray], name: str) -> int | None:
    value = _scalar(inputs, name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    return int(value)
