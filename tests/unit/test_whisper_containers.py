"""Uploads in the containers libsndfile does not read (MP4/M4A, WebM/Matroska, ADTS AAC), decoded through PyAV
(FFmpeg's libraries): lossless codecs give exactly what the same samples give as PCM, lossy ones the same signal;
the caps, a missing audio track, a cut file and a missing PyAV are refused as the other formats' are."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest

from mstar_common.families.whisper import audio
from mstar_common.families.whisper.audio import AudioLimits, decode_upload, to_model_pcm

av = pytest.importorskip("av")

LIMITS = AudioLimits(max_seconds=60.0, max_bytes=4 * 1024 * 1024)


def _signal(rate: int, seconds: float, channels: int, seed: int = 0) -> np.ndarray:
    """[frames, channels] float32: a chirp under noise, so that a decode can be lined up with it unambiguously."""
    t = np.arange(int(rate * seconds)) / rate
    chirp = 0.3 * np.sin(2 * np.pi * (200 * t + 400 * t * t))
    noise = 0.05 * np.random.default_rng(seed).standard_normal((t.shape[0], channels))
    return (chirp[:, None] * np.linspace(1.0, 0.6, channels)[None, :] + noise).astype(np.float32)


def container_bytes(tmp_path, fmt: str, codec: str, samples: np.ndarray, rate: int, options: dict | None = None,
                    video: bool = False, audio_track: bool = True, video_codec: str = "mpeg4",
                    video_seconds: float | None = None, title: str | None = None) -> bytes:
    """`samples` [frames, channels] written by FFmpeg's own muxer and encoder (a file, as `faststart` rewrites it)."""
    path = tmp_path / f"upload.{fmt}"
    layout = {1: "mono", 2: "stereo", 3: "2.1"}[samples.shape[1]]
    with av.open(str(path), "w", format=fmt, options=options or {}) as out:
        if title is not None:
            out.metadata["title"] = title
        picture = out.add_stream(video_codec, rate=10) if video else None
        sound = out.add_stream(codec, rate=rate, layout=layout) if audio_track else None  # all before the 1st mux
        if video:
            picture.width, picture.height, picture.pix_fmt = 32, 32, "yuv420p"
            seconds = samples.shape[0] / rate if video_seconds is None else video_seconds
            for i in range(int(seconds * 10)):
                frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i * 8 % 256, np.uint8), format="rgb24")
                frame.pts = i
                for packet in picture.encode(frame):
                    out.mux(packet)
            for packet in picture.encode(None):
                out.mux(packet)
        if audio_track:
            step = 960 if codec == "libopus" else 1024
            planar = np.ascontiguousarray(samples.T)
            kind = "s16p" if codec == "alac" else "fltp"  # what each encoder takes
            for start in range(0, samples.shape[0], step):
                block = planar[:, start:start + step]
                if kind == "s16p":
                    block = np.round(block * 32767).astype(np.int16)
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(block), format=kind, layout=layout)
                frame.sample_rate, frame.pts = rate, start
                for packet in sound.encode(frame):
                    out.mux(packet)
            for packet in sound.encode(None):
                out.mux(packet)
    return path.read_bytes()


@pytest.mark.parametrize("fmt, codec, channels", [("ipod", "alac", 1), ("ipod", "alac", 2), ("matroska", "flac", 2),
                                                   ("matroska", "pcm_f32le", 1)])
def test_lossless_codecs_in_containers_decode_to_the_same_pcm(tmp_path, fmt, codec, channels):
    """The same samples, downmixed and resampled, as the PCM path gives them (ALAC holds 16-bit samples)."""
    samples = _signal(44_100, 1.5, channels)
    if codec == "alac":
        samples = np.round(samples * 32767).astype(np.float32) / 32767
    data = container_bytes(tmp_path, fmt, codec, samples, 44_100)
    assert audio.ffmpeg_container(data) is not None
    got = decode_upload(data, LIMITS)
    want = to_model_pcm(samples, 44_100, LIMITS)
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-4


@pytest.mark.parametrize("fmt, codec, options", [
    ("ipod", "aac", None),  # an M4A as FFmpeg writes it: the index (moov) after the samples
    ("mp4", "aac", {"movflags": "faststart"}),  # the index first, as phones and browsers write them
    ("webm", "libopus", None),  # a browser's MediaRecorder upload
    ("adts", "aac", None),  # raw AAC
])
def test_lossy_codecs_in_containers_decode_to_the_same_signal(tmp_path, fmt, codec, options):
    samples = _signal(48_000, 2.0, 2)
    data = container_bytes(tmp_path, fmt, codec, samples, 48_000, options)
    got = decode_upload(data, LIMITS)
    want = to_model_pcm(samples, 48_000, LIMITS)
    assert abs(got.shape[0] - want.shape[0]) <= 0.03 * audio.TARGET_RATE  # encoder priming and padding at most
    # lined up by the lag that fits best (an encoder's delay), the decode is the signal to within the codec's loss
    lags = range(0, 1200)
    score = [np.dot(got[lag:lag + 16_000], want[:16_000]) for lag in lags]
    lag = lags[int(np.argmax(score))]
    a, b = got[lag:lag + 16_000], want[:16_000]
    assert np.dot(a, b) / np.sqrt(np.dot(a, a) * np.dot(b, b)) > 0.95


def test_a_videos_sound_is_decoded_and_a_file_without_sound_refused(tmp_path):
    samples = _signal(48_000, 1.0, 1)
    both = container_bytes(tmp_path, "mp4", "aac", samples, 48_000, video=True)
    assert abs(decode_upload(both, LIMITS).shape[0] - 16_000) <= 500
    silent_film = container_bytes(tmp_path, "mp4", "aac", samples, 48_000, video=True, audio_track=False)
    with pytest.raises(ValueError, match=r"^file: the MP4/M4A file holds no audio track$"):
        decode_upload(silent_film, LIMITS, field="file")


def test_the_caps_are_checked_from_the_header_and_while_decoding(tmp_path):
    samples = _signal(48_000, 3.0, 1)
    short = AudioLimits(max_seconds=2.0, max_bytes=LIMITS.max_bytes)
    m4a = container_bytes(tmp_path, "ipod", "aac", samples, 48_000)
    with pytest.raises(ValueError, match=r"^file: the audio is 3\.0 s long; this deployment accepts at most 2 s$"):
        decode_upload(m4a, short, field="file")
    # a recorder's WebM says no duration: it is measured, and decoding stops at the cap
    live = container_bytes(tmp_path, "webm", "libopus", samples, 48_000, {"live": "1"})
    assert av.open(io.BytesIO(live)).duration is None
    assert abs(decode_upload(live, LIMITS).shape[0] - 48_000) <= 500
    with pytest.raises(ValueError, match=r"^file: the audio is longer than 2 s \(decoding stopped at 2\.\d\d s\)"):
        decode_upload(live, short, field="file")
    three = container_bytes(tmp_path, "matroska", "flac", _signal(48_000, 0.5, 3), 48_000)
    with pytest.raises(ValueError, match=r"^file: 3 channels; at most 2"):
        decode_upload(three, LIMITS, field="file")


@pytest.mark.parametrize("fmt, codec, options, rule", [
    ("ipod", "aac", None, r"not a readable MP4/M4A file \(damaged, truncated, or its index is missing\)"),
    ("mp4", "aac", {"movflags": "faststart"}, "the MP4/M4A file is damaged or truncated"),
    ("webm", "libopus", None, r"the WebM/Matroska file is damaged or truncated: its header declares 2\.\d+ s and "
                              r"\d\.\d\d s could be decoded"),
    ("matroska", "flac", None, r"the WebM/Matroska file is damaged or truncated: its header declares"),
])
def test_a_cut_off_file_is_refused_not_transcribed_in_part(tmp_path, fmt, codec, options, rule):
    data = container_bytes(tmp_path, fmt, codec, _signal(48_000, 2.0, 1), 48_000, options)
    decode_upload(data, LIMITS)
    for kept in (0.5, 0.9):
        with pytest.raises(ValueError, match="^file: " + rule):
            decode_upload(data[:int(len(data) * kept)], LIMITS, field="file")


def test_only_the_named_containers_reach_ffmpeg(tmp_path):
    """FFmpeg opens an upload with the demuxer its first bytes name, never by probing every format: a playlist
    (HLS, which fetches what it lists) or anything else libsndfile cannot read is not a readable audio file."""
    listing = tmp_path / "secret.wav"
    listing.write_bytes(b"RIFF")
    playlist = f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nfile://{listing}\n#EXT-X-ENDLIST\n".encode()
    for data in (playlist, b"\x00\x00\x00\x20ftypM4A " + b"\x00" * 64, b"\x1a\x45\xdf\xa3" + b"\x00" * 64):
        with pytest.raises(ValueError, match="^file: not a readable"):
            decode_upload(data, LIMITS, field="file")
    assert audio.ffmpeg_container(playlist) is None
    # an MP3 frame header (layer 3) is not taken for ADTS (layer 0)
    assert audio.ffmpeg_container(b"\xff\xfb\x90\x00" + b"\x00" * 64) is None
    assert audio.ffmpeg_container(b"\xff\xf1\x50\x80" + b"\x00" * 64).label == "AAC (ADTS)"


def test_without_pyav_such_an_upload_is_a_server_fault_that_says_what_to_install(tmp_path, monkeypatch):
    data = container_bytes(tmp_path, "ipod", "aac", _signal(48_000, 0.5, 1), 48_000)
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    with pytest.raises(RuntimeError, match="needs PyAV .*pip install av"):
        decode_upload(data, LIMITS)


def test_a_codec_ffmpeg_cannot_decode_is_a_400_not_a_500(tmp_path):
    """PyAV gives such a track no codec context: reading its rate raised AttributeError, a server fault."""
    webm = container_bytes(tmp_path, "webm", "libopus", _signal(48_000, 1.0, 1), 48_000)
    assert b"A_OPUS" in webm
    with pytest.raises(ValueError, match=r"^file: the WebM/Matroska file's audio codec cannot be decoded$"):
        decode_upload(webm.replace(b"A_OPUS", b"A_OPUX"), LIMITS, field="file")


@pytest.mark.parametrize("fmt, codec", [("ipod", "aac"), ("webm", "libopus"), ("matroska", "flac")])
def test_tags_in_another_encoding_do_not_refuse_the_audio(tmp_path, fmt, codec):
    """A Latin-1 title raised UnicodeDecodeError (a ValueError: a 400 naming no field) for a playable file."""
    data = container_bytes(tmp_path, fmt, codec, _signal(48_000, 1.0, 1), 48_000, title="QQQQQQQQ")
    assert data.count(b"QQQQQQQQ") == 1
    latin = data.replace(b"QQQQQQQQ", b"\xe9t\xe9 \xff\xfeQQ")
    assert abs(decode_upload(latin, LIMITS).shape[0] - 16_000) <= 500


def test_a_webm_video_with_shorter_sound_is_its_sound(tmp_path):
    """The segment's duration is the longest track's: 10 s of video over 2 s of sound was refused as a cut file,
    and a long video with short sound as too long."""
    webm = container_bytes(tmp_path, "webm", "libopus", _signal(48_000, 2.0, 1), 48_000, video=True,
                           video_codec="libvpx", video_seconds=10.0)
    assert av.open(io.BytesIO(webm)).duration / 1e6 > 9
    assert abs(decode_upload(webm, LIMITS).shape[0] - 32_000) <= 500
    assert abs(decode_upload(webm, AudioLimits(5.0, LIMITS.max_bytes)).shape[0] - 32_000) <= 500
    # a cut one is still caught, by the audio track's own DURATION tag
    with pytest.raises(ValueError, match="damaged or truncated"):
        decode_upload(webm[: len(webm) // 4], LIMITS)


def test_adts_after_an_id3_tag_is_aac_and_an_mp3_after_one_is_not(tmp_path):
    adts = container_bytes(tmp_path, "adts", "aac", _signal(48_000, 1.0, 1), 48_000)
    body = b"TIT2" + (9).to_bytes(4, "big") + b"\x00\x00" + b"\x03a title"  # one text frame, 19 bytes
    tag = b"ID3\x04\x00\x00" + bytes([0, 0, 0, len(body)]) + body
    assert audio.ffmpeg_container(tag + adts).label == "AAC (ADTS)"
    assert abs(decode_upload(tag + adts, LIMITS).shape[0] - 16_000) <= 1000
    assert audio.ffmpeg_container(tag + b"\xff\xfb\x90\x00" + b"\x00" * 64) is None


def test_a_stream_that_changes_its_rate_or_channels_mid_way_keeps_its_timing(tmp_path):
    """PyAV's resampler passed every frame through once its first needed nothing: 2 s at 16 kHz then 2 s at 48 kHz
    decoded to 8.2 s (the second half slowed 3x), and mono then stereo failed in numpy."""
    low = container_bytes(tmp_path, "adts", "aac", _signal(16_000, 2.0, 1), 16_000)
    high = container_bytes(tmp_path, "adts", "aac", _signal(48_000, 2.0, 1, seed=1), 48_000)
    stereo = container_bytes(tmp_path, "adts", "aac", _signal(16_000, 2.0, 2, seed=2), 16_000)
    for data in (low + high, high + low, low + stereo):
        assert abs(decode_upload(data, LIMITS).shape[0] / 16_000 - 4.0) < 0.3  # each part: AAC priming, padding


@pytest.mark.parametrize("tag", ["9" * 400 + ":00:00", "nan:00:00", "-1:00:00", "00:00:inf", "an hour"])
def test_a_nonsense_duration_tag_is_no_claim(tag):
    """A tag whose hours overflow a float raised OverflowError (a 500); NaN, negative or infinite ones are no
    claim either, so the track is measured."""
    from types import SimpleNamespace

    assert audio._matroska_track_seconds(SimpleNamespace(metadata={"DURATION": tag})) is None
    assert audio._matroska_track_seconds(SimpleNamespace(metadata={"DURATION": "00:01:02.500000000"})) == 62.5
