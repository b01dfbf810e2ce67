"""The speech stream edge: one codec call per drained step carrying every stream's ready windows, audio in
play order, FINAL after the last audio, cancellation drops codec state, a codec fault ends only its streams."""

import numpy as np

from mstar_common import wire
from mstar_common.engine.codec_pump import AudioStream, CodecPump
from mstar_common.engine.types import FinishReason
from mstar_common.families.orpheus.codes import SpeechChunker
from mstar_common.families.orpheus.tokens import CODEBOOK_SIZE, TokenLayout

LAYOUT = TokenLayout(custom_start=1000, vocab_size=1000 + 10 + 7 * 4096, bos=1, eot=2)
S = 4  # samples per played frame in this fake


class FakeCodec:
    def __init__(self, fail=False, message="codec down"):
        self.calls, self.fail, self.message = [], fail, message

    def decode(self, windows):
        self.calls.append(len(windows))
        if self.fail:
            raise RuntimeError(self.message)
        return np.repeat(windows[:, 1, :1].astype(np.float32) / CODEBOOK_SIZE, S, axis=1)  # played frame's code 0


class FakeSink:
    def __init__(self):
        self.chunks, self.final, self.error, self.is_closed, self.cancelled = [], None, None, False, False

    def send_chunk(self, outputs):
        self.chunks.append(outputs)

    def send_final(self, outputs=None):
        self.final, self.is_closed = outputs or {}, True

    def send_error(self, message):
        self.error, self.is_closed = message, True

    def send_server_error(self, exc):  # as Responder: the cause stays in the log, the client gets an error id
        self.error, self.is_closed, self.cause = "internal error (error id id)", True, str(exc)
        return "id"

    def is_cancelled(self):
        return self.cancelled


class FakeEngine:
    def __init__(self):
        self.cancelled = []

    def cancel(self, request_id):
        self.cancelled.append(request_id)


def frame_tokens(code0, n):
    return [LAYOUT.audio_start + p * CODEBOOK_SIZE + (code0 + f if p == 0 else 0) for f in range(n) for p in range(7)]


def make(codec=None):
    engine, codec = FakeEngine(), codec or FakeCodec()
    pump = CodecPump(engine, codec)
    sinks = {rid: FakeSink() for rid in ("a", "b")}
    for rid, sink in sinks.items():
        pump.register(AudioStream(rid, sink, SpeechChunker(LAYOUT), 24000, num_prompt_tokens=5))
    return pump, engine, codec, sinks


def pcm_codes(outputs):
    return (outputs[wire.AUDIO_CHUNK][::S].astype(np.float64) * CODEBOOK_SIZE / 32767).round().astype(int).tolist()


def test_one_codec_call_per_step_carries_every_ready_stream():
    pump, _, codec, sinks = make()
    a, b = frame_tokens(100, 4), frame_tokens(200, 3)
    pump._deliver({"a": (a[:21], None, None), "b": (b[:20], None, None)})  # a: 3 frames -> 1 window; b: none
    assert codec.calls == [1] and len(sinks["a"].chunks) == 1 and not sinks["b"].chunks
    pump._deliver({"a": (a[21:], None, None), "b": (b[20:], None, None)})  # both ready in one step
    assert codec.calls == [1, 2]
    assert pcm_codes(sinks["a"].chunks[1]) == [101] and pcm_codes(sinks["b"].chunks[0]) == [200]
    assert sinks["b"].chunks[0][wire.TOKEN_IDS].tolist() == b  # tokens ride with the next audio


def test_finish_flushes_the_tail_then_sends_final_once():
    pump, _, codec, sinks = make()
    tokens = frame_tokens(10, 3)
    pump._deliver({"a": (tokens, FinishReason.STOP, None)})
    assert codec.calls == [3] and not sinks["a"].chunks
    final = sinks["a"].final
    assert pcm_codes(final) == [10, 11, 12] and final[wire.FINISH_REASON][0] == b"stop"
    assert final[wire.COMPLETION_TOKENS][0] == 21 and pump.num_streams == 1  # "b" still live
    assert len(pump.latency.first_audio) == 1


def test_cancelled_stream_is_dropped_without_decoding():
    pump, engine, codec, sinks = make()
    pump._deliver({"a": (frame_tokens(1, 2), None, None)})
    sinks["a"].cancelled = True
    pump._poll_cancellations()
    assert engine.cancelled == ["a"] and pump.num_streams == 1 and sinks["a"].is_closed
    pump._deliver({"a": ([], FinishReason.CANCELLED, None)})  # the engine's report arrives a step later
    assert codec.calls == []


def test_a_stream_the_engine_ends_at_shutdown_gets_a_retryable_error_not_a_short_clip():
    pump, engine, codec, sinks = make()
    pump._deliver({"a": (frame_tokens(1, 2), None, None)})
    pump._deliver({"a": (frame_tokens(3, 1), FinishReason.CANCELLED, None)})  # shutdown: its client still reads
    assert wire.UNAVAILABLE_PREFIX in sinks["a"].error and sinks["a"].final is None
    assert codec.calls == [] and engine.cancelled == [] and pump.num_streams == 1


def test_codec_fault_ends_its_streams_and_cancels_them_in_the_engine():
    pump, engine, _, sinks = make(FakeCodec(fail=True))
    pump._deliver({"a": (frame_tokens(1, 3), None, None)})
    assert sinks["a"].cause == "codec down" and wire.error_class(sinks["a"].error) is None
    assert engine.cancelled == ["a"] and pump.num_streams == 1


def test_a_codec_that_stopped_ends_its_streams_with_a_retryable_error():
    """The codec component answers what it still holds at its stop with `unavailable: the server stopped ...`; the
    pump sent it on as a server fault (a 500 with an error id) where the docs promise a 503."""
    pump, engine, _, sinks = make(FakeCodec(fail=True, message="orpheus_snac: " + wire.SERVER_STOPPED))
    pump._deliver({"a": (frame_tokens(1, 3), None, None)})
    assert sinks["a"].error == wire.SERVER_STOPPED and engine.cancelled == ["a"]


def _stream_with_first_chunk(frames):
    engine, codec = FakeEngine(), FakeCodec()
    pump, sink = CodecPump(engine, codec), FakeSink()
    pump.register(AudioStream("a", sink, SpeechChunker(LAYOUT), 24000, num_prompt_tokens=5,
                              first_chunk_frames=frames))
    return pump, sink


def test_first_response_waits_for_first_chunk_frames_then_audio_flows_per_frame():
    """first_chunk_frames=2: the first decoded frame is held, the second goes out with it in play order (and
    every token so far), later frames go out one per response as before."""
    pump, sink = _stream_with_first_chunk(2)
    tokens = frame_tokens(100, 5)
    pump._deliver({"a": (tokens[:21], None, None)})  # frame 100 decoded, held
    assert not sink.chunks and not pump.latency.first_audio
    pump._deliver({"a": (tokens[21:28], None, None)})
    assert len(sink.chunks) == 1 and pcm_codes(sink.chunks[0]) == [100, 101]
    assert sink.chunks[0][wire.TOKEN_IDS].tolist() == tokens[:28] and len(pump.latency.first_audio) == 1
    pump._deliver({"a": (tokens[28:35], None, None)})
    assert pcm_codes(sink.chunks[1]) == [102]


def test_a_stream_ending_before_its_first_chunk_fills_sends_what_it_holds():
    pump, sink = _stream_with_first_chunk(8)
    tokens = frame_tokens(100, 3)
    pump._deliver({"a": (tokens, None, None)})
    pump._deliver({"a": ([], FinishReason.STOP, None)})
    assert not sink.chunks and pcm_codes(sink.final) == [100, 101, 102]


def test_auto_first_chunk_holds_more_frames_under_load():
    """first_chunk_frames None ("auto"): the hold is fixed when the stream's first frame is decoded, from the
    streams the pump serves at that moment (1 frame alone; 4 with 128 streams)."""
    from mstar_common.engine.codec_pump import auto_first_chunk_frames

    streams = (1, 39, 40, 80, 128, 192, 240, 256, 10_000)
    assert [auto_first_chunk_frames(n) for n in streams] == [1, 1, 2, 3, 4, 5, 7, 7, 8]
    pump, sink = _stream_with_first_chunk(None)
    tokens = frame_tokens(100, 3)
    pump._deliver({"a": (tokens[:21], None, None)})  # alone: the first frame goes out at once
    assert pcm_codes(sink.chunks[0]) == [100] and pump._streams["a"].first_chunk_frames == 1

    pump, sink = _stream_with_first_chunk(None)
    for i in range(127):  # 128 streams registered when "a" decodes its first frame
        pump.register(AudioStream(f"b{i}", FakeSink(), SpeechChunker(LAYOUT), 24000, num_prompt_tokens=5))
    tokens = frame_tokens(100, 6)
    pump._deliver({"a": (tokens[:21], None, None)})
    pump._deliver({"a": (tokens[21:35], None, None)})
    assert not sink.chunks and pump._streams["a"].first_chunk_frames == 4
    pump._deliver({"a": (tokens[35:42], None, None)})
    assert pcm_codes(sink.chunks[0]) == [100, 101, 102, 103]


def test_auto_hold_grows_while_streams_join_before_the_first_response():
    """An "auto" hold is re-read at every decoded frame until the first response: a stream that decoded its
    first frame among 100 streams (hold 3) holds 6 frames once 200 are served, and never less again."""
    pump, sink = _stream_with_first_chunk(None)
    for i in range(99):
        pump.register(AudioStream(f"b{i}", FakeSink(), SpeechChunker(LAYOUT), 24000, num_prompt_tokens=5))
    tokens = frame_tokens(100, 8)
    pump._deliver({"a": (tokens[:21], None, None)})
    assert pump._streams["a"].first_chunk_frames == 3
    for i in range(99, 199):  # 100 more streams arrive
        pump.register(AudioStream(f"b{i}", FakeSink(), SpeechChunker(LAYOUT), 24000, num_prompt_tokens=5))
    pump._deliver({"a": (tokens[21:35], None, None)})  # 3 frames decoded: no longer enough
    assert not sink.chunks and pump._streams["a"].first_chunk_frames == 6
    for i in range(150):  # most of them leave again: the hold stays
        pump.unregister(f"b{i}")
    pump._deliver({"a": (tokens[35:49], None, None)})
    assert not sink.chunks and pump._streams["a"].first_chunk_frames == 6
    pump._deliver({"a": (tokens[49:56], None, None)})
    assert pcm_codes(sink.chunks[0]) == [100, 101, 102, 103, 104, 105]
