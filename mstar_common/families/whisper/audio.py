"""Uploads -> 16 kHz mono float32 PCM, with the caps checked, and long audio cut into windows at quiet moments.

Decoding uses libsndfile (soundfile) for WAV, FLAC, OGG/Vorbis/Opus, MP3, AIFF and the other formats it reads,
and FFmpeg's libraries (PyAV, `av`) for the containers it does not: MP4/M4A (AAC, ALAC, ...), WebM/Matroska (Opus,
Vorbis, ...) and raw AAC in ADTS frames, each opened with its own demuxer alone (never FFmpeg's probe of every
format, some of which follow references to other files or URLs). A file neither reads, or one without samples, is
the client's fault (ValueError naming the field); a missing PyAV and a failed resample are server faults
(resampling runs here: windowed-sinc, no torchaudio).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import soundfile
import torch
import torch.nn.functional as F

TARGET_RATE = 16_000  # Hz, what Whisper hears
MAX_CHANNELS = 2  # stereo is averaged to mono; more channels are refused
MIN_SAMPLE_RATE = 4_000  # below this an upload is not speech audio Whisper can use
MAX_SAMPLE_RATE = 384_000
MAX_SAMPLE_MAGNITUDE = 1e3  # float samples past this are not audio (full scale is 1.0); their log-mel overflows


@dataclass(frozen=True, slots=True)
class AudioLimits:
    max_seconds: float  # per upload
    max_bytes: int  # encoded upload size


@dataclass(frozen=True, slots=True)
class Window:
    start: int  # first sample (16 kHz)
    end: int  # one past the last sample

    @property
    def offset_s(self) -> float:
        return self.start / TARGET_RATE

    @property
    def duration_s(self) -> float:
        return (self.end - self.start) / TARGET_RATE


def decode_upload(data: bytes, limits: AudioLimits, field: str = "audio") -> np.ndarray:
    """An encoded audio file -> 16 kHz mono float32 PCM; ValueError naming `field` and the rule."""
    if not data:
        raise ValueError(f"{field}: the upload is empty")
    if len(data) > limits.max_bytes:
        raise ValueError(f"{field}: the upload is {len(data)} bytes; this deployment accepts at most "
                         f"{limits.max_bytes} bytes")
    data = wav_with_measured_length(data)
    if (container := ffmpeg_container(data)) is not None:
        return decode_with_ffmpeg(data, container, limits, field)
    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - libsndfile raises several types for unreadable input
        raise ValueError(f"{field}: not a readable audio file (supported: WAV, FLAC, OGG/Vorbis/Opus, MP3, AIFF and "
                         "the other formats libsndfile reads; MP4/M4A, WebM/Matroska and ADTS AAC)") from None
    if info.samplerate > 0:
        _check_rate(info.samplerate, field)  # ahead of the length, which a wild rate would make absurd
    if info.frames > 0 and info.samplerate > 0:  # the header's length, when it has one
        _check_duration(info.frames / info.samplerate, limits, field)
    if wav_data_is_short(data):
        raise ValueError(f"{field}: the audio file is damaged or truncated: its WAV header declares more sample "
                         f"data than the upload holds")
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception:  # noqa: BLE001
        raise ValueError(f"{field}: the audio file is damaged or truncated and could not be decoded") from None
    if (claim := declared_frames(data, info.frames)) is not None and samples.shape[0] < claim[0] - claim[1]:
        declared = claim[0]
        raise ValueError(f"{field}: the audio file is damaged or truncated: its header declares {declared} sample "
                         f"frames and {samples.shape[0]} could be decoded")
    return to_model_pcm(samples, rate, limits, field)


@dataclass(frozen=True, slots=True)
class Container:
    demuxer: str  # the FFmpeg input format that alone may open the upload
    label: str  # how an error names it
    has_duration: bool  # whether a duration in its header is a claim (ADTS's is estimated from the bitrate)


FFMPEG_CONTAINERS = {
    "mp4": Container("mp4", "MP4/M4A", True),  # FFmpeg's mov,mp4,m4a,3gp demuxer
    "matroska": Container("matroska", "WebM/Matroska", True),  # its matroska,webm demuxer
    "aac": Container("aac", "AAC (ADTS)", False),
}
TRUNCATION_SLACK_S = 0.1  # what a decoder may fall short of a declared duration by (priming, pre-skip, padding)


def ffmpeg_container(data: bytes) -> Container | None:
    """The container of an upload that libsndfile does not read, by its first bytes: ISO BMFF (`ftyp` at byte 4:
    MP4, M4A, MOV, 3GP), EBML (WebM, Matroska), or an ADTS frame header (raw AAC: 12 sync bits, layer 0; an MP3
    frame has a layer of 1-3), also after an ID3v2 tag (as HLS audio segments and many .aac files start; an MP3
    after one stays libsndfile's). None for any other upload."""
    if data[4:8] == b"ftyp":
        return FFMPEG_CONTAINERS["mp4"]
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return FFMPEG_CONTAINERS["matroska"]
    head = data[_id3_size(data):]
    if len(head) > 1 and head[0] == 0xFF and head[1] & 0xF6 == 0xF0:
        return FFMPEG_CONTAINERS["aac"]
    return None


def _id3_size(data: bytes) -> int:
    """The bytes of an ID3v2 tag at the upload's start (its 10-byte header, its syncsafe size, a footer where its
    flag says so); 0 where there is none."""
    if len(data) < 10 or data[:3] != b"ID3" or any(b & 0x80 for b in data[6:10]):
        return 0
    size = (data[6] << 21) | (data[7] << 14) | (data[8] << 7) | data[9]
    return 10 + size + (10 if data[5] & 0x10 else 0)


def _matroska_track_seconds(stream) -> float | None:
    """The duration a Matroska/WebM track's `DURATION` tag states (`HH:MM:SS.nnnnnnnnn`, as FFmpeg and most muxers
    write it), or None where it has none or an unreadable one."""
    text = (stream.metadata or {}).get("DURATION") or (stream.metadata or {}).get("duration")
    try:
        hours, minutes, seconds = (float(part) for part in str(text).split(":"))
        total = hours * 3600 + minutes * 60 + seconds
    except (AttributeError, ValueError, OverflowError):
        return None
    return total if math.isfinite(total) and total >= 0 else None  # a tag's nonsense is no claim


def decode_with_ffmpeg(data: bytes, container: Container, limits: AudioLimits, field: str = "audio") -> np.ndarray:
    """An MP4/M4A, WebM/Matroska or ADTS AAC upload -> 16 kHz mono float32 PCM through PyAV, with the caps checked
    from the header before decoding (rate, channels, a declared duration) and the duration again as it decodes,
    which stops at the cap. Only the first audio track is decoded (a video's picture is skipped). A file cut short
    of the duration its header declares is refused, as a cut WAV is; one with no duration (a recorder's WebM) is
    measured. ValueError naming `field` for the upload's faults; RuntimeError when PyAV is not installed."""
    try:
        import av
    except ImportError:
        raise RuntimeError(f"decoding {container.label} uploads needs PyAV (FFmpeg's libraries), which is not "
                           "installed in the server's Python: pip install av") from None
    damaged = f"{field}: the {container.label} file is damaged or truncated and could not be decoded"
    try:  # tags in another encoding than UTF-8 are the file's business, not a reason to refuse its audio
        source = av.open(io.BytesIO(data), mode="r", format=container.demuxer, metadata_errors="replace")
    except av.FFmpegError:
        raise ValueError(f"{field}: not a readable {container.label} file (damaged, truncated, or its index is "
                         "missing)") from None
    with source:
        if not source.streams.audio:
            raise ValueError(f"{field}: the {container.label} file holds no audio track")
        stream = source.streams.audio[0]
        if stream.codec_context is None:  # FFmpeg has no decoder for the track's codec
            raise ValueError(f"{field}: the {container.label} file's audio codec cannot be decoded")
        rate, channels = stream.codec_context.sample_rate, stream.codec_context.channels
        if not rate:
            raise ValueError(damaged)
        _check_rate(rate, field)
        if channels > MAX_CHANNELS:
            raise ValueError(f"{field}: {channels} channels; at most {MAX_CHANNELS} (mono or stereo) are accepted")
        declared = _declared_seconds(source, stream, container)
        if declared is not None:
            _check_duration(declared, limits, field)
        layout = "mono" if channels <= 1 else "stereo"
        resamplers: dict[tuple, av.AudioResampler] = {}  # one per input (rate, layout, format): see below
        cap = math.floor(limits.max_seconds * rate)
        parts, total = [], 0

        def take(frames) -> None:
            nonlocal total
            for out in frames:
                parts.append(out.to_ndarray())
                total += parts[-1].shape[1]

        try:
            for packet in source.demux(stream):
                for frame in packet.decode():
                    # PyAV's resampler passes every frame through unchanged once its first one needed nothing, so
                    # a stream that changes its rate or channels mid-way (concatenated ADTS) needs one per input
                    key = (frame.sample_rate, frame.layout.name, frame.format.name)
                    if key not in resamplers:
                        resamplers[key] = av.AudioResampler(format="fltp", layout=layout, rate=rate)
                    take(resamplers[key].resample(frame))
                    if total > cap:  # stop here: the rest need not be decoded to refuse it
                        raise ValueError(f"{field}: the audio is longer than {limits.max_seconds:g} s (decoding "
                                         f"stopped at {total / rate:.2f} s); this deployment accepts at most "
                                         f"{limits.max_seconds:g} s")
            for resampler in resamplers.values():
                take(resampler.resample(None))
        except av.FFmpegError:
            raise ValueError(damaged) from None
    if total == 0:
        raise ValueError(f"{field}: the audio holds no samples")
    if declared is not None and total / rate < declared - TRUNCATION_SLACK_S:
        raise ValueError(f"{field}: the {container.label} file is damaged or truncated: its header declares "
                         f"{declared:.2f} s and {total / rate:.2f} s could be decoded")
    return to_model_pcm(np.concatenate(parts, axis=1).T, rate, limits, field)


def _declared_seconds(source, stream, container: Container) -> float | None:
    """The audio track's duration as the file states it, where that is a claim: the track's own (MP4's), or a
    Matroska track's `DURATION` tag, or the whole file's where the audio is its only track (a video's may be
    longer than its sound); None for ADTS (an estimate from the bitrate) and a file that states none."""
    if not container.has_duration:
        return None
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if (tagged := _matroska_track_seconds(stream)) is not None:
        return tagged
    if source.duration and len(source.streams) == 1:
        return source.duration / 1e6  # av.time_base: microseconds
    return None


def declared_frames(data: bytes, info_frames: int) -> tuple[int, int] | None:
    """(the sample frames a file's own header says it holds, where that can be trusted; the shortfall its format
    allows), or None where there is no such claim. libsndfile reads a cut AIFF or MP3 silently, as the frames that
    are there:
    - AIFF/AIFC: the COMM chunk's count (libsndfile reports what the data chunk holds instead);
    - MP3 with a Xing, Info or VBRI header: the header's count, which libsndfile reports (without one the count is
      an estimate from the file's size, right for a cut file too); one MPEG frame (1,152 samples) of slack.
    A WAV is checked by `wav_data_is_short`, a FLAC fails to decode, and an OGG cut at a page boundary is a
    shorter valid stream: nothing in it says more was meant."""
    if data[:4] == b"FORM" and data[8:12] in (b"AIFF", b"AIFC"):
        offset = 12
        while offset + 8 <= len(data):
            kind, size = data[offset:offset + 4], int.from_bytes(data[offset + 4:offset + 8], "big")
            if kind == b"COMM" and offset + 14 <= len(data):
                return int.from_bytes(data[offset + 10:offset + 14], "big"), 0
            offset += 8 + size + (size & 1)
        return None
    head = data[:4096]
    is_mp3 = head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0)
    if is_mp3 and info_frames > 0 and any(tag in head for tag in (b"Xing", b"Info", b"VBRI")):
        return info_frames, 1152
    return None


def to_model_pcm(samples: np.ndarray, rate: int, limits: AudioLimits, field: str = "audio") -> np.ndarray:
    """`samples` `[frames]` or `[frames, channels]` at `rate` Hz -> checked 16 kHz mono float32."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim == 1:
        samples = samples[:, None]
    if samples.ndim != 2:
        raise ValueError(f"{field}: expected mono or stereo samples, got an array of shape {samples.shape}")
    if samples.shape[0] == 0:
        raise ValueError(f"{field}: the audio holds no samples")
    if samples.shape[1] > MAX_CHANNELS:
        raise ValueError(f"{field}: {samples.shape[1]} channels; at most {MAX_CHANNELS} (mono or stereo) are accepted")
    _check_rate(rate, field)
    if not np.isfinite(samples).all():
        raise ValueError(f"{field}: the audio holds NaN or infinite samples")
    if (peak := float(np.abs(samples).max())) > MAX_SAMPLE_MAGNITUDE:
        raise ValueError(f"{field}: sample values must be within +-{MAX_SAMPLE_MAGNITUDE:g} (full scale is 1.0), "
                         f"got {peak:.3g}")
    _check_duration(samples.shape[0] / rate, limits, field)
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    return resample(mono, rate, TARGET_RATE)


def wav_data_is_short(data: bytes) -> bool:
    """A RIFF/WAVE upload whose `data` chunk declares more bytes than follow it (libsndfile reads such a file
    silently, as the frames that are there). A size of 0 or 0xFFFFFFFF (a streamed WAV's "unknown") is not a
    claim."""
    found = _wav_data_chunk(data)
    return found is not None and found[1] not in (0, 0xFFFFFFFF) and found[0] + 8 + found[1] > len(data)


def wav_with_measured_length(data: bytes) -> bytes:
    """A RIFF/WAVE upload whose `data` chunk (or RIFF) size is 0, as a recorder leaves it when it never finished
    the header, with the sizes measured from the upload instead (libsndfile would read no frames); any other
    upload as it is."""
    found = _wav_data_chunk(data)
    if found is None or found[1] != 0 or found[0] + 8 == len(data):
        return data
    offset = found[0]
    fixed = bytearray(data)
    fixed[offset + 4:offset + 8] = (len(data) - offset - 8).to_bytes(4, "little")
    if int.from_bytes(data[4:8], "little") == 0:
        fixed[4:8] = (len(data) - 8).to_bytes(4, "little")
    return bytes(fixed)


def _wav_data_chunk(data: bytes) -> tuple[int, int] | None:
    """(offset of its header, declared size) of a RIFF/WAVE upload's `data` chunk; None for other uploads."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    offset = 12
    while offset + 8 <= len(data):
        kind, size = data[offset:offset + 4], int.from_bytes(data[offset + 4:offset + 8], "little")
        if kind == b"data":
            return offset, size
        offset += 8 + size + (size & 1)  # chunks are padded to even sizes
    return None


def _check_rate(rate: int, field: str) -> None:
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise ValueError(f"{field}: sample rate {rate} Hz is outside [{MIN_SAMPLE_RATE}, {MAX_SAMPLE_RATE}]")


def _check_duration(seconds: float, limits: AudioLimits, field: str) -> None:
    if seconds > limits.max_seconds:
        raise ValueError(f"{field}: the audio is {seconds:.1f} s long; this deployment accepts at most "
                         f"{limits.max_seconds:g} s")


def resample(pcm: np.ndarray, rate: int, target: int, zero_crossings: int = 6, rolloff: float = 0.99) -> np.ndarray:
    """Band-limited (windowed-sinc, Hann window) resampling of mono float32 PCM by the exact ratio target/rate.

    The ratio is reduced to `up/down`; output sample `j` sits at input position `j * down / up` and sums the input
    under a sinc low-pass at `rolloff` times the lower Nyquist, `zero_crossings` lobes each side. A ratio with a
    small table (`up` phases of `down + 2 * width` taps: every common rate) runs as one strided conv1d; any other
    (a rate such as 16,001 Hz reduces to 16000/16001, whose table would hold 2.6e8 entries, 4.6e9 at 383,999 Hz)
    sums only each output's own taps, whose weights depend on its phase alone (`_resample_sparse`).
    """
    if rate == target:
        return np.ascontiguousarray(pcm, dtype=np.float32)
    g = math.gcd(rate, target)
    down, up = rate // g, target // g
    cutoff = min(down, up) * rolloff
    width = math.ceil(zero_crossings * down / cutoff)
    if up * (down + 2 * width) > MAX_POLYPHASE_TABLE:
        return _resample_sparse(pcm, down, up, cutoff / down, width, zero_crossings)
    taps = torch.arange(-width, width + down, dtype=torch.float64) / down
    phases = -torch.arange(up, dtype=torch.float64)[:, None] / up
    kernels = _sinc_weights((phases + taps[None, :]) * cutoff, zero_crossings, cutoff / down)  # [up, taps]
    x = torch.from_numpy(np.ascontiguousarray(pcm, dtype=np.float32))
    x = F.pad(x[None, None], (width, width + down))
    y = F.conv1d(x, kernels[:, None, :], stride=down)  # [1, up, frames]
    num_out = math.ceil(up * pcm.shape[0] / down)
    return y[0].transpose(0, 1).reshape(-1)[:num_out].numpy().copy()


MAX_POLYPHASE_TABLE = 1 << 20  # entries of the conv1d path's kernel table; 11,025 Hz, the largest common one: 290k


def _sinc_weights(t: torch.Tensor, zero_crossings: int, gain: float) -> torch.Tensor:
    """Hann-windowed sinc at `t` (in units of the low-pass's period, float64), clamped to the window -> float32."""
    t = t.clamp(-zero_crossings, zero_crossings)
    window = torch.cos(t * math.pi / zero_crossings / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / torch.where(t == 0, torch.ones_like(t), t))
    return (sinc * window * gain).to(torch.float32)


def _resample_sparse(pcm: np.ndarray, down: int, up: int, scale: float, width: int,
                     zero_crossings: int) -> np.ndarray:
    """The same filter as the conv1d path, summed over each output's `2 * width + 2` nearest inputs only: time and
    memory grow with the output's length times the filter's reach, not with `up * down`. Output `p + m * up` (phase
    `p`) reads its taps from input `floor(p * down / up) + m * down` on, so each phase is one strided view of the
    input times that phase's taps. `scale`: the filter's `t` per input sample (cutoff / down)."""
    num_out = math.ceil(up * pcm.shape[0] / down)
    offsets = torch.arange(-width, width + 2, dtype=torch.float64)  # inputs around floor(j * down / up)
    fractions = torch.arange(up, dtype=torch.float64)[:, None] * down % up / up  # each phase's position past it
    table = _sinc_weights((offsets[None, :] - fractions) * scale, zero_crossings, scale)  # [up, taps]
    x = F.pad(torch.from_numpy(np.ascontiguousarray(pcm, dtype=np.float32)), (width + 1, down + width + 2))
    out = torch.empty(num_out, dtype=torch.float32)
    for p in range(min(up, num_out)):
        count = len(range(p, num_out, up))
        rows = x.as_strided((count, table.shape[1]), (down, 1), p * down // up + 1)  # padded index of floor - width
        out[p::up] = rows @ table[p]
    return out.numpy()


def split_windows(pcm: np.ndarray, max_seconds: float = 30.0, search_seconds: float = 8.0,
                  frame_seconds: float = 0.1) -> list[Window]:
    """Cut `pcm` (16 kHz) into windows of at most `max_seconds`, each cut at the quietest `frame_seconds` frame
    (lowest mean energy; the latest on ties) in the last `search_seconds` before the window would overflow."""
    max_len = int(max_seconds * TARGET_RATE)
    if pcm.shape[0] <= max_len:
        return [Window(0, pcm.shape[0])]
    frame = int(frame_seconds * TARGET_RATE)
    search = int(search_seconds * TARGET_RATE)
    windows, start = [], 0
    while pcm.shape[0] - start > max_len:
        lo, hi = start + max_len - search, start + max_len
        energy = np.square(pcm[lo:hi].astype(np.float64))
        num_frames = energy.shape[0] // frame
        per_frame = energy[: num_frames * frame].reshape(num_frames, frame).mean(axis=1)
        quietest = num_frames - 1 - int(np.argmin(per_frame[::-1]))
        cut = lo + quietest * frame + frame // 2
        windows.append(Window(start, cut))
        start = cut
    windows.append(Window(start, pcm.shape[0]))
    return windows
