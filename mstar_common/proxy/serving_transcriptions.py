"""Transcription: POST /v1/audio/transcriptions and /v1/audio/translations (OpenAI), and /generate with an audio
upload for transcription models.

OpenAI form fields: `file` (required), `model`, `language` (transcriptions only), `prompt`, `response_format`
(json | text | srt | verbose_json | vtt), `temperature` (0-1), `timestamp_granularities[]` (segment, with
verbose_json), `stream` (json and text: `transcript.text.delta` events, then `transcript.text.done` whose text is
the deltas joined), and the extras `seed` and `max_tokens` (per 30 s window). Fields the server cannot honour are
refused, not dropped: word timestamps, `include[]=logprobs`, diarization, `chunking_strategy` other than auto
(long uploads are always cut at quiet moments), speaker references. The walk decodes, checks (duration and byte
caps) and transcribes the audio; its refusals come back as 400s naming the field.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from starlette.datastructures import UploadFile

from mstar_common.families.whisper.languages import CODE_TO_NAME
from mstar_common.proxy.errors import check_wire_number, invalid_request, parse_json
from mstar_common.proxy.serving_common import (
    FORM_TYPES,
    MODALITY_FIELDS,
    ServingContext,
    form_bool,
    form_float,
    form_int,
    form_modalities,
    read_utf8_form,
    until_disconnect,
)
from mstar_common.proxy.sse import SSEResponse, sse_body
from mstar_common.proxy.triton_stream import GenerationRequest, StreamResponse

router = APIRouter()

TRANSCRIPTION_KINDS = ("transcription",)
RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
TIMED_FORMATS = ("srt", "verbose_json", "vtt")
STREAM_FORMATS = ("json", "text")
MAX_TEMPERATURE = 1.0  # OpenAI's range
CHUNKING_RULE = "'chunking_strategy': only 'auto' (uploads over 30 s are cut at quiet moments)"
_FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]",
           "timestamp_granularities", "stream", "seed", "max_tokens", "include[]", "include", "chunking_strategy"}
_REFUSED = {  # OpenAI fields this server cannot honour -> the rule
    "known_speaker_names[]": "speaker diarization is not available",
    "known_speaker_references[]": "speaker diarization is not available",
    "keywords[]": "keyword boosting is not available; put the words in 'prompt'",
    "languages[]": "send one 'language' (or none to detect it)",
}


@dataclass(slots=True)
class TranscriptionForm:
    audio: bytes
    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float | None = None
    stream: bool = False
    seed: int | None = None
    max_tokens: int | None = None

    @property
    def is_timed(self) -> bool:
        return self.response_format in TIMED_FORMATS


@dataclass(slots=True)
class Transcript:
    """A transcription stream folded into one result."""

    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    language: str = ""
    duration: float = 0.0
    segments: list[dict[str, Any]] = field(default_factory=list)

    def add(self, response: StreamResponse) -> None:
        self.text += response.text
        self.finish_reason = response.finish_reason or self.finish_reason
        self.completion_tokens = response.completion_tokens or self.completion_tokens
        if response.transcript is not None:
            self.language = response.transcript["language"]
            self.duration = response.transcript["duration"]
            self.segments = response.transcript["segments"]


# ---- reading the form ---------------------------------------------------------------------------------------


async def read_form(request: Request, task: str) -> TranscriptionForm:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in FORM_TYPES:
        raise invalid_request(f"this route takes multipart/form-data with the audio in 'file', got "
                              f"{content_type or 'no content type'!r}")
    form = await read_utf8_form(request)
    values: dict[str, list[Any]] = {key: form.getlist(key) for key in dict.fromkeys(form.keys())}
    for key in values:
        if key in _REFUSED:
            raise invalid_request(f"'{key.rstrip('[]')}' is not supported: {_REFUSED[key]}", param=key.rstrip("[]"))
        if key.startswith("chunking_strategy["):  # the openai SDK's form of an object ({"type": "server_vad", ...})
            raise invalid_request(CHUNKING_RULE, param="chunking_strategy")
        if key == "language" and task == "translate":
            raise invalid_request("'language' is not a field of translations: the output is English, and the "
                                  "spoken language is detected", param=key)
        if key == "task":  # the spec's `task="translate"` is another model's (Canary) field here
            raise invalid_request("unknown field 'task': to translate, post to /v1/audio/translations", param=key)
        if key not in _FIELDS:
            raise invalid_request(f"unknown field '{key}'", param=key)
    audio = await _upload(values.get("file"))
    one = {key: _one(key, vals) for key, vals in values.items() if key != "file"}
    form_ = TranscriptionForm(
        audio=audio,
        model=one.get("model") or None,
        language=(one.get("language") or "").strip() or None,
        prompt=one.get("prompt") or None,
        response_format=(one.get("response_format") or "json").strip(),
        temperature=_number(one, "temperature"),
        stream=form_bool(one.get("stream", ""), "stream"),
        seed=_integer(one, "seed"),
        max_tokens=_integer(one, "max_tokens"),
    )
    _check(form_, values, one)
    return form_


async def _upload(values: list[Any] | None, field: str = "file") -> bytes:
    """The one audio upload in `field` (the route's name for it: `file`, /generate's `audio`)."""
    if not values:
        raise invalid_request(f"'{field}' is required: the audio to transcribe, as a multipart upload", param=field)
    if len(values) > 1:
        raise invalid_request(f"'{field}' was sent {len(values)} times; send one audio file", param=field)
    if not isinstance(values[0], UploadFile):
        raise invalid_request(f"'{field}' must be an uploaded file, not a text field", param=field)
    data = await values[0].read()
    if not data:
        raise invalid_request(f"'{field}': the upload is empty", param=field)
    return data


def _one(key: str, values: list[Any]) -> Any:
    if any(isinstance(v, UploadFile) for v in values):
        raise invalid_request(f"'{key}': unexpected file upload", param=key)
    if key.endswith("[]") or key in ("timestamp_granularities", "include"):
        return [v.strip() for v in values]
    if len(values) > 1:
        raise invalid_request(f"'{key}' was sent {len(values)} times; send it once", param=key)
    return values[0]


def _check(form: TranscriptionForm, values: dict[str, list[Any]], one: dict[str, Any]) -> None:
    if form.response_format not in RESPONSE_FORMATS:
        raise invalid_request(f"'response_format' must be one of {list(RESPONSE_FORMATS)}, got "
                              f"{form.response_format!r}", param="response_format")
    granularities = one.get("timestamp_granularities[]", []) + one.get("timestamp_granularities", [])
    if bad := [g for g in granularities if g not in ("segment", "word")]:
        raise invalid_request(f"'timestamp_granularities' must be 'segment' or 'word', got {bad[0]!r}",
                              param="timestamp_granularities")
    if "word" in granularities:
        raise invalid_request("'timestamp_granularities': word timestamps are not supported; 'segment' is",
                              param="timestamp_granularities")
    if granularities and form.response_format != "verbose_json":
        raise invalid_request("'timestamp_granularities' needs response_format 'verbose_json'",
                              param="timestamp_granularities")
    if includes := [i for i in one.get("include[]", []) + one.get("include", []) if i]:
        raise invalid_request(f"'include' is not supported: log-probabilities are not returned (got {includes})",
                              param="include")
    if one.get("chunking_strategy", "auto").strip() not in ("auto", ""):
        raise invalid_request(CHUNKING_RULE, param="chunking_strategy")
    if form.stream and form.response_format not in STREAM_FORMATS:
        raise invalid_request(f"'stream' needs response_format {' or '.join(STREAM_FORMATS)}, got "
                              f"{form.response_format!r}", param="stream")
    if form.max_tokens is not None and form.max_tokens < 1:
        raise invalid_request(f"'max_tokens' must be >= 1, got {form.max_tokens}", param="max_tokens")
    if form.seed is not None and not 0 <= form.seed < 2**63:
        raise invalid_request(f"'seed' must be in [0, 2^63), got {form.seed}", param="seed")


def _number(one: dict[str, Any], key: str) -> float | None:
    raw = one.get(key)
    if raw is None or not str(raw).strip():
        return None
    if (value := form_float(str(raw))) is None:
        raise invalid_request(f"'{key}' must be a number, got {raw!r}", param=key)
    if not math.isfinite(value):
        raise invalid_request(f"'{key}' must be finite, got {raw!r}", param=key)
    return value


def _integer(one: dict[str, Any], key: str) -> int | None:
    raw = one.get(key)
    if raw is None or not str(raw).strip():
        return None
    return form_int(str(raw), key)


# ---- the Triton request -------------------------------------------------------------------------------------


def transcription_generation(audio: bytes, task: str | None, *, language: str | None = None, prompt: str | None = None,
                             temperature: float | None = None, timestamps: bool = False, seed: int | None = None,
                             max_tokens: int | None = None, field_names: dict[str, str] | None = None
                             ) -> GenerationRequest:
    """The walk's input tensors (mstar_common/families/whisper/graph.py); `field_names` gives the client's
    names of the knobs (/generate's `model_kwargs.`) for the 400 of a number its tensor cannot hold."""
    for name, value, np_dtype, minimum in (("temperature", temperature, "float32", None), ("seed", seed, "int64", 0),
                                           ("max_tokens", max_tokens, "int32", 1)):
        if value is not None:
            check_wire_number(value, np_dtype, (field_names or {}).get(name, name), minimum)
    if temperature is not None:  # checked as sent and as the FP32 tensor holds it (1e-46 would decode greedily)
        field = (field_names or {}).get("temperature", "temperature")
        held = float(np.float32(temperature))
        if not 0.0 <= temperature <= MAX_TEMPERATURE:
            raise invalid_request(f"'{field}' must be in [0, {MAX_TEMPERATURE:g}], got {temperature!r}", param=field)
        if held == 0.0 and temperature != 0:
            raise invalid_request(f"'{field}': {temperature!r} is 0 as a 32-bit float (the smallest non-zero is "
                                  "about 1.4e-45); send 0 or a larger value", param=field)

    def text(value: str) -> np.ndarray:
        return np.array([value.encode("utf-8")], dtype=np.object_)

    tensors = [("audio", "BYTES", np.array([audio], dtype=np.object_)), ("timestamps", "BOOL", np.array([timestamps]))]
    if task:  # else the checkpoint's own (the walk fills it as transformers' generate does)
        tensors.append(("task", "BYTES", text(task)))
    if language:
        tensors.append(("language", "BYTES", text(language)))
    if prompt:
        tensors.append(("prompt", "BYTES", text(prompt)))
    if temperature is not None:
        tensors.append(("temperature", "FP32", np.array([temperature], np.float32)))
    if seed is not None:
        tensors.append(("seed", "INT64", np.array([seed], np.int64)))
    if max_tokens is not None:
        tensors.append(("max_tokens", "INT32", np.array([max_tokens], np.int32)))
    return GenerationRequest(tensors=tensors)


# ---- routes -------------------------------------------------------------------------------------------------


@router.post("/v1/audio/transcriptions")
async def create_transcription(request: Request):
    return await _serve(request, "transcribe")


@router.post("/v1/audio/translations")
async def create_translation(request: Request):
    return await _serve(request, "translate")


async def _serve(request: Request, task: str):
    ctx: ServingContext = request.app.state.serving
    form = await read_form(request, task)
    served = ctx.resolve(form.model, kinds=TRANSCRIPTION_KINDS)
    gen = transcription_generation(form.audio, task, language=form.language, prompt=form.prompt,
                                   temperature=form.temperature, timestamps=form.is_timed, seed=form.seed,
                                   max_tokens=form.max_tokens)
    # the walk names the upload after its tensor, the OpenAI routes `file`; a task the model cannot do (translation
    # on an English-only checkpoint) is the model's, on a route that has no `task` field
    gen.field_names = {"audio": "file", "task": "model"}
    if form.stream:
        stream = await ctx.stream(request, served, gen)
        return SSEResponse(sse_body(_openai_events(stream), ctx.settings.request_timeout_s))
    transcript = await collect(ctx, request, served, gen)
    return format_transcript(transcript, form.response_format, task)


async def collect(ctx: ServingContext, request: Request, served, gen: GenerationRequest) -> Transcript:
    async def run() -> Transcript:
        transcript = Transcript()
        stream = await ctx.stream(request, served, gen)
        try:
            async for response in stream:
                transcript.add(response)
        finally:
            await stream.aclose()
        return transcript

    try:
        return await until_disconnect(request, run())
    except Exception as exc:
        raise ctx.error(exc, gen) from None


async def _openai_events(stream: AsyncIterator[StreamResponse]) -> AsyncIterator[dict[str, Any]]:
    transcript = Transcript()
    try:
        async for response in stream:
            transcript.add(response)
            if response.text:
                yield {"type": "transcript.text.delta", "delta": response.text}
        yield {"type": "transcript.text.done", "text": transcript.text}
    finally:
        await stream.aclose()


# ---- response formats ---------------------------------------------------------------------------------------


def format_transcript(t: Transcript, response_format: str, task: str):
    usage = {"type": "duration", "seconds": math.ceil(t.duration)}
    if response_format == "json":
        return {"text": t.text, "usage": usage}
    if response_format == "text":
        return PlainTextResponse(t.text)
    if response_format == "verbose_json":
        # a translation's language is its output's, always english (OpenAI's TranslationVerbose)
        language = "english" if task == "translate" else CODE_TO_NAME.get(t.language, t.language)
        return {"task": "translate" if task == "translate" else "transcribe",
                "language": language, "duration": round(t.duration, 3),
                "text": t.text, "segments": t.segments, "usage": usage}
    cues = [(s["start"], s["end"], s["text"].strip()) for s in t.segments]
    if response_format == "srt":
        body = "".join(f"{i}\n{_clock(a, ',')} --> {_clock(b, ',')}\n{text}\n\n" for i, (a, b, text) in
                       enumerate(cues, 1))
        return PlainTextResponse(body, media_type="application/x-subrip; charset=utf-8")
    body = "WEBVTT\n\n" + "".join(f"{_clock(a, '.')} --> {_clock(b, '.')}\n{text}\n\n" for a, b, text in cues)
    return PlainTextResponse(body, media_type="text/vtt")


def _clock(seconds: float, decimal: str) -> str:
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{millis:03d}"


# ---- native /generate ---------------------------------------------------------------------------------------

_NATIVE_KWARGS = {"language", "task", "prompt", "temperature", "timestamps", "seed", "max_tokens"}


async def generate_native(request: Request, ctx: ServingContext, served):
    """/generate: `audio` (or `files`) upload, `text` (the prompt), `streaming`, `model_kwargs` (JSON: language,
    task, prompt, temperature, timestamps, seed, max_tokens). Returns `outputs.text` plus language, duration
    and (with timestamps) segments; streamed as {"text"} events, then one with the metadata."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "multipart/form-data":
        raise invalid_request(f"model '{served.name}' transcribes audio: send multipart/form-data with the audio "
                              "in 'audio'", param="audio")
    form = await read_utf8_form(request)
    values = {key: form.getlist(key) for key in dict.fromkeys(form.keys())}
    uploads = [v for key in ("audio", "files") for v in values.pop(key, [])]
    if len(uploads) != 1:
        raise invalid_request(f"'audio': send exactly one audio upload, got {len(uploads)}", param="audio")
    audio = await _upload(uploads, "audio")
    modalities = {key: form_modalities(values.pop(key), key) for key in MODALITY_FIELDS if key in values}
    one = {key: _one(key, vals) for key, vals in values.items()}
    if unknown := sorted(set(one) - {"model", "text", "streaming", "model_kwargs"}):
        raise invalid_request(f"unknown field '{unknown[0]}'", param=unknown[0])
    for key, allowed in (("input_modalities", {"audio", "text"}), ("output_modalities", {"text"})):
        if key in modalities and not set(modalities[key]) <= allowed:
            raise invalid_request(f"'{key}': model '{served.name}' takes {sorted(allowed)}, got {modalities[key]!r}",
                                  param=key)
    kwargs = _native_kwargs(one.get("model_kwargs") or "{}")
    if "prompt" in kwargs and one.get("text"):
        raise invalid_request("give the prompt once: as 'text' or as 'model_kwargs.prompt', not both",
                              param="model_kwargs.prompt")
    prompt = kwargs.get("prompt", one.get("text"))
    gen = transcription_generation(
        audio, kwargs.get("task"), language=kwargs.get("language"), prompt=prompt,
        temperature=kwargs.get("temperature"), timestamps=bool(kwargs.get("timestamps", False)),
        seed=kwargs.get("seed"), max_tokens=kwargs.get("max_tokens"),
        field_names={name: f"model_kwargs.{name}" for name in kwargs},
    )
    gen.field_names = {name: f"model_kwargs.{name}" for name in kwargs}
    if "prompt" not in kwargs:
        gen.field_names["prompt"] = "text"
    if form_bool(one.get("streaming", ""), "streaming"):
        stream = await ctx.stream(request, served, gen)
        return SSEResponse(sse_body(_native_events(stream), ctx.settings.request_timeout_s))
    t = await collect(ctx, request, served, gen)
    body = {"id": request.state.request_id, "model": served.name, "outputs": {"text": [t.text]},
            "finish_reason": t.finish_reason or "stop", "language": t.language, "duration": round(t.duration, 3),
            "usage": {"completion_tokens": t.completion_tokens},
            "segments": t.segments}  # timed with timestamps, else one a window (as the streamed last event has)
    return body


def _native_kwargs(raw: str) -> dict[str, Any]:
    kwargs = parse_json(raw, "'model_kwargs'", param="model_kwargs")
    if not isinstance(kwargs, dict):
        raise invalid_request("'model_kwargs' must be a JSON object", param="model_kwargs")
    if unknown := sorted(set(kwargs) - _NATIVE_KWARGS):
        raise invalid_request(f"unknown field 'model_kwargs.{unknown[0]}'; allowed: {sorted(_NATIVE_KWARGS)}",
                              param=f"model_kwargs.{unknown[0]}")
    types = {"language": str, "task": str, "prompt": str, "temperature": (int, float), "timestamps": bool,
             "seed": int, "max_tokens": int}
    for key, value in kwargs.items():
        if value is not None and (isinstance(value, bool) != (types[key] is bool) or not isinstance(value,
                                                                                                   types[key])):
            raise invalid_request(f"'model_kwargs.{key}' has the wrong type: {value!r}", param=f"model_kwargs.{key}")
    return {k: v for k, v in kwargs.items() if v is not None}


async def _native_events(stream: AsyncIterator[StreamResponse]) -> AsyncIterator[dict[str, Any]]:
    t = Transcript()
    try:
        async for response in stream:
            t.add(response)
            if response.text:
                yield {"text": response.text}
        yield {"finish_reason": t.finish_reason or "stop", "language": t.language, "duration": round(t.duration, 3),
               "segments": t.segments, "usage": {"completion_tokens": t.completion_tokens}}
    finally:
        await stream.aclose()
