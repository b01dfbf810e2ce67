"""Completions, native /generate, info routes, error mapping, body cap, request ids and disconnects."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from fastapi.testclient import TestClient

from mstar_common import wire
from mstar_common.proxy.app import ServedModel
from mstar_common.proxy.triton_stream import (
    StreamResponse,
    TritonInvalidRequest,
    TritonServerError,
    TritonTimeout,
    TritonUnavailable,
)
from tests.unit.proxy_fake_triton import HANG, FakeTriton, make_app, text_script
from tests.unit.test_proxy_chat import MESSAGES, sse_events


@pytest.fixture
def anyio_backend():
    return "asyncio"


def client_for(fake: FakeTriton | None = None, **settings) -> tuple[TestClient, FakeTriton]:
    app, fake = make_app(fake, **settings)
    return TestClient(app), fake


# /v1/completions


def test_completions_non_stream_and_stream():
    client, fake = client_for()
    r = client.post("/v1/completions", json={"model": "qwen3", "prompt": "Once", "max_tokens": 3, "seed": 1})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "Hello, world" and body["usage"]["completion_tokens"] == 3
    assert fake.requests[-1].tensors[wire.TEXT_INPUT][2][0] == b"Once"
    assert wire.MESSAGES not in fake.requests[-1].tensors

    r = client.post("/v1/completions", json={"model": "qwen3", "prompt": ["Once"], "stream": True,
                                             "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "Hello, world"
    assert events[-3]["choices"][0]["finish_reason"] == "stop" and events[-2]["usage"]["total_tokens"] == 8
    assert all("usage" in e and e["usage"] is None for e in events[:-2])  # OpenAI: null on the other chunks


def test_completions_send_a_token_id_prompt_as_input_ids():
    client, fake = client_for()
    for prompt in ([5, 6, 7], [[5, 6, 7]]):
        r = client.post("/v1/completions", json={"model": "qwen3", "prompt": prompt, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello, world"
        sent = fake.requests[-1].tensors
        assert sent[wire.INPUT_IDS][2].tolist() == [5, 6, 7] and wire.TEXT_INPUT not in sent


@pytest.mark.parametrize("body, field", [
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [[1, 2], [3]]}, "prompt"), ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"), ({"prompt": [[]]}, "prompt"), ({"prompt": [1, "a"]}, "prompt"),
    ({"echo": True}, "echo"),
    ({"best_of": 2}, "best_of"), ({"logprobs": 1}, "logprobs"), ({"suffix": "x"}, "suffix"), ({"n": 3}, "n"),
    ({"logit_bias": {"5": 1}}, "logit_bias"), ({"frequency_penalty": 0.2}, "frequency_penalty"),
])
def test_completions_refusals(body, field):
    client, fake = client_for()
    r = client.post("/v1/completions", json={"model": "qwen3", "prompt": "x", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert fake.requests == []


# /generate


def test_generate_json_non_stream_with_token_ids():
    client, fake = client_for()
    r = client.post("/generate", json={"text": "Hi", "model_kwargs": {"max_tokens": 4, "return_token_ids": True,
                                                                     "enable_thinking": False}})
    body = r.json()
    assert r.status_code == 200, r.text
    assert body["outputs"] == {"text": ["Hello, world"]} and body["model"] == "qwen3"
    assert body["finish_reason"] == "stop" and body["token_ids"] == [100, 101, 102]
    assert body["usage"]["total_tokens"] == 8 and body["id"] == r.headers["x-request-id"]
    tensors = fake.requests[-1].tensors
    assert json.loads(tensors[wire.MESSAGES][2][0]) == [{"role": "user", "content": "Hi"}]
    assert tensors["max_tokens"][2][0] == 4


def test_generate_multipart_stream():
    client, fake = client_for()
    form = {"text": "Hi", "model": "qwen3", "streaming": "true", "output_modalities": '["text"]',
            "model_kwargs": json.dumps({"temperature": 0.2, "return_token_ids": True, "stop": "x"})}
    r = client.post("/generate", files={key: (None, value) for key, value in form.items()})  # multipart fields
    assert r.status_code == 200, r.text
    assert r.request.headers["content-type"].startswith("multipart/form-data")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert [e["text"] for e in events[:-2]] == ["Hello", ",", " world"]
    assert [e["token_ids"] for e in events[:-2]] == [[100], [101], [102]]
    assert events[-2] == {"finish_reason": "stop", "usage": {"prompt_tokens": 5, "completion_tokens": 3,
                                                             "total_tokens": 8}}
    assert fake.requests[-1].tensors["temperature"][2][0] == pytest.approx(0.2)


def test_generate_multipart_with_messages_and_string_model_kwargs_in_json():
    client, fake = client_for()
    kwargs = json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
    assert client.post("/generate", data={"model_kwargs": kwargs}).status_code == 200
    assert client.post("/generate", json={"model_kwargs": kwargs}).status_code == 200
    assert json.loads(fake.requests[-1].tensors[wire.MESSAGES][2][0])[0] == {"role": "system", "content": "s"}


@pytest.mark.parametrize("body, field", [
    ({"text": "x", "output_modalities": ["audio"]}, "output_modalities"),
    ({"text": "x", "model_kwargs": {"top_k": "3"}}, "model_kwargs.top_k"),
    ({"text": "x", "model_kwargs": {"frob": 1}}, "model_kwargs.frob"),
    ({"text": "x", "model_kwargs": "{not json"}, "model_kwargs"),
    ({"text": "x", "colour": "red"}, "colour"),
    ({"model_kwargs": {}}, "text"),
    ({"text": "x", "model_kwargs": {"messages": MESSAGES}}, "text"),
    ({"text": "x", "model": "nope"}, "model"),
])
def test_generate_refusals(body, field):
    client, fake = client_for()
    r = client.post("/generate", json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == field, r.text
    assert fake.requests == []


def test_generate_multipart_refusals():
    client, _ = client_for()
    r = client.post("/generate", data={"text": "x"}, files={"files": ("a.png", b"\x89PNG", "image/png")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "files"
    r = client.post("/generate", data={"text": "x", "streaming": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "streaming"
    r = client.post("/generate", data={"text": "x", "output_modalities": "text,video"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "output_modalities"
    for field in ("input_modalities", "output_modalities"):  # a bad JSON list named as itself (both said output_)
        error = client.post("/generate", data={"text": "x", field: "[text"}).json()["error"]
        assert error["param"] == field and error["message"].startswith(f"{field} is not valid JSON"), error


def test_generate_model_is_required_when_several_are_served():
    client, fake = client_for(models=[ServedModel("a", "a_llm"), ServedModel("b", "b_llm")])
    assert client.post("/generate", json={"text": "x"}).status_code == 400
    assert client.post("/generate", json={"text": "x", "model": "b"}).status_code == 200
    assert fake.requests[-1].model == "b_llm"


# info routes


def test_models_and_health():
    fake = FakeTriton()
    client, _ = client_for(fake)
    assert client.get("/v1/models").json()["data"][0]["id"] == "qwen3"
    assert client.get("/v1/models/qwen3").json()["object"] == "model"
    assert client.get("/v1/models/nope").status_code == 404
    assert client.get("/health").json() == {"status": "ok"}
    fake.is_server_ready = False
    assert client.get("/health").status_code == 503


def test_the_info_routes_answer_head_and_a_trailing_slash_and_a_405_says_what_is_allowed():
    """HEAD on /health (a probe, `curl -I`) was a 405, a 405 lost Starlette's `Allow` header (RFC 9110 requires it),
    and `/v1/models/` answered "model '' does not exist" where every other route's trailing slash redirects."""
    fake = FakeTriton()
    client, _ = client_for(fake)
    for path in ("/health", "/v1/models", "/v1/models/qwen3", "/v1/audio/voices"):
        head = client.head(path)
        assert head.status_code == client.get(path).status_code and head.content == b"", path
    assert [m["id"] for m in client.get("/v1/models/").json()["data"]] == ["qwen3"]
    refused = client.delete("/v1/models/qwen3")
    assert refused.status_code == 405 and set(refused.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert client.get("/v1/chat/completions").headers["allow"] == "POST"
    fake.is_server_ready = False
    assert client.head("/health").status_code == 503


# error mapping


def test_triton_invalid_request_is_400():
    client, _ = client_for(FakeTriton(script=[TritonInvalidRequest("prompt + max_tokens exceeds the window (4096)")]))
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json={"model": "qwen3", "messages": MESSAGES, "stream": stream})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "prompt + max_tokens exceeds the window (4096)"


@pytest.mark.parametrize("route,body,refusal,message,param", [
    ("/v1/completions", {"prompt": "x"}, "text_input: 9 bytes cannot fit max_model_len=4 tokens",
     "prompt: 9 bytes cannot fit max_model_len=4 tokens", "prompt"),
    ("/v1/completions", {"prompt": "x"}, "max_tokens: 900 plus the prompt's 3 tokens exceeds max_model_len=512",
     "max_tokens: 900 plus the prompt's 3 tokens exceeds max_model_len=512", "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES}, "messages: 600 tokens leave no room for output",
     "messages: 600 tokens leave no room for output", "messages"),
    ("/v1/completions", {"prompt": [1, 2]}, "input_ids: 600 tokens leave no room for output",
     "prompt: 600 tokens leave no room for output", "prompt"),
    ("/v1/chat/completions", {"messages": MESSAGES}, "messages[0].content: must be a string",
     "messages[0].content: must be a string", "messages[0].content"),
    ("/generate", {"text": "x"}, "messages: 600 tokens leave no room for output",
     "text: 600 tokens leave no room for output", "text"),
    ("/generate", {"model_kwargs": {"messages": MESSAGES}}, "messages: this checkpoint has no chat template",
     "model_kwargs.messages: this checkpoint has no chat template", "model_kwargs.messages"),
    ("/generate", {"text": "x"}, "max_tokens: 900 plus the prompt's 3 tokens exceeds max_model_len=512",
     "model_kwargs.max_tokens: 900 plus the prompt's 3 tokens exceeds max_model_len=512", "model_kwargs.max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES}, "prompt + max_tokens exceeds the window (4096)",
     "prompt + max_tokens exceeds the window (4096)", None),
])
def test_an_entry_models_refusal_names_the_clients_field(route, body, refusal, message, param):
    """The entry model names its own input (text_input, prompt, messages); the 400 names the field the client
    sent, as `param` too, streamed or not."""
    for stream in (False, True):
        client, fake = client_for(FakeTriton(script=[TritonInvalidRequest(refusal)]))
        r = client.post(route, json={"model": "qwen3", **body, "stream" if route != "/generate" else "streaming":
                                     stream})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == message and r.json()["error"]["param"] == param
        assert fake.requests[0].gen.field_names  # the renames travel with the request, not over the wire
        assert not any(name in fake.requests[0].tensors for name in ("field_names", "prompt"))


def test_triton_server_error_is_500_with_logged_error_id(caplog):
    client, _ = client_for(FakeTriton(script=[TritonServerError("internal error (error id t1): CUDA OOM at x.py")]))
    with caplog.at_level(logging.ERROR, logger="mstar_common.proxy"):
        r = client.post("/v1/completions", json={"model": "qwen3", "prompt": "x"})
    assert r.status_code == 500
    error = r.json()["error"]
    assert "CUDA" not in error["message"] and error["code"] in error["message"]
    assert any(error["code"] in rec.getMessage() and "CUDA OOM" in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize("stream", [False, True])
def test_a_components_error_id_is_the_one_the_client_gets(caplog, stream):
    """The component logs the cause under its id; the proxy answered with an id of its own, so the id a client
    quoted was in the proxy's log only (docs/metrics.md: the id leads to the component's log line)."""
    script = [StreamResponse(text="partial")] if stream else []  # streamed: failing after the 200
    client, _ = client_for(FakeTriton(script=[*script, TritonServerError("internal error (error id 3fa9c0d2e1b4)")]))
    with caplog.at_level(logging.ERROR, logger="mstar_common.proxy"):
        r = client.post("/v1/completions", json={"model": "qwen3", "prompt": "x", "stream": stream})
    if stream:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        error = events[-1]["error"]
    else:
        assert r.status_code == 500
        error = r.json()["error"]
    assert error["code"] == "3fa9c0d2e1b4" and "error id 3fa9c0d2e1b4" in error["message"]


def test_a_fault_line_names_its_request_streamed_or_not(caplog):
    """Two requests failing together could not be told apart in the proxy's log (found in a QA pass)."""
    script = [StreamResponse(text="partial"), TritonServerError("boom in step loop")]
    client, _ = client_for(FakeTriton(script=script))
    with caplog.at_level(logging.ERROR, logger="mstar_common.proxy"):
        client.post("/v1/chat/completions", json={"model": "qwen3", "messages": MESSAGES, "stream": True},
                    headers={"x-request-id": "req-streamed"})
        client, _ = client_for(FakeTriton(script=[TritonServerError("boom")]))
        client.post("/v1/completions", json={"model": "qwen3", "prompt": "x"}, headers={"x-request-id": "req-whole"})
    lines = [rec.getMessage() for rec in caplog.records if "error id" in rec.getMessage()]
    assert any("[req-streamed] error id" in line for line in lines), lines
    assert any("[req-whole] error id" in line for line in lines), lines


@pytest.mark.parametrize("exc, status", [(TritonTimeout("deadline"), 504), (TritonUnavailable("refused"), 503),
                                         (RuntimeError("bug"), 500)])
def test_other_triton_failures(exc, status):
    client, _ = client_for(FakeTriton(script=[exc]))
    r = client.post("/generate", json={"text": "x"})
    assert r.status_code == status and "error" in r.json()


def test_error_mid_stream_is_an_error_event_then_end():
    script = [StreamResponse(text="partial"), TritonServerError("boom in step loop")]
    client, _ = client_for(FakeTriton(script=script))
    r = client.post("/v1/chat/completions", json={"model": "qwen3", "messages": MESSAGES, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[1]["choices"][0]["delta"]["content"] == "partial"
    assert events[-1]["error"]["type"] == "server_error" and "boom" not in events[-1]["error"]["message"]
    assert "[DONE]" not in events


# body cap and request ids


def test_body_over_the_cap_is_413():
    client, fake = client_for(max_body_bytes=200)
    r = client.post("/v1/completions", json={"model": "qwen3", "prompt": "x" * 500})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"

    def chunked():  # no content-length: the cap is enforced while reading
        yield b'{"model": "qwen3", "prompt": "'
        yield b"x" * 500 + b'"}'

    r = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = client.post("/generate", data={"text": "x" * 500})
    assert r.status_code == 413
    assert fake.requests == []


def test_request_id_is_honoured_sent_to_triton_and_echoed():
    client, fake = client_for()
    r = client.post("/v1/chat/completions", json={"model": "qwen3", "messages": MESSAGES},
                    headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "chatcmpl-abc-123"
    assert fake.requests[-1].request_id == "abc-123"
    r = client.post("/v1/completions", json={"model": "qwen3", "prompt": "x"})
    assert len(r.headers["x-request-id"]) == 32 and fake.requests[-1].request_id == r.headers["x-request-id"]
    r = client.get("/health", headers={"x-request-id": "bad id with spaces"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"


def test_a_refused_request_id_stays_out_of_the_log(caplog):
    """The access line used the client's text as is: a crafted id forged a whole log line (found in a QA pass)."""
    import logging

    client, _ = client_for()
    forged = "x] POST /v1/completions -> 200 in 1.0 ms FAKE ["
    with caplog.at_level(logging.INFO, logger="mstar_common.proxy.app"):
        r = client.post("/v1/completions", json={"model": "qwen3", "prompt": "x"}, headers={"x-request-id": forged})
    assert r.status_code == 400 and r.headers["x-request-id"] == "invalid"
    assert "FAKE" not in caplog.text and "[invalid] POST /v1/completions -> 400" in caplog.text


def test_a_path_with_an_encoded_newline_stays_one_log_line(caplog):
    """The access line carried ASGI's percent-decoded path: a %0A in it wrote a line of the client's (a forged ERROR
    line), a %1b a terminal escape. The line now carries the path as sent, bounded."""
    client, _ = client_for()
    forged = "/v1/x%0A2099-01-01 00:00:00,000 ERROR mstar_common.proxy.errors FORGED%1b[2J" + "y" * 5000
    with caplog.at_level(logging.INFO, logger="mstar_common.proxy.app"):
        assert client.get(forged).status_code == 404
    [line] = [r.getMessage() for r in caplog.records if "-> 404" in r.getMessage()]
    assert "\n" not in line and "\x1b" not in line and "%0A" in line and len(line) < 400, line


def test_an_error_quoting_a_huge_value_is_bounded():
    """A 404 or 400 quoted the client's value whole: a 1 MB model name or unknown key came back in the body (an
    unknown key twice: the message and the param), up to the 16 MB body cap."""
    client, _ = client_for()
    r = client.post("/v1/completions", json={"model": "m" * 1_000_000, "prompt": "x"})
    error = r.json()["error"]
    assert r.status_code == 404 and len(r.content) < 3000
    assert error["message"].startswith("model 'mmm") and "characters]" in error["message"]
    assert error["message"].endswith("served models: ['qwen3']")  # its end, the rule, is kept
    r = client.post("/v1/completions", json={"model": "qwen3", "prompt": "x", "k" * 1_000_000: 1})
    assert r.status_code == 400 and len(r.content) < 3000 and len(r.json()["error"]["param"]) <= 200


def test_clipped_and_loggable_text():
    assert wire.clipped("short") == "short" and wire.clipped("x" * 2000) == "x" * 2000
    long = "a" * 1500 + "b" * 1500
    cut = wire.clipped(long)
    assert len(cut) <= 2000 and cut.startswith("a" * 900) and cut.endswith("b" * 900) and "1," in cut
    assert wire.loggable("a\nb\x1b[2J\u2028c") == "a\\nb\\x1b[2J\\u2028c"
    assert wire.loggable("héllo 中文") == "héllo 中文" and len(wire.loggable("x" * 10**6)) <= 500
    assert len(wire.loggable("\x00" * 1000, 128)) <= 128 and len(wire.loggable("\u2028" * 10**6)) <= 500
    assert "999,540 characters" in wire.loggable("x" * 10**6) and "999,540 characters" in wire.loggable("\n" * 10**6)


# client disconnects, driven at the ASGI level so the disconnect lands at a known point


def asgi_scope(path: str, request_id: str) -> dict:
    """An HTTP POST's ASGI scope, JSON body, with this request id."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
            "headers": [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode())]}


def body_then_stay(body: dict):
    """An ASGI receive: the body, then a client that stays connected (no disconnect ever)."""
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if pending:
            return pending.pop()
        await asyncio.Event().wait()

    return receive


async def drive(app, path: str, body: dict, disconnect_after_body_chunks: int) -> list[dict]:
    """Run one request; the client disconnects after it has seen `disconnect_after_body_chunks` body chunks."""
    sent: list[dict] = []
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    gone = asyncio.Event()

    async def receive():
        if pending:
            return pending.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        num_chunks = sum(1 for m in sent if m["type"] == "http.response.body" and m.get("body"))
        if num_chunks >= disconnect_after_body_chunks:
            gone.set()

    if disconnect_after_body_chunks == 0:
        gone.set()
    await asyncio.wait_for(app(asgi_scope(path, "gone-1"), receive, send), 5)
    return sent


@pytest.mark.anyio
async def test_disconnect_mid_stream_cancels_the_triton_request():
    fake = FakeTriton(script=[StreamResponse(text="tok"), HANG])
    app, _ = make_app(fake)
    body = {"model": "qwen3", "messages": MESSAGES, "stream": True}
    sent = await drive(app, "/v1/chat/completions", body, disconnect_after_body_chunks=2)  # role chunk + "tok"
    assert b"tok" in b"".join(m.get("body", b"") for m in sent)
    assert fake.cancelled == ["gone-1"]


@pytest.mark.anyio
async def test_disconnect_before_first_token_and_in_non_stream_cancels():
    for stream, path, body in [(True, "/generate", {"text": "x", "streaming": True}),
                               (False, "/v1/completions", {"model": "qwen3", "prompt": "x"})]:
        fake = FakeTriton(script=[HANG], started=asyncio.Event())
        app, _ = make_app(fake)
        await drive(app, path, body, disconnect_after_body_chunks=0)
        assert fake.cancelled == ["gone-1"], (stream, path)


@pytest.mark.anyio
async def test_a_client_that_stops_reading_has_its_stream_ended_and_its_request_cancelled(monkeypatch, caplog):
    """A client that keeps its connection open but reads nothing (its TCP window full: uvicorn's write waits in
    drain() without a limit) never disconnects: its stream, and the Triton request beneath it, lived until it did."""
    from mstar_common.proxy import sse

    monkeypatch.setattr(sse, "SEND_STALL_S", 0.3)
    monkeypatch.setattr(sse, "STALL_CHECK_S", 0.05)
    fake = FakeTriton(script=[StreamResponse(text="tok")] * 3 + [HANG])
    app, _ = make_app(fake)
    sent: list[dict] = []

    async def send(message):
        sent.append(message)
        if sum(1 for m in sent if m["type"] == "http.response.body") >= 2:
            await asyncio.Event().wait()  # the client takes nothing more

    receive = body_then_stay({"model": "qwen3", "messages": MESSAGES, "stream": True})
    with caplog.at_level(logging.INFO, logger="mstar_common.proxy.sse"):
        await asyncio.wait_for(app(asgi_scope("/v1/chat/completions", "stalled-1"), receive, send), 5)
    assert fake.cancelled == ["stalled-1"]
    assert any("for the client to read" in r.getMessage() and "stalled-1" in r.getMessage() for r in caplog.records)


def test_fake_script_helper_ends_with_empty_final():
    assert text_script("a")[-1].is_final and text_script("a")[-2].finish_reason == "stop"


def test_a_bug_in_a_route_is_a_scrubbed_500(monkeypatch, caplog):
    from mstar_common.proxy import serving_chat

    def broken(_body):
        raise KeyError("secret internals")

    monkeypatch.setattr(serving_chat, "chat_generation", broken)
    client, _ = client_for()
    with caplog.at_level(logging.ERROR, logger="mstar_common.proxy"):
        r = client.post("/v1/chat/completions", json={"model": "qwen3", "messages": MESSAGES})
    assert r.status_code == 500 and "secret" not in r.text and r.headers["x-request-id"]
    assert any(r.json()["error"]["code"] in rec.getMessage() for rec in caplog.records)


@pytest.mark.anyio
async def test_a_request_the_stopping_server_cancels_before_its_answer_gets_a_503():
    """uvicorn cancels the requests still running when its drain ends; the middleware let the CancelledError through
    and uvicorn answered a request not yet answered with its own text/plain 500 (no error shape, no id, no
    Retry-After), where docs/reliability.md promises a 503."""
    fake = FakeTriton(script=[HANG])
    fake.started = asyncio.Event()
    app, _ = make_app(fake)
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    receive = body_then_stay({"model": "qwen3", "prompt": "hi"})
    task = asyncio.ensure_future(app(asgi_scope("/v1/completions", "stop-1"), receive, send))
    await asyncio.wait_for(fake.started.wait(), 5)
    task.cancel()  # as uvicorn does at the end of its drain
    with pytest.raises(asyncio.CancelledError):
        await task
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = dict(start["headers"])
    assert start["status"] == 503 and headers[b"retry-after"] == b"1" and headers[b"x-request-id"] == b"stop-1"
    body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    assert body["error"]["message"].startswith("the server stopped before this request finished")
    assert fake.cancelled == ["stop-1"]
