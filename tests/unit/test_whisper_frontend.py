"""Whisper's front end against transformers' WhisperFeatureExtractor; upload decoding, caps, resampling, windows."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
import soundfile
import torch

from mstar_common.families.whisper import audio
from mstar_common.families.whisper.audio import AudioLimits, decode_upload, resample, split_windows, to_model_pcm
from mstar_common.families.whisper.frontend import FrontEndConfig, LogMelFrontEnd, mel_filters, pad_or_trim

SR = 16_000
LIMITS = AudioLimits(max_seconds=60.0, max_bytes=4 * 1024 * 1024)


def _clips() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    t = np.arange(SR * 30) / SR
    return [
        (0.1 * rng.standard_normal(SR)).astype(np.float32),  # 1 s noise
        (0.5 * np.sin(2 * np.pi * 440 * t[: SR * 7])).astype(np.float32),  # 7 s tone
        (0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 0.3 * t)).astype(np.float32),  # exactly 30 s
        np.zeros(SR * 2, np.float32),  # silence: the floor at max - 8 must match too
    ]


@pytest.mark.parametrize("num_mel_bins", [80, 128])  # tiny ... large-v2, and large-v3
def test_features_match_the_feature_extractor(num_mel_bins):
    from transformers import WhisperFeatureExtractor

    reference = WhisperFeatureExtractor(feature_size=num_mel_bins)
    assert np.abs(reference.mel_filters - mel_filters(num_mel_bins)).max() < 1e-8
    clips = _clips()
    want = reference(clips, sampling_rate=SR, return_tensors="np").input_features
    ours = LogMelFrontEnd(FrontEndConfig(num_mel_bins=num_mel_bins))(torch.stack([pad_or_trim(c) for c in clips]))
    assert ours.shape == want.shape == (len(clips), num_mel_bins, 3000)
    assert np.abs(ours.numpy() - want).max() < 1e-5


def test_front_end_refuses_a_non_standard_preprocessor():
    assert FrontEndConfig.from_hf({"sampling_rate": 16000, "n_fft": 400, "hop_length": 160}, 128).num_mel_bins == 128
    with pytest.raises(ValueError, match="hop_length"):
        FrontEndConfig.from_hf({"hop_length": 320}, 80)
    with pytest.raises(ValueError, match="feature_size"):
        FrontEndConfig.from_hf({"feature_size": 128}, 80)


def _encode(samples: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format=fmt, subtype=subtype)
    return out.getvalue()


def test_uploads_decode_downmix_and_resample():
    t = np.arange(int(44_100 * 1.5)) / 44_100
    tone = 0.4 * np.sin(2 * np.pi * 440 * t)
    stereo = np.stack([tone, tone], axis=1).astype(np.float32)
    for data in (_encode(stereo, 44_100, "FLAC"), _encode(stereo, 44_100, "WAV", "FLOAT")):
        pcm = decode_upload(data, LIMITS)
        assert pcm.dtype == np.float32 and pcm.shape == (int(1.5 * SR),)
        want = 0.4 * np.sin(2 * np.pi * 440 * np.arange(pcm.shape[0]) / SR)
        assert np.abs(pcm[800:-800] - want[800:-800]).max() < 2e-3
    high = 0.5 * np.sin(2 * np.pi * 12_000 * t)  # above the new Nyquist: must not alias into the band
    assert np.abs(resample(high.astype(np.float32), 44_100, SR)[800:-800]).max() < 0.01


@pytest.mark.parametrize("data, rule", [
    (b"", "empty"),
    (b"this is not audio at all" * 10, "not a readable audio file"),
    (_encode(np.zeros((0, 1), np.float32), SR), "no samples"),
    (_encode(np.zeros((SR, 3), np.float32), SR), "3 channels"),
    (_encode(np.zeros(SR * 61, np.int16), SR), "at most 60 s"),
    (b"RIFF" + b"\0" * (5 * 1024 * 1024), "at most 4194304 bytes"),
    (_encode(np.zeros(SR, np.int16), SR)[:2000], "truncated: its WAV header declares more"),
    (_encode(np.full(2000, 1e30, np.float32), SR, "WAV", "FLOAT"), "within \\+-1000"),
])
def test_bad_uploads_are_refused_naming_the_field(data, rule):
    with pytest.raises(ValueError, match=rule) as info:
        decode_upload(data, LIMITS, field="file")
    assert str(info.value).startswith("file:")


@pytest.mark.parametrize("fmt", ["MP3", "AIFF"])
def test_a_cut_off_mp3_or_aiff_is_refused_not_transcribed_in_part(fmt):
    """libsndfile reads a cut AIFF or MP3 silently, as the frames that are there: half a file was transcribed and
    answered 200. The whole file still decodes, as does an MP3 without a length header (its length is an estimate
    from its size)."""
    tone = (0.3 * np.sin(np.arange(SR * 10) / 10)).astype(np.float32)
    data = _encode(tone, SR, fmt)
    assert decode_upload(data, LIMITS).shape == (SR * 10,)
    for kept in (0.5, 0.9):
        with pytest.raises(ValueError, match=r"^file: the audio file is damaged or truncated: its header declares "
                                             r"160000 sample frames and \d+ could be decoded$"):
            decode_upload(data[:int(len(data) * kept)], LIMITS, field="file")
    if fmt == "MP3":  # the same frames without the Xing/Info header: no claim to check
        at = data.find(b"Xing") if b"Xing" in data else data.find(b"Info")
        bare = data[:at] + b"Nope" + data[at + 4:]
        assert audio.declared_frames(bare, soundfile.info(io.BytesIO(bare)).frames) is None


def test_a_streamed_wav_with_an_unknown_length_still_decodes():
    data = bytearray(_encode(np.zeros(SR, np.int16), SR))
    at = data.index(b"data")
    data[at + 4:at + 8] = (0xFFFFFFFF).to_bytes(4, "little")  # a streamed WAV's "unknown" size
    assert decode_upload(bytes(data), LIMITS).shape == (SR,)
    assert decode_upload(_encode(np.full(SR, 0.999, np.float32), SR, "WAV", "FLOAT"), LIMITS).shape == (SR,)


def test_pcm_input_checks():
    with pytest.raises(ValueError, match="NaN"):
        to_model_pcm(np.array([0.0, np.nan], np.float32), SR, LIMITS)
    with pytest.raises(ValueError, match="sample rate"):
        to_model_pcm(np.zeros(100, np.float32), 1000, LIMITS)
    assert to_model_pcm(np.zeros(8000, np.float32), 8000, LIMITS).shape == (16000,)


def test_long_audio_is_cut_at_quiet_moments():
    rng = np.random.default_rng(1)
    pcm = (0.3 * rng.standard_normal(SR * 75)).astype(np.float32)
    pcm[int(SR * 26.0): int(SR * 26.3)] = 0.0  # the only quiet spot in window 1's search range
    windows = split_windows(pcm)
    assert windows[0].start == 0 and windows[-1].end == pcm.shape[0]
    assert all(a.end == b.start for a, b in zip(windows, windows[1:], strict=False))
    assert all(w.duration_s <= 30.0 for w in windows)
    assert 26.0 <= windows[0].end / SR <= 26.3
    assert split_windows(pcm[: SR * 30]) == [windows[0].__class__(0, SR * 30)]


def test_a_wav_whose_recorder_never_filled_in_its_sizes_is_measured():
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(SR) / SR)).astype(np.float32)
    whole = _encode(tone, SR, "WAV", "PCM_16")
    want = decode_upload(whole, LIMITS)
    for zero_riff in (False, True):
        data = bytearray(whole)
        at = data.index(b"data")
        data[at + 4:at + 8] = bytes(4)  # the data chunk's size left at 0
        if zero_riff:
            data[4:8] = bytes(4)
        assert np.array_equal(decode_upload(bytes(data), LIMITS), want)


def test_a_wild_sample_rate_is_named_before_the_length_it_implies():
    data = bytearray(_encode(np.zeros(3 * SR, np.int16), SR))
    data[24:28] = (1).to_bytes(4, "little")  # 1 Hz: 48,000 s of audio by the header
    with pytest.raises(ValueError, match=r"^file: sample rate 1 Hz is outside \[4000, 384000\]$"):
        decode_upload(bytes(data), LIMITS, field="file")


@pytest.mark.parametrize("rate", [4_001, 8_191, 16_001, 383_999])
def test_an_odd_sample_rate_resamples_in_bounded_time_and_memory(rate):
    # Such a rate reduces to a ratio like 16000/16001, whose polyphase table had up x down entries: a 0.1 s WAV at
    # 8,191 Hz took 26 s and 6.5 GB, and one at 383,999 Hz asked for ~49 GB (the walk stub killed for memory).
    t = np.arange(rate // 4) / rate
    data = _encode((0.4 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, "WAV", "FLOAT")
    start = time.monotonic()
    pcm = decode_upload(data, LIMITS)
    assert time.monotonic() - start < 10.0
    want = 0.4 * np.sin(2 * np.pi * 440 * np.arange(pcm.shape[0]) / SR)
    assert pcm.shape == (int(np.ceil(SR * (rate // 4) / rate)),)
    assert np.abs(pcm[400:-400] - want[400:-400]).max() < 2e-3


@pytest.mark.parametrize("rate", [8_000, 11_025, 44_100, 48_000, 384_000])
def test_the_sparse_resampler_matches_the_polyphase_one(rate, monkeypatch):
    x = np.random.default_rng(rate).standard_normal(rate).astype(np.float32)
    want = resample(x, rate, SR)
    monkeypatch.setattr(audio, "MAX_POLYPHASE_TABLE", 0)  # every ratio through the sparse path
    got = resample(x, rate, SR)
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-5


def test_a_prompt_too_long_for_the_decoders_window_is_refused_before_tokenizing():
    from types import SimpleNamespace

    from mstar_common.families.whisper.requests import prompt_ids

    class Tokenizer:
        def get_vocab(self):
            return {"a": 0, "hello": 1}

        def encode(self, *args, **kwargs):
            raise AssertionError("tokenized a prompt that cannot fit")

    tokens = SimpleNamespace(prev=2, eot=3)
    with pytest.raises(ValueError, match=r"^prompt: 4000001 bytes cannot fit 63 tokens \(at most 315 bytes\)"):
        prompt_ids("a" * 4_000_000, Tokenizer(), tokens, 63)


def test_a_walk_request_names_sample_rate_for_its_rules():
    """A direct Triton client's `sample_rate` beside an encoded `audio` file was dropped without a word, and one out
    of range beside `audio_pcm` was reported as `audio_pcm`'s fault."""
    from mstar_common.families.whisper import graph as g
    from mstar_common.families.whisper.requests import _audio

    rate = np.array([8000], np.int32)
    with pytest.raises(ValueError, match=r"^sample_rate: applies only to audio_pcm"):
        _audio({g.AUDIO: np.array([b"RIFF"], object), g.SAMPLE_RATE: rate})
    with pytest.raises(ValueError, match=r"^sample_rate: 100 Hz is outside \[4000, 384000\]$"):
        _audio({g.AUDIO_PCM: np.zeros(10, np.float32), g.SAMPLE_RATE: np.array([100], np.int32)})
    assert _audio({g.AUDIO_PCM: np.zeros(10, np.float32), g.SAMPLE_RATE: rate})[2] == 8000
    assert _audio({g.AUDIO: np.array([b"RIFF"], object)})[0] == b"RIFF"
