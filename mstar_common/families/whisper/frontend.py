"""Whisper's log-mel front end in torch (CPU or GPU, batched): 16 kHz PCM -> `[B, n_mels, 3000]` features.

    pcm [B, ≤480000] ─ zero-pad to 30 s ─ STFT (n_fft 400, hop 160, Hann, centred, reflect) ─ |·|² (last frame
    dropped) ─ Slaney mel filters (0-8 kHz) ─ log10(max(·, 1e-10)) ─ floor at each clip's max − 8 ─ (x + 4) / 4

Numerically the same recipe as transformers' `WhisperFeatureExtractor` (its torch path), so features agree
with it to float rounding; the mel filter bank is computed here (float64, then float32). 80 mel bins for
tiny … large-v2, 128 for large-v3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

SAMPLE_RATE = 16_000  # Hz
N_FFT = 400  # 25 ms window
HOP_LENGTH = 160  # 10 ms hop
CHUNK_SECONDS = 30  # the encoder sees exactly 30 s
N_SAMPLES = SAMPLE_RATE * CHUNK_SECONDS  # 480,000
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3,000 mel frames
MEL_MAX_HZ = 8_000.0
LOG_FLOOR = 1e-10
DYNAMIC_RANGE = 8.0  # log10 units kept below each clip's maximum


@dataclass(frozen=True, slots=True)
class FrontEndConfig:
    """The fields of preprocessor_config.json the front end uses (Whisper's defaults)."""

    num_mel_bins: int = 80
    sampling_rate: int = SAMPLE_RATE
    n_fft: int = N_FFT
    hop_length: int = HOP_LENGTH
    chunk_length: int = CHUNK_SECONDS

    @classmethod
    def from_hf(cls, preprocessor: dict, num_mel_bins: int) -> FrontEndConfig:
        config = cls(
            num_mel_bins=num_mel_bins,
            sampling_rate=int(preprocessor.get("sampling_rate", SAMPLE_RATE)),
            n_fft=int(preprocessor.get("n_fft", N_FFT)),
            hop_length=int(preprocessor.get("hop_length", HOP_LENGTH)),
            chunk_length=int(preprocessor.get("chunk_length", CHUNK_SECONDS)),
        )
        expected = cls(num_mel_bins=num_mel_bins)
        if config != expected:
            # Every released Whisper uses these; refusing beats silently computing different features.
            raise ValueError(f"preprocessor_config.json: only Whisper's standard front end is supported "
                             f"({expected}), got {config}")
        if "feature_size" in preprocessor and int(preprocessor["feature_size"]) != num_mel_bins:
            raise ValueError(f"preprocessor_config.json feature_size={preprocessor['feature_size']} disagrees with "
                             f"config.json num_mel_bins={num_mel_bins}")
        return config

    @property
    def num_samples(self) -> int:
        return self.sampling_rate * self.chunk_length


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above (27 mels per log(6.4))."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = 3.0 * hz / 200.0
    log = 15.0 + np.log(np.maximum(hz, 1e-12) / 1000.0) * (27.0 / math.log(6.4))
    return np.where(hz >= 1000.0, log, linear)


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    linear = 200.0 * mel / 3.0
    log = 1000.0 * np.exp((mel - 15.0) * (math.log(6.4) / 27.0))
    return np.where(mel >= 15.0, log, linear)


@lru_cache(maxsize=4)
def mel_filters(num_mel_bins: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Slaney-normalised triangular filters `[n_fft // 2 + 1, num_mel_bins]` over 0 … 8 kHz (float32)."""
    fft_hz = np.linspace(0.0, sample_rate // 2, n_fft // 2 + 1)
    edges_hz = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(MEL_MAX_HZ), num_mel_bins + 2))
    lower, center, upper = edges_hz[:-2], edges_hz[1:-1], edges_hz[2:]
    rising = (fft_hz[:, None] - lower[None, :]) / (center - lower)[None, :]
    falling = (upper[None, :] - fft_hz[:, None]) / (upper - center)[None, :]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (upper - lower))[None, :]  # equal area per filter
    return weights.astype(np.float32)


class LogMelFrontEnd:
    """Batched log-mel features on one device; `pad_or_trim` first when clips are not 30 s."""

    def __init__(self, config: FrontEndConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.window = torch.hann_window(config.n_fft, device=self.device)
        self.filters_t = torch.from_numpy(mel_filters(config.num_mel_bins, config.n_fft, config.sampling_rate).T.copy()
                                          ).to(self.device)  # [n_mels, freq]

    def __call__(self, pcm: torch.Tensor) -> torch.Tensor:
        """`pcm` `[B, num_samples]` float32 (already padded) -> features `[B, n_mels, N_FRAMES]` float32."""
        if pcm.dim() != 2 or pcm.shape[1] != self.config.num_samples:
            raise ValueError(f"expected PCM [B, {self.config.num_samples}], got {tuple(pcm.shape)}")
        pcm = pcm.to(self.device, torch.float32)
        stft = torch.stft(pcm, self.config.n_fft, self.config.hop_length, window=self.window, return_complex=True)
        power = (stft[..., :-1].abs() ** 2).contiguous()  # [B, freq, frames]
        log_mel = torch.clamp(self.filters_t @ power, min=LOG_FLOOR).log10()
        peak = log_mel.amax(dim=(1, 2), keepdim=True)
        log_mel = torch.maximum(log_mel, peak - DYNAMIC_RANGE)
        return (log_mel + 4.0) / 4.0


def pad_or_trim(pcm: np.ndarray | torch.Tensor, num_samples: int = N_SAMPLES) -> torch.Tensor:
    """One clip -> exactly `num_samples` (zero-padded at the end; longer clips are a caller bug)."""
    pcm = torch.as_tensor(np.asarray(pcm, dtype=np.float32) if not isinstance(pcm, torch.Tensor) else pcm)
    pcm = pcm.reshape(-1).to(torch.float32)
    if pcm.numel() > num_samples:
        raise ValueError(f"a window holds at most {num_samples} samples, got {pcm.numel()}")
    return torch.nn.functional.pad(pcm, (0, num_samples - pcm.numel()))
