"""Speech: POST /v1/audio/speech (OpenAI), GET /v1/audio/voices, and /generate with output_modalities=["audio"].

/v1/audio/speech body: `model`, `input`, `voice`, `response_format` (mp3 (default; wav when `stream`) | wav | pcm |
flac | opus | aac),
`stream` (extra field: audio bytes sent as they are decoded; wav and pcm raw, mp3, aac and opus encoded chunk by
chunk), `stream_format` ("audio" or
"sse": `speech.audio.delta` events with base64 PCM16, then `speech.audio.done`), and the sampling knobs as
extra fields (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens, seed, ignore_eos). `speed`
(0.25-4.0, OpenAI's range) changes the clip's pace, its pitch kept (FFmpeg's atempo, chunk by chunk when
streamed); `instructions` are refused (Orpheus takes emotion tags inline in `input`).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import model_validator

from mstar_common import wire
from mstar_common.families.orpheus.tokens import DEFAULT_VOICE, VOICES
from mstar_common.proxy import protocol
from mstar_common.proxy.errors import from_exception, invalid_request
from mstar_common.proxy.serving_common import ServingContext, until_disconnect
from mstar_common.proxy.sse import SSEResponse, sse_body
from mstar_common.proxy.triton_stream import GenerationRequest, StreamResponse

logger = logging.getLogger(__name__)
router = APIRouter()

MAX_INPUT_CHARS = 4096  # OpenAI's limit; the entry model also caps the input's tokens
FINISH_REASON_HEADER = "X-Finish-Reason"  # a whole clip's finish: "length" when max_tokens cut it short
FORMATS = {  # response_format -> (soundfile format, subtype, media type); pcm is raw PCM16 LE; aac: FFmpeg's
    "wav": ("WAV", "PCM_16", "audio/wav"),
    "flac": ("FLAC", "PCM_16", "audio/flac"),
    "mp3": ("MP3", "MPEG_LAYER_III", "audio/mpeg"),
    "opus": ("OGG", "OPUS", "audio/opus"),
    "aac": ("ADTS", "AAC", "audio/aac"),  # libsndfile writes no AAC: FFmpeg's encoder through PyAV
    "pcm": (None, None, "audio/pcm"),
}
STREAM_FORMATS = ("wav", "pcm", "mp3", "aac", "opus")  # wav and pcm as they come; the others encoded as they come
ENCODED_STREAMS = {  # response_format -> (FFmpeg muxer, encoder, bits a second, muxer options) of a streamed clip
    "mp3": ("mp3", "libmp3lame", 64_000, {}),  # on an unseekable output the muxer writes no Xing header
    "aac": ("adts", "aac", 64_000, {}),
    # a page each 40 ms (its default: 1 s); the muxer writes a page once the next is done, so ~80 ms are held back
    "opus": ("ogg", "libopus", 32_000, {"page_duration": "40000"}),
}
SPEECH_KINDS = ("speech",)


class SpeechRequest(protocol.SamplingFields):
    model: str | None = None
    input: str
    voice: str | None = None
    response_format: str | None = None  # None: mp3 as OpenAI's default, or wav when `stream` asks for audio
    speed: float | None = None
    instructions: str | None = None
    stream_format: Literal["audio", "sse"] = "audio"
    stream: bool = False

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """`null` means unset (protocol.py): a null `stream` or `stream_format` takes its default."""
        return protocol.drop_nulls_of_defaulted(cls, data)


@dataclass(slots=True)
class Speech:
    """A speech stream folded into one result."""

    chunks: list[np.ndarray] = field(default_factory=list)
    sample_rate: int = 24000
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, response: StreamResponse) -> None:
        if response.audio is not None and response.audio.size:
            self.chunks.append(response.audio.astype(np.int16, copy=False))
        if response.sample_rate:
            self.sample_rate = response.sample_rate
        self.token_ids += response.token_ids
        self.finish_reason = response.finish_reason or self.finish_reason
        self.prompt_tokens = response.prompt_tokens or self.prompt_tokens
        self.completion_tokens = response.completion_tokens or self.completion_tokens

    @property
    def finish(self) -> str:
        """How the clip ended: "length" when max_tokens cut it short, else "stop"."""
        return self.finish_reason or "stop"

    @property
    def pcm(self) -> np.ndarray:
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.int16)

    @property
    def usage(self) -> dict[str, int]:
        return protocol.usage(self.prompt_tokens, self.completion_tokens)

    @property
    def speech_usage(self) -> dict[str, int]:
        """Usage in the shape of OpenAI's `speech.audio.done` event (input/output tokens)."""
        return {"input_tokens": self.prompt_tokens, "output_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def encode_audio(pcm: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    container, subtype, _ = FORMATS[fmt]
    if container is None:
        return pcm.astype("<i2").tobytes()
    if container == "ADTS":
        return encode_aac(pcm, sample_rate)
    import soundfile

    if not pcm.size and container in ("FLAC", "MP3", "OGG"):
        # libsndfile writes no file a decoder opens for no frames in these (mp3 and flac: nothing at all): a clip
        # that made no audio (e.g. max_tokens below one codec frame) is one silent sample instead
        pcm = np.zeros(1, np.int16)

    out = io.BytesIO()
    soundfile.write(out, pcm, sample_rate, format=container, subtype=subtype)
    return out.getvalue()


def encode_aac(pcm: np.ndarray, sample_rate: int) -> bytes:
    """Mono PCM16 -> AAC-LC in ADTS frames (what OpenAI's `aac` returns), by FFmpeg's own encoder through PyAV; a
    clip with no audio is one silent sample, as the other compressed formats'. RuntimeError without PyAV."""
    encoder = StreamEncoder("aac", sample_rate)
    return encoder.encode(pcm) + encoder.finish()


SPEED_RANGE = (0.25, 4.0)  # OpenAI's


class Tempo:
    """PCM16 mono at `speed` times its pace with its pitch kept (FFmpeg's atempo filter through PyAV; one stage
    takes 0.5-100, so a speed below 0.5 runs through stages of 0.5 first): `push` returns what each chunk completes,
    `finish` the rest (the filter holds back its window, tens of ms of output). The whole output is
    round(samples given / speed) long: atempo's own end-of-input flush is off by a near-fixed amount (a one-frame
    clip at 1.25 came back at its own length), so `finish` flushes with silence and keeps what the count allows."""

    FLUSH = 4096  # silent samples behind the last ones given, enough to push them through every stage's window

    def __init__(self, speed: float, sample_rate: int) -> None:
        import av
        from av.filter import Graph

        self._av, self.sample_rate, self.speed = av, sample_rate, float(speed)
        self.samples = self.made = 0  # samples handed to the filter (the flush's included); samples returned
        self.given = 0  # samples the caller gave
        self._carry = np.zeros(0, np.int16)  # a last lone sample, held for the next piece (see `push`)
        self.graph = Graph()
        node = self.graph.add_abuffer(format="s16", sample_rate=sample_rate, layout="mono",
                                      time_base=f"1/{sample_rate}")
        stages, rest = [], float(speed)
        while rest < 0.5:
            stages.append(0.5)
            rest /= 0.5
        for stage in [*stages, rest]:
            tempo = self.graph.add("atempo", repr(stage))
            node.link_to(tempo)
            node = tempo
        shape = self.graph.add("aformat", "sample_fmts=s16:channel_layouts=mono")
        node.link_to(shape)
        shape.link_to(self.graph.add("abuffersink"))
        self.graph.configure()

    PIECE = 256  # samples a frame handed to the filter: atempo sizes its output frames from its input ones

    def push(self, pcm: np.ndarray) -> np.ndarray:
        """What `pcm` completes, handed to the filter in small pieces (a whole 2,048-sample chunk came out only
        with the next one: a frame's delay, two below 0.5, before a stream's first audio)."""
        pcm = pcm.astype(np.int16, copy=False)
        self.given += pcm.size
        out = self._feed(pcm)
        self.made += out.size
        return out

    def _feed(self, pcm: np.ndarray) -> np.ndarray:
        pcm = np.concatenate([self._carry, pcm]) if self._carry.size else pcm
        # atempo at 3x and up grows without bound on a one-sample frame (MemoryError): such a sample waits
        lone = 1 if pcm.size % self.PIECE == 1 else 0
        pcm, self._carry = pcm[:pcm.size - lone], pcm[pcm.size - lone:].copy()
        out = []
        for start in range(0, pcm.size, self.PIECE):
            piece = pcm[start:start + self.PIECE]
            frame = self._av.AudioFrame.from_ndarray(piece[None, :], format="s16", layout="mono")
            frame.sample_rate, frame.pts = self.sample_rate, self.samples
            self.samples += piece.size
            self.graph.push(frame)
            out.append(self._pull())
        return np.concatenate(out) if out else np.zeros(0, np.int16)

    def finish(self) -> np.ndarray:
        out = self._feed(np.zeros(self.FLUSH, np.int16))  # a lone sample carried is the last given: fed first
        self.graph.push(None)
        want = round(self.given / self.speed) - self.made  # (the filter never ran ahead of the count before this)
        out = np.concatenate([out, self._pull()])[:max(0, want)]
        self.made += out.size
        return np.concatenate([out, np.zeros(want - out.size, np.int16)]) if want > out.size else out

    def _pull(self) -> np.ndarray:
        out = []
        while True:
            try:
                out.append(self.graph.pull().to_ndarray().reshape(-1))
            except (self._av.BlockingIOError, self._av.EOFError):
                return np.concatenate(out) if out else np.zeros(0, np.int16)


def change_speed(pcm: np.ndarray, sample_rate: int, speed: float) -> np.ndarray:
    """A whole clip at `speed` times its pace (the same clip at 1)."""
    if speed == 1.0 or not pcm.size:
        return pcm
    tempo = Tempo(speed, sample_rate)
    return np.concatenate([tempo.push(pcm), tempo.finish()])


class _Sink:
    """The write-only file a streamed clip's muxer writes to (no seek: a streaming muxer then writes nothing it
    would go back to fix); `take` hands over what it wrote since the last call."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self.parts)
        self.parts.clear()
        return out


class StreamEncoder:
    """A clip encoded as its PCM16 chunks come (mp3, aac in ADTS frames, opus in Ogg: FFmpeg's encoders through
    PyAV): `encode` returns the bytes each chunk completes (mp3 and aac hold back less than one codec frame; Ogg
    one to two 40 ms pages), `finish` the rest. A clip that brought no audio is one silent sample, as a whole
    file's."""

    def __init__(self, fmt: str, sample_rate: int) -> None:
        try:
            import av
        except ImportError:
            raise RuntimeError(f"response_format {fmt!r} needs PyAV (FFmpeg's libraries), which is not installed in "
                               "the proxy's Python: pip install av") from None
        muxer, codec, bit_rate, options = ENCODED_STREAMS[fmt]
        self.sample_rate, self.samples, self._av = sample_rate, 0, av
        self.sink = _Sink()
        self.container = av.open(self.sink, "w", format=muxer, options=options)
        self.stream = self.container.add_stream(codec, rate=sample_rate, layout="mono")
        self.stream.bit_rate = bit_rate

    def encode(self, pcm: np.ndarray) -> bytes:
        if pcm.size:
            frame = self._av.AudioFrame.from_ndarray(pcm.astype(np.int16, copy=False)[None, :], format="s16",
                                                     layout="mono")
            frame.sample_rate, frame.pts = self.sample_rate, self.samples
            self.samples += pcm.size
            for packet in self.stream.encode(frame):
                self.container.mux(packet)
        return self.sink.take()

    def finish(self) -> bytes:
        head = self.encode(np.zeros(1, np.int16)) if not self.samples else b""
        for packet in self.stream.encode(None):
            self.container.mux(packet)
        self.container.close()
        return head + self.sink.take()

    def close(self) -> None:
        """Frees the encoder of a clip that ended early (a client that left, an error)."""
        try:
            self.container.close()
        except Exception:  # noqa: BLE001 - the clip is abandoned; nothing reads what closing would write
            pass


def streaming_wav_header(sample_rate: int) -> bytes:
    """A PCM16 mono WAV header whose sizes say 'unknown' (0xFFFFFFFF), for a body of unknown length."""
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
            sample_rate * 2, 2, 16) + b"data" + struct.pack("<I", unknown))


def _speech_generation(body: SpeechRequest) -> GenerationRequest:
    sent = set(body.model_fields_set)
    if body.response_format is None:  # OpenAI's default, mp3; a stream of audio takes wav (mp3 cannot stream), sse pcm
        body.response_format = "pcm" if body.stream_format == "sse" else "wav" if body.stream else "mp3"
        sent.discard("response_format")
    if not body.input.strip():
        raise invalid_request("'input' must not be empty", param="input")
    if len(body.input) > MAX_INPUT_CHARS:
        raise invalid_request(f"'input' is {len(body.input)} characters; the limit is {MAX_INPUT_CHARS}", param="input")
    if body.response_format not in FORMATS:
        raise invalid_request(f"'response_format' must be one of {list(FORMATS)}, got {body.response_format!r}",
                              param="response_format")
    if body.speed is not None and not SPEED_RANGE[0] <= body.speed <= SPEED_RANGE[1]:
        raise invalid_request(f"'speed' must be between {SPEED_RANGE[0]} and {SPEED_RANGE[1]}, got {body.speed}",
                              param="speed")
    if body.instructions:
        raise invalid_request("'instructions' is not supported: put emotion tags such as <laugh> in 'input'",
                              param="instructions")
    for name in ("stop", "stop_token_ids"):
        if getattr(body, name):
            raise invalid_request(f"'{name}' does not apply to speech", param=name)
    if body.stream and body.stream_format == "audio" and body.response_format not in STREAM_FORMATS:
        raise invalid_request(f"'stream': response_format must be one of {list(STREAM_FORMATS)} to stream, got "
                              f"{body.response_format!r}", param="response_format")
    if body.stream_format == "sse":  # its events carry base64 PCM16: a format or `stream: false` beside it is refused
        if "stream" in sent and body.stream is False:
            raise invalid_request("'stream_format': 'sse' streams; it cannot go with \"stream\": false",
                                  param="stream_format")
        if "response_format" in sent and body.response_format != "pcm":
            raise invalid_request(f"'response_format': stream_format 'sse' sends PCM16 (base64) only: set "
                                  f"response_format to 'pcm', got {body.response_format!r}",
                                  param="response_format")
    gen = body.to_generation(text=body.input, voice=body.voice)
    gen.field_names = {wire.TEXT_INPUT: "input"}
    return gen


@router.post("/v1/audio/speech")
async def create_speech(body: SpeechRequest, request: Request):
    ctx: ServingContext = request.app.state.serving
    served = ctx.resolve(body.model, kinds=SPEECH_KINDS)
    gen = _speech_generation(body)
    speed = float(body.speed or 1.0)
    if body.stream_format == "sse":
        stream = await ctx.stream(request, served, gen)
        return SSEResponse(sse_body(_speech_events(stream, speed), ctx.settings.request_timeout_s))
    if body.stream:
        stream = await ctx.stream(request, served, gen)
        return AudioStreamResponse(_audio_bytes(stream, body.response_format, speed),
                                   FORMATS[body.response_format][2])
    speech = await collect(ctx, request, served, gen)
    # in a thread: an mp3 or opus encode of a long clip takes 0.1-0.7 s, which would stall every other stream here
    data = await asyncio.to_thread(lambda: encode_audio(change_speed(speech.pcm, speech.sample_rate, speed),
                                                        speech.sample_rate, body.response_format))
    return Response(data, media_type=FORMATS[body.response_format][2],
                    headers={FINISH_REASON_HEADER: speech.finish})


@router.api_route("/v1/audio/voices", methods=["GET", "HEAD"])
async def list_voices(request: Request, model: str | None = None):
    ctx: ServingContext = request.app.state.serving
    served = ctx.resolve(model, kinds=SPEECH_KINDS)
    try:
        params = await ctx.triton.model_parameters(served.triton_model)
    except Exception as exc:  # noqa: BLE001
        raise ctx.error(exc) from None
    kwargs = json.loads(params.get("deployment", "{}")).get("model_kwargs", {})
    return {"model": served.name, "voices": list(kwargs.get("voices", VOICES)),
            "default_voice": kwargs.get("default_voice", DEFAULT_VOICE)}


async def collect(ctx: ServingContext, request: Request, served, gen: GenerationRequest) -> Speech:
    async def run() -> Speech:
        speech = Speech()
        stream = await ctx.stream(request, served, gen)
        try:
            async for response in stream:
                speech.add(response)
        finally:
            await stream.aclose()
        return speech

    try:
        return await until_disconnect(request, run())
    except Exception as exc:
        raise ctx.error(exc, gen) from None


class AudioStreamResponse(SSEResponse):
    """Audio bytes as they are decoded; a client that leaves cancels the request at once (as for SSE)."""

    def __init__(self, content: AsyncIterator[bytes], media_type: str):
        self.media_type = media_type
        super().__init__(content)


async def _audio_bytes(stream: AsyncIterator[StreamResponse], fmt: str, speed: float = 1.0) -> AsyncIterator[bytes]:
    is_started, encoder, tempo, rate = False, None, None, 24000

    def out(pcm: np.ndarray) -> bytes:  # PCM of the clip, as the format sends it
        nonlocal encoder
        if not pcm.size:
            return b""
        if fmt in ENCODED_STREAMS:  # encoded here, chunk by chunk (~0.1-0.3 ms a 2,048-sample chunk)
            encoder = encoder or StreamEncoder(fmt, rate)
            return encoder.encode(pcm)
        return pcm.astype("<i2").tobytes()

    try:
        async for response in stream:
            rate = response.sample_rate or rate
            if fmt == "wav" and not is_started:
                yield streaming_wav_header(rate)
            is_started = True
            if response.audio is None or not response.audio.size:
                continue
            pcm = response.audio
            if speed != 1.0:
                tempo = tempo or Tempo(speed, rate)
                pcm = tempo.push(pcm)
            if data := out(pcm):
                yield data
        if tempo is not None and (data := out(tempo.finish())):
            yield data
        if fmt in ENCODED_STREAMS:
            encoder = encoder or StreamEncoder(fmt, rate)
            tail, encoder = encoder.finish(), None
            yield tail
    except Exception as exc:
        # Mid-stream there is no status left to send. Logged (a server fault under an error id), then raised: the
        # connection closes without the body's last chunk, so the client reads an incomplete response instead of
        # a clip that looks whole.
        from_exception(exc)
        raise
    finally:
        if encoder is not None:
            encoder.close()
        await stream.aclose()


async def _speech_events(stream: AsyncIterator[StreamResponse], speed: float = 1.0) -> AsyncIterator[dict[str, Any]]:
    speech, tempo = Speech(), None

    def delta(pcm: np.ndarray) -> dict[str, Any]:
        return {"type": "speech.audio.delta", "audio": base64.b64encode(pcm.astype("<i2").tobytes()).decode()}

    try:
        async for response in stream:
            speech.add(response)
            if response.audio is not None and response.audio.size:
                pcm = response.audio
                if speed != 1.0:
                    tempo = tempo or Tempo(speed, response.sample_rate or 24000)
                    pcm = tempo.push(pcm)
                if pcm.size:
                    yield delta(pcm)
        if tempo is not None and (rest := tempo.finish()).size:
            yield delta(rest)
        # OpenAI's event carries usage alone; finish_reason added: "length" is a clip cut at max_tokens
        yield {"type": "speech.audio.done", "usage": speech.speech_usage,
               "finish_reason": speech.finish}
    finally:
        await stream.aclose()


# native /generate with output_modalities=["audio"]


def generate_generation(req: protocol.GenerateRequest, model: str) -> GenerationRequest:
    if req.output_modalities not in (None, ["audio"]):
        raise invalid_request(f"'output_modalities': model '{model}' produces only ['audio'], got "
                              f"{req.output_modalities}", param="output_modalities")
    if req.input_modalities not in (None, ["text"]):
        raise invalid_request(f"'input_modalities': model '{model}' takes only ['text'], got {req.input_modalities}",
                              param="input_modalities")
    kw = req.model_kwargs
    for name in ("messages", "chat_template_kwargs", "enable_thinking", "stop", "stop_token_ids"):
        if getattr(kw, name):
            raise invalid_request(f"'model_kwargs.{name}' does not apply to speech", param=f"model_kwargs.{name}")
    if not (req.text or "").strip():
        raise invalid_request("'text' is required and must not be empty", param="text")
    if len(req.text) > MAX_INPUT_CHARS:  # before its tokenization: a 16 MB text took 25 s to be refused
        raise invalid_request(f"'text' is {len(req.text)} characters; the limit is {MAX_INPUT_CHARS}", param="text")
    gen = kw.to_generation(text=req.text, voice=kw.voice)
    gen.field_names = {**protocol.GenerateKwargs.field_names(), wire.TEXT_INPUT: "text"}
    return gen


async def generate_speech(request: Request, ctx: ServingContext, served, req: protocol.GenerateRequest):
    gen = generate_generation(req, served.name)
    with_ids = req.model_kwargs.return_token_ids
    if req.streaming:
        stream = await ctx.stream(request, served, gen)
        return SSEResponse(sse_body(_generate_events(stream, with_ids), ctx.settings.request_timeout_s))
    speech = await collect(ctx, request, served, gen)
    wav = await asyncio.to_thread(encode_audio, speech.pcm, speech.sample_rate, "wav")
    audio = {"format": "wav", "sample_rate": speech.sample_rate, "data": base64.b64encode(wav).decode()}
    body = {"id": request.state.request_id, "model": served.name, "outputs": {"audio": [audio]},
            "finish_reason": speech.finish, "usage": speech.usage}
    if with_ids:
        body["token_ids"] = speech.token_ids
    return body


async def _generate_events(stream: AsyncIterator[StreamResponse], with_ids: bool):
    """{"audio": base64 PCM16, "sample_rate"[, "token_ids"]} per chunk -> {"finish_reason", "usage"}."""
    speech = Speech()
    unsent: list[int] = []  # ids of responses that carried no audio, sent with the next event that does (or last)
    try:
        async for response in stream:
            speech.add(response)
            if with_ids and response.token_ids:
                unsent += list(response.token_ids)
            if response.audio is not None and response.audio.size:
                event: dict[str, Any] = {"audio": base64.b64encode(response.audio.astype("<i2").tobytes()).decode(),
                                         "sample_rate": speech.sample_rate}
                if with_ids:
                    event["token_ids"], unsent = unsent, []
                yield event
        last: dict[str, Any] = {"finish_reason": speech.finish, "usage": speech.usage}
        if with_ids and unsent:
            last["token_ids"] = unsent
        yield last
    finally:
        await stream.aclose()
