"""The real `openai` client against the proxy served by uvicorn (fake Triton), plus a real TCP disconnect."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from mstar_common.proxy.triton_stream import StreamResponse
from tests.unit.proxy_fake_triton import HANG, FakeTriton, make_app


@pytest.fixture(scope="module")
def server():
    fake = FakeTriton()
    app, _ = make_app(fake)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", fake
    uv.should_exit = True
    thread.join(5)
    sock.close()


@pytest.fixture
def client(server):
    base, fake = server
    fake.script = FakeTriton().script
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=10), fake


def test_openai_chat_non_stream(client):
    oai, fake = client
    out = oai.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                      temperature=0.0, extra_body={"top_k": 5, "enable_thinking": False})
    assert out.choices[0].message.content == "Hello, world" and out.choices[0].finish_reason == "stop"
    assert out.usage.total_tokens == 8
    assert fake.requests[-1].tensors["top_k"][2][0] == 5


def test_openai_chat_stream_with_usage(client):
    oai, _ = client
    stream = oai.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "Hi"}], stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, world"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == 3


def test_openai_completions_and_models(client):
    oai, _ = client
    assert oai.completions.create(model="qwen3", prompt="Once", max_tokens=3).choices[0].text == "Hello, world"
    text = "".join(c.choices[0].text for c in oai.completions.create(model="qwen3", prompt="Once", stream=True)
                   if c.choices)
    assert text == "Hello, world"
    assert [m.id for m in oai.models.list()] == ["qwen3"]


def test_openai_errors(client):
    oai, _ = client
    with pytest.raises(openai.BadRequestError, match="'n' is not supported"):
        oai.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "Hi"}], n=2)
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])


def test_tcp_disconnect_mid_stream_cancels(server):
    base, fake = server
    fake.script = [StreamResponse(text="tok"), HANG]
    num_cancelled = len(fake.cancelled)
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    with httpx.Client(timeout=5) as http, http.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if "tok" in line:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 5
    while len(fake.cancelled) == num_cancelled:
        assert time.monotonic() < deadline, "the fake Triton never saw the cancellation"
        time.sleep(0.01)
