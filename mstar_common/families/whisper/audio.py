"""Uploads -> 16 kHz mono float32 PCM, with the caps checked, and long audio cut into windows at quiet moments.

Decoding uses libsndfile (soundfile): WAV, FLAC, OGG/Vorbis, MP3, AIFF and the other formats it reads; no
FFmpeg. A file it cannot read, or one without samples, is the client's fault (ValueError naming the field);
resampling runs here (windowed-sinc, no torchaudio), so a failed resample is a server fault.
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
    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - libsndfile raises several types for unreadable input
        raise ValueError(f"{field}: not a readable audio file (supported: WAV, FLAC, OGG/Vorbis, MP3, AIFF and the "
                         "other formats libsndfile reads)") from None
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
    return to_model_pcm(samples, rate, limits, field)


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
    if not MIN_SAMPLE_RATE <= rate <= 384_000:
        raise ValueError(f"{field}: sample rate {rate} Hz is outside [{MIN_SAMPLE_RATE}, 384000]")


def _check_duration(seconds: float, limits: AudioLimits, field: str) -> None:
    if seconds > limits.max_seconds:
        raise ValueError(f"{field}: the audio is {seconds:.1f} s long; this deployment accepts at most "
                         f"{limits.max_seconds:g} s")


def resample(pcm: np.ndarray, rate: int, target: int, zero_crossings: int = 6, rolloff: float = 0.99) -> np.ndarray:
    """Band-limited (windowed-sinc, Hann window) resampling of mono float32 PCM by the exact ratio target/rate.

    The ratio is reduced to `up/down`; output sample `j` of each phase sums the input under a sinc low-pass
    at `rolloff` times the lower Nyquist, `zero_crossings` lobes each side. Runs as one strided conv1d.
    """
    if rate == target:
        return np.ascontiguousarray(pcm, dtype=np.float32)
    g = math.gcd(rate, target)
    down, up = rate // g, target // g
    cutoff = min(down, up) * rolloff
    width = math.ceil(zero_crossings * down / cutoff)
    taps = torch.arange(-width, width + down, dtype=torch.float64) / down
    phases = -torch.arange(up, dtype=torch.float64)[:, None] / up
    t = ((phases + taps[None, :]) * cutoff).clamp(-zero_crossings, zero_crossings)
    window = torch.cos(t * math.pi / zero_crossings / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / torch.where(t == 0, torch.ones_like(t), t))
    kernels = (sinc * window * (cutoff / down)).to(torch.float32)  # [up, taps]
    x = torch.from_numpy(np.ascontiguousarray(pcm, dtype=np.float32))
    x = F.pad(x[None, None], (width, width + down))
    y = F.conv1d(x, kernels[:, None, :], stride=down)  # [1, up, frames]
    num_out = math.ceil(up * pcm.shape[0] / down)
    return y[0].transpose(0, 1).reshape(-1)[:num_out].numpy().copy()


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
