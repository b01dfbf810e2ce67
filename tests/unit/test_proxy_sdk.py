"""MStarClient against the app (in-process transport) with a fake Triton."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from mstar_common import wire
from mstar_common.client import ChatEvent, ChatResult, MStarClient, MStarError
from mstar_common.proxy.triton_stream import StreamResponse, TritonInvalidRequest, TritonServerError
from tests.unit.proxy_fake_triton import FakeTriton, make_app, text_script


def sdk(fake: FakeTriton | None = None) -> tuple[MStarClient, FakeTriton]:
    app, fake = make_app(fake)
    return MStarClient(http_client=TestClient(app)), fake


def test_chat_non_stream():
    client, fake = sdk()
    result = client.chat("What is 2+2?", max_tokens=5, temperature=0, return_token_ids=True)
    assert isinstance(result, ChatResult)
    assert result.text == "Hello, world" and result.finish_reason == "stop"
    assert result.usage["total_tokens"] == 8 and result.token_ids == [100, 101, 102]
    tensors = fake.requests[-1].tensors
    assert json.loads(tensors[wire.MESSAGES][2][0]) == [{"role": "user", "content": "What is 2+2?"}]
    assert tensors["max_tokens"][2][0] == 5


def test_chat_stream_and_messages():
    client, fake = sdk()
    events = list(client.chat([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], stream=True))
    assert all(isinstance(e, ChatEvent) for e in events)
    assert "".join(e.text for e in events) == "Hello, world"
    assert events[-1].finish_reason == "stop" and events[-1].usage["completion_tokens"] == 3
    assert len(json.loads(fake.requests[-1].tensors[wire.MESSAGES][2][0])) == 2


def test_generate_models_health():
    fake = FakeTriton()
    client, _ = sdk(fake)
    assert client.generate("Hi", seed=3).text == "Hello, world"
    assert fake.requests[-1].tensors["seed"][2][0] == 3
    assert client.models() == ["qwen3"]
    assert client.health() is True
    fake.is_server_ready = False
    assert client.health() is False
    assert MStarClient("http://127.0.0.1:1", timeout=1).health() is False


@pytest.mark.parametrize("status,body,healthy", [
    (200, b'{"status": "ok"}', True),
    (200, b"<html>it works</html>", False),  # some other server on the port
    (200, b'["ok"]', False),
    (200, b'{"status": "starting"}', False),
    (503, b'{"status": "unavailable"}', False),
])
def test_health_is_true_only_for_the_proxy_saying_ok(status, body, healthy):
    import httpx

    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
    client = MStarClient(http_client=httpx.Client(transport=transport, base_url="http://proxy"))
    assert client.health() is healthy


def test_errors_raise_mstar_error():
    client, _ = sdk()
    with pytest.raises(MStarError) as info:
        client.chat("x", top_p=0)
    assert info.value.status == 400 and "top_p" in info.value.message
    assert info.value.param == "model_kwargs.top_p"  # the field the server's refusal names (/generate)
    with pytest.raises(MStarError) as info:
        client.chat("x", model="nope")
    assert info.value.status == 404
    client, _ = sdk(FakeTriton(script=[TritonInvalidRequest("prompt too long")]))
    with pytest.raises(MStarError, match="prompt too long"):
        client.chat("x", stream=True)
    client, _ = sdk(FakeTriton(script=[StreamResponse(text="a"), TritonServerError("boom")]))
    stream = client.chat("x", stream=True)
    assert next(stream).text == "a"
    with pytest.raises(MStarError) as info:
        list(stream)
    assert info.value.status == 500 and "error id" in info.value.message


def test_a_stream_dropped_before_it_is_read_closes_its_connection():
    """The request is sent when the stream is made (a refusal raises there), so a stream the caller never iterates
    must still close its connection when dropped: it used to hold it (and the server its request) for good."""
    import gc

    from mstar_common.client import EventStream

    closed = []

    class Response:
        def close(self):
            closed.append(True)

    def events():
        yield ChatEvent(text="x")

    stream = EventStream(Response(), events())
    del stream
    gc.collect()
    assert closed == [True]
    client, _ = sdk()
    with client.chat("Hi", stream=True) as stream:
        first = next(stream)
    assert first.text and isinstance(stream, EventStream)
    with pytest.raises(StopIteration):
        next(stream)  # closed: nothing more


def test_transport_and_encoding_failures_are_sdk_errors():
    from mstar_common.client import MStarConnectionError

    with pytest.raises(MStarConnectionError) as info:
        MStarClient("http://127.0.0.1:1", timeout=1).chat("x")
    assert info.value.status == 0 and "could not reach" in info.value.message
    client, _ = sdk()
    with pytest.raises(MStarError) as info:
        client.chat("x", temperature=float("nan"))
    assert info.value.status == 400 and "cannot be encoded" in info.value.message


def test_a_conversation_given_twice_is_refused_not_dropped():
    client, _ = sdk()
    with pytest.raises(TypeError, match="'messages' is not a knob"):
        client.chat("hi", messages=[{"role": "user", "content": "other"}])


def test_an_empty_model_name_is_refused_not_taken_as_none():
    client, fake = sdk()
    with pytest.raises(ValueError, match="model: must be a non-empty model name"):
        client.chat("hi", model="")
    assert fake.requests == []
    assert client.chat("hi", model="qwen3").text == "Hello, world"


def _sse_client(*chunks: bytes | Exception, status: int = 200) -> MStarClient:
    """A client whose server answers every request with a `status` SSE stream of `chunks`; an exception in `chunks`
    is raised where the stream reaches it, as httpx raises a lost connection or a stalled read."""
    import httpx

    class Body(httpx.SyncByteStream):
        def __iter__(self):
            for chunk in chunks:
                if isinstance(chunk, Exception):
                    raise chunk
                yield chunk

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, headers={"content-type": "text/event-stream"}, stream=Body())

    return MStarClient(http_client=httpx.Client(base_url="http://mstar", transport=httpx.MockTransport(answer)))


@pytest.mark.parametrize("method", ["chat", "transcribe"])
def test_a_stream_that_stalls_or_drops_mid_way_is_an_sdk_error(method):
    """A read past the client's timeout, or a connection lost after the first event, used to escape the stream as
    httpx's own ReadTimeout / ReadError; the docs promise an MStarConnectionError for both."""
    import httpx

    from mstar_common.client import MStarConnectionError

    for failure, words in ((httpx.ReadTimeout("timed out"), "stalled past the client's timeout"),
                           (httpx.ReadError("connection reset by peer"), "lost mid-stream")):
        client = _sse_client(b'data: {"text": "a"}\n\n', failure)
        stream = client.chat("hi", stream=True) if method == "chat" else client.transcribe(b"wav", stream=True)
        assert next(stream).text == "a"
        with pytest.raises(MStarConnectionError) as info:
            next(stream)
        assert info.value.status == 0 and words in info.value.message
    client = _sse_client(b'{"error": ', httpx.ReadError("connection reset by peer"), status=503)
    with pytest.raises(MStarConnectionError, match=r"\[503\] the connection was lost"):
        client.chat("hi", stream=True)


def test_stream_error_events_keep_their_status_and_a_garbled_event_is_an_sdk_error():
    """A 429 sent as a stream's error event used to surface as a 500; an event that is not JSON as a bare
    JSONDecodeError."""
    client = _sse_client(b'data: {"error": {"message": "overloaded", "type": "rate_limit_exceeded", '
                         b'"param": null, "code": "overloaded"}}\n\n')
    with pytest.raises(MStarError) as info:
        list(client.chat("hi", stream=True))
    assert info.value.status == 429 and info.value.message == "overloaded"
    assert (info.value.param, info.value.code) == (None, "overloaded")
    client = _sse_client(b"data: <html>bad gateway</html>\n\n")
    with pytest.raises(MStarError) as info:
        list(client.chat("hi", stream=True))
    assert info.value.status == 502 and "not JSON" in info.value.message


def _open(client: MStarClient, method: str):
    if method == "chat":
        return client.chat("hi", stream=True)
    if method == "transcribe":
        return client.transcribe(b"wav", stream=True)
    return client.tts("hi", stream=True)


@pytest.mark.parametrize("method", ["chat", "transcribe", "tts"])
@pytest.mark.parametrize("event,status,message", [
    (b"5", 502, "not a JSON object"),
    (b'["text"]', 502, "not a JSON object"),
    (b'{"error": "boom"}', 500, "boom"),
    (b'{"error": {"message": "full", "type": ["rate_limit_exceeded"]}}', 500, "full"),
])
def test_a_streamed_event_of_the_wrong_shape_is_an_sdk_error(method, event, status, message):
    """JSON that parses but is not the proxy's event (another server or version on the port) escaped a stream as a
    bare TypeError or AttributeError; a non-streamed answer of the wrong shape was already a 502."""
    with pytest.raises(MStarError) as info:
        list(_open(_sse_client(b"data: " + event + b"\n\ndata: [DONE]\n\n"), method))
    assert info.value.status == status and message in info.value.message


def test_a_speech_chunk_that_is_not_base64_is_an_sdk_error():
    """It escaped as a bare binascii.Error (the non-streamed answer's bad base64 was already a 502)."""
    client = _sse_client(b'data: {"audio": "AAAA", "sample_rate": 24000}\n\n'
                         b'data: {"audio": "not base64!", "sample_rate": 24000}\n\ndata: [DONE]\n\n')
    stream = client.tts("hi", stream=True)
    assert next(stream).pcm == b"\0\0\0"
    with pytest.raises(MStarError) as info:
        next(stream)
    assert info.value.status == 502 and "not in the shape the SDK reads" in info.value.message


def test_multipart_knobs_json_cannot_hold_are_a_400_and_an_empty_edit_is_refused():
    """edit_image and transcribe encode their knobs as a form field: a numpy seed or a NaN raised a bare TypeError or
    ValueError there, where the JSON methods give a 400 MStarError; edit_image([]) sent a form without a file, which
    /generate serves as plain text-to-image."""
    import httpx
    import numpy as np

    sent = []
    client = MStarClient(http_client=httpx.Client(base_url="http://mstar", transport=httpx.MockTransport(
        lambda request: sent.append(request) or httpx.Response(500))))
    for call in (lambda: client.edit_image("x", b"png", seed=np.int64(1)),
                 lambda: client.transcribe(b"wav", seed=np.int64(1)),
                 lambda: client.transcribe(b"wav", temperature=float("nan")),
                 lambda: client.generate_image("x", seed=np.int64(1))):
        with pytest.raises(MStarError) as info:
            call()
        assert info.value.status == 400 and "cannot be encoded" in info.value.message
    for empty in ([], ()):
        with pytest.raises(ValueError, match="image: edit_image takes one to four reference images, got none"):
            client.edit_image("make it red", empty)
    assert sent == []


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85"])
def test_a_streamed_text_with_a_unicode_line_separator_arrives_whole(char):
    """JSON leaves U+2028, U+2029 and U+0085 unescaped and httpx's iter_lines (str.splitlines) ends a line at each:
    the SDK's stream raised 502 "not JSON" on half an event. The proxy now escapes them, and the SDK splits lines the
    SSE way (CRLF, LF, CR) for a server that does not."""
    from mstar_common.proxy.sse import sse_frame

    frame = sse_frame({"text": char})
    assert char.encode() not in frame and json.loads(frame[6:]) == {"text": char}
    client, _ = sdk(FakeTriton(script=text_script("a" + char + "b", "c")))
    assert "".join(e.text for e in client.chat("x", stream=True)) == f"a{char}bc"
    raw = b'data: {"text": "a' + char.encode() + b'b"}\r\n\r\ndata: [DONE]\n\n'
    for chunks in ((raw,), tuple(raw[i:i + 1] for i in range(len(raw)))):  # whole, and a byte a chunk
        assert "".join(e.text for e in _sse_client(*chunks).chat("x", stream=True)) == f"a{char}b"


def test_a_knob_given_as_none_is_left_out_not_sent_as_null():
    """`return_token_ids=None` used to reach the server as null, which it refuses (a 400: not a valid boolean);
    None now means the server's default on every method, as it already did for transcribe()."""
    client, fake = sdk()
    result = client.chat("hi", return_token_ids=None, max_tokens=None, seed=None)
    assert result.text == "Hello, world" and result.token_ids is None
    assert "max_tokens" not in fake.requests[-1].tensors and "seed" not in fake.requests[-1].tensors
    assert client.generate("hi", return_token_ids=None).text == "Hello, world"
    import httpx

    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content)["model_kwargs"])
        if "audio" in request.content.decode():
            wav = "UklGRiQAAABXQVZFZm10IBAAAAABAAEAwF0AAIC7AAACABAAZGF0YQAAAAA="  # 24 kHz PCM16 mono, no frames
            audio = {"format": "wav", "sample_rate": 24000, "data": wav}
            return httpx.Response(200, json={"outputs": {"audio": [audio]}, "finish_reason": "stop"})
        return httpx.Response(200, json={"outputs": {"image": ["iVBORw0KGgo="]}})

    client = MStarClient(http_client=httpx.Client(base_url="http://mstar", transport=httpx.MockTransport(answer)))
    assert client.tts("hi", voice=None, temperature=None, return_token_ids=None).duration_s == 0.0
    assert client.generate_image("a cat", seed=None, num_inference_steps=None, output_format=None)
    assert sent == [{}, {}]


def test_sdk_errors_survive_pickling():
    """MStarError could not be unpickled (its message alone was passed back to a two-argument constructor), so a
    process-pool worker that raised one broke the whole pool (BrokenProcessPool) instead of raising it."""
    import pickle

    from mstar_common.client import MStarConnectionError

    for error in (MStarError(429, "the server is at capacity", 1.0, "model", "overloaded"),
                  MStarConnectionError("could not reach the server")):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and (copy.status, copy.message, str(copy), copy.param, copy.code) == (
            error.status, error.message, str(error), error.param, error.code)


def test_file_arguments_are_bytes_paths_or_binary_files_and_nothing_else(tmp_path):
    """`transcribe` sent `bytes(8)` (eight zero bytes) and a PurePath's text as the audio, and `edit_image` refused a
    bytearray or an open file: both now take bytes-like data, any os.PathLike, or a binary file, and refuse the rest
    naming the argument."""
    from pathlib import PurePosixPath

    from mstar_common.client.types import read_file_input

    path = tmp_path / "a.wav"
    path.write_bytes(b"RIFFdata")
    for value in (b"RIFFdata", bytearray(b"RIFFdata"), memoryview(b"RIFFdata"), str(path), path,
                  PurePosixPath(str(path))):
        assert read_file_input(value, "audio") == b"RIFFdata", value
    with open(path, "rb") as handle:
        assert read_file_input(handle, "audio") == b"RIFFdata"
    with open(path) as handle, pytest.raises(TypeError, match="audio: the file must be opened in binary mode"):
        read_file_input(handle, "audio")
    for value in (8, None, 2.5, ["a"]):
        with pytest.raises(TypeError, match=r"image\[1\]: expected bytes, a file path or a binary file"):
            read_file_input(value, "image[1]")
    client, fake = sdk(FakeTriton(script=[TritonInvalidRequest("stop")]))
    with pytest.raises(TypeError, match="audio: expected bytes"):
        client.transcribe(8)
    assert fake.requests == []  # refused before anything was sent


def test_a_streamed_transcription_ends_with_the_same_metadata_as_the_whole_one():
    """The stream's last event carries `usage` as the non-streamed result does; TranscriptionEvent used to drop it."""
    from mstar_common.proxy.app import ServedModel
    from tests.unit.test_proxy_transcriptions import script

    app, _ = make_app(FakeTriton(script=script()), models=[ServedModel("whisper", "whisper_walk", "transcription")])
    client = MStarClient(http_client=TestClient(app))
    whole = client.transcribe(b"RIFF....")
    events = list(client.transcribe(b"RIFF....", stream=True))
    assert "".join(e.text for e in events) == whole.text == "Hello there. General Kenobi."
    last = events[-1]
    assert (last.finish_reason, last.language, last.duration) == (whole.finish_reason, whole.language, whole.duration)
    assert last.usage == whole.usage == {"completion_tokens": 3}


def test_the_sdks_transcribe_leaves_the_task_to_the_checkpoint_unless_given():
    """It sent task=transcribe by default, so a checkpoint whose generation config translates never did."""
    from mstar_common.proxy.app import ServedModel
    from tests.unit.test_proxy_transcriptions import script

    fake = FakeTriton(script=script())
    app, _ = make_app(fake, models=[ServedModel("whisper", "whisper_walk", "transcription")])
    client = MStarClient(http_client=TestClient(app))
    client.transcribe(b"RIFF....")
    assert "task" not in fake.requests[-1].tensors
    fake.script = script()
    client.transcribe(b"RIFF....", task="translate")
    assert fake.requests[-1].tensors["task"][2][0] == b"translate"


def _speech_app(script: list):
    from mstar_common.proxy.app import ServedModel

    return make_app(FakeTriton(script=script), models=[ServedModel("orpheus", "orpheus_lm", kind="speech")])


def test_streamed_speech_joins_to_the_whole_clip():
    """tts(stream=True) yields each chunk's PCM as /generate streams it; joined, it is the non-streamed clip, and the
    last event ends it as the whole result does."""
    from mstar_common.client import SpeechChunk, SpeechResult
    from tests.unit.test_proxy_speech import speech_script

    app, fake = _speech_app(speech_script())
    client = MStarClient(http_client=TestClient(app))
    whole = client.tts("Hello there", voice="leo", seed=5, return_token_ids=True)
    assert isinstance(whole, SpeechResult)
    chunks = list(client.tts("Hello there", voice="leo", stream=True, seed=5, return_token_ids=True))
    assert all(isinstance(c, SpeechChunk) for c in chunks) and len(chunks) == 3  # two audio chunks, then the end
    assert [len(c.pcm) // 2 for c in chunks] == [4, 6, 0] and all(c.sample_rate == 24000 for c in chunks)
    assert b"".join(c.pcm for c in chunks) == whole.pcm and len(whole.pcm) == 20
    assert [t for c in chunks for t in c.token_ids or []] == whole.token_ids == [1, 2, 3]
    assert (chunks[-1].finish_reason, chunks[-1].usage) == (whole.finish_reason, whole.usage) == (
        "length", {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10})
    sent = [r.tensors for r in fake.requests]
    assert [t["voice"][2][0] for t in sent] == [b"leo", b"leo"] and [t["seed"][2][0] for t in sent] == [5, 5]


def test_streamed_speech_errors_are_sdk_errors():
    from mstar_common.proxy.triton_stream import TritonServerError
    from tests.unit.test_proxy_speech import speech_script

    app, _ = _speech_app(speech_script())
    client = MStarClient(http_client=TestClient(app))
    with pytest.raises(MStarError) as info:
        client.tts(" ", stream=True)  # refused when the stream is made
    assert info.value.status == 400 and "'text'" in info.value.message
    app, _ = _speech_app([speech_script()[0], TritonServerError("codec died")])
    stream = MStarClient(http_client=TestClient(app)).tts("Hi", stream=True)
    assert len(next(stream).pcm) == 8
    with pytest.raises(MStarError) as info:
        next(stream)
    assert info.value.status == 500 and "error id" in info.value.message


def test_breaking_out_of_streamed_speech_closes_it_and_the_server_cancels():
    """Over real HTTP (uvicorn): leaving the stream after its first chunk closes the connection, and the proxy then
    cancels the Triton request that would otherwise go on decoding audio nobody reads."""
    import socket
    import threading
    import time

    import uvicorn

    from tests.unit.proxy_fake_triton import HANG
    from tests.unit.test_proxy_speech import speech_script

    app, fake = _speech_app([speech_script()[0], HANG])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        with MStarClient(f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=10) as client:
            with client.tts("Hi", stream=True) as stream:
                first = next(stream)
            assert len(first.pcm) == 8 and stream._response.is_closed
            with pytest.raises(StopIteration):
                next(stream)
            deadline = time.monotonic() + 5
            while not fake.cancelled:
                assert time.monotonic() < deadline, "the server never cancelled the abandoned speech"
                time.sleep(0.01)
            assert fake.cancelled == [fake.requests[0].request_id]
    finally:
        server.should_exit = True
        thread.join(5)
        sock.close()


def test_an_error_keeps_the_servers_retry_after():
    """A 429 or 503 comes with Retry-After (the proxy's admission.retry_after_s); the SDK dropped it, so a caller
    that backs off had to guess. It is `MStarError.retry_after` (seconds), and survives pickling."""
    import pickle
    from email.utils import format_datetime

    import httpx

    from mstar_common.proxy.triton_stream import TritonOverloaded, TritonUnavailable

    for failure, status in ((TritonOverloaded("queue full"), 429), (TritonUnavailable("draining"), 503)):
        app, _ = make_app(FakeTriton(script=[failure]), retry_after_s=7)
        client = MStarClient(http_client=TestClient(app))
        for stream in (False, True):
            with pytest.raises(MStarError) as info:
                client.chat("x", stream=stream)
            assert info.value.status == status and info.value.retry_after == 7.0
            assert pickle.loads(pickle.dumps(info.value)).retry_after == 7.0
    with pytest.raises(MStarError) as info:
        client.chat("x", top_p=0)
    assert info.value.status == 400 and info.value.retry_after is None
    import datetime

    later = format_datetime(datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=60), usegmt=True)
    for header, want in ((later, (50, 61)), ("soon", None), ("nan", None), ("-3", (0, 0))):
        answer = httpx.Response(503, headers={"retry-after": header}, json={"error": {"message": "busy"}})
        client = MStarClient(http_client=httpx.Client(base_url="http://mstar",
                                                      transport=httpx.MockTransport(lambda _, a=answer: a)))
        with pytest.raises(MStarError) as info:
            client.chat("x")
        got = info.value.retry_after
        assert got is None if want is None else want[0] <= got <= want[1], (header, got)


def test_an_answer_without_what_the_sdk_reads_is_a_502_naming_it():
    """A 200 JSON answer missing a key (another server on the port, an older proxy) raised a bare KeyError from
    inside the method; it is a 502 MStarError that names the key."""
    import httpx

    def client(reply: object) -> MStarClient:
        return MStarClient(http_client=httpx.Client(base_url="http://mstar", transport=httpx.MockTransport(
            lambda _: httpx.Response(200, json=reply))))

    calls = {"chat": lambda c: c.chat("x"), "tts": lambda c: c.tts("x"), "image": lambda c: c.generate_image("x"),
             "transcribe": lambda c: c.transcribe(b"RIFF"), "models": lambda c: c.models()}
    for name, call in calls.items():
        with pytest.raises(MStarError) as info:
            call(client({"id": "r1"}))
        assert info.value.status == 502, name
        assert ("'outputs'" if name != "models" else "'data'") in info.value.message, (name, info.value.message)
    with pytest.raises(MStarError, match="no 'finish_reason'"):
        client({"outputs": {"text": ["a"]}}).chat("x")
    for reply in ({"outputs": {"audio": []}, "finish_reason": "stop"}, [1, 2],
                  {"outputs": {"audio": [{"data": "not base64!", "sample_rate": 24000}]}, "finish_reason": "stop"}):
        with pytest.raises(MStarError) as info:
            client(reply).tts("x")
        assert info.value.status == 502 and "not in the shape the SDK reads" in info.value.message, reply


def test_a_call_on_a_closed_client_is_an_sdk_error():
    """After close() (or its `with` block), a call raised httpx's bare RuntimeError; it is an MStarConnectionError
    that says the client is closed, for every method that sends, streams included."""
    import httpx

    from mstar_common.client import MStarConnectionError

    with MStarClient("http://127.0.0.1:1", timeout=1) as client:
        pass
    for call in (lambda: client.chat("x"), lambda: client.chat("x", stream=True), lambda: client.tts("x", stream=True),
                 client.models, client.health):
        with pytest.raises(MStarConnectionError, match="the client is closed"):
            call()
    http = httpx.Client(base_url="http://mstar",
                        transport=httpx.MockTransport(lambda _: httpx.Response(200, json={"status": "ok"})))
    shared = MStarClient(http_client=http)
    shared.close()  # not its own: the caller's http_client stays open, and so does this client
    assert shared.health() is True
    http.close()
    with pytest.raises(MStarConnectionError, match="the client is closed"):
        shared.chat("x")


def test_timeout_applies_to_a_given_http_client_too():
    """`timeout=` was silently ignored beside `http_client=`; it now applies to every request the SDK sends on it
    (the http_client keeps its own timeout for its other users, and for the SDK when `timeout` is not given)."""
    import httpx

    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions["timeout"]["read"])
        if request.url.path == "/generate" and json.loads(request.content).get("streaming"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  content=b'data: {"text": "a"}\n\ndata: [DONE]\n\n')
        return httpx.Response(200, json={"outputs": {"text": ["a"]}, "finish_reason": "stop", "data": []})

    http = httpx.Client(base_url="http://mstar", timeout=30, transport=httpx.MockTransport(answer))
    client = MStarClient(timeout=5, http_client=http)
    client.chat("x")
    list(client.chat("x", stream=True))
    client.models()
    client.health()
    assert seen == [5, 5, 5, 5] and http.timeout.read == 30
    seen.clear()
    MStarClient(timeout=None, http_client=http).chat("x")
    MStarClient(http_client=http).chat("x")
    assert seen == [None, 30]
    assert MStarClient()._http.timeout.read == 660 and MStarClient(timeout=None)._http.timeout.read is None
    # past the server's default deadline, so that a request the server ends there reaches the caller as its 504
    from mstar_common.config import AdmissionConfig
    from mstar_common.proxy.app import ProxySettings

    assert MStarClient()._http.timeout.read > max(AdmissionConfig().request_timeout_s,
                                                  ProxySettings.__dataclass_fields__["request_timeout_s"].default)


def test_an_httpx2_client_s_transport_errors_are_sdk_errors_too():
    """Starlette's TestClient is an httpx2.Client: an `http_client` of that library raises its own exceptions, which
    are MStarConnectionErrors as httpx's are."""
    httpx2 = pytest.importorskip("httpx2")
    from mstar_common.client import MStarConnectionError

    def refuse(request):
        raise httpx2.ConnectError("connection refused", request=request)

    def stall(request):
        raise httpx2.ReadTimeout("timed out", request=request)

    refused = MStarClient(http_client=httpx2.Client(transport=httpx2.MockTransport(refuse), base_url="http://p"))
    assert refused.health() is False
    with pytest.raises(MStarConnectionError, match="could not reach the server"):
        refused.chat("x")
    stalled = MStarClient(http_client=httpx2.Client(transport=httpx2.MockTransport(stall), base_url="http://p"))
    with pytest.raises(MStarConnectionError, match="no answer within the client's timeout"):
        stalled.chat("x", stream=True)
