"""Overload and limit answers from the proxy: 429/503 with Retry-After, 504 for deadlines, the Triton request
timeout, error classification by wire prefix, and the media URL / upload rules."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from mstar_common import wire
from mstar_common.proxy.errors import APIError
from mstar_common.proxy.limits import check_media_url
from mstar_common.proxy.triton_stream import (
    GenerationRequest,
    TritonInvalidRequest,
    TritonOverloaded,
    TritonRefusedNow,
    TritonServerError,
    TritonTimeout,
    TritonUnavailable,
    build_request,
    classify_error,
)
from tests.unit.proxy_fake_triton import FakeTriton, make_app

BODY = {"model": "qwen3", "prompt": "x"}


@pytest.mark.parametrize("message, kind", [
    (wire.OVERLOADED_PREFIX + "cap of 4", TritonOverloaded),
    (wire.UNAVAILABLE_PREFIX + "waited 60 s", TritonRefusedNow),
    (wire.DEADLINE_PREFIX + "deadline of 2 s", TritonTimeout),
    ("in ensemble 'x': " + wire.INVALID_REQUEST_PREFIX + "top_p", TritonInvalidRequest),
    ("Stub process 'qwen3_llm_0_0' is not healthy.", TritonUnavailable),
    ("Request for unknown model: 'qwen3_llm' is not found", TritonUnavailable),
    ("internal error (error id abc)", TritonServerError),
])
def test_classify_error_by_prefix(message, kind):
    error = classify_error(message)
    assert type(error) is kind
    assert not str(error).startswith(("overloaded:", "unavailable:", "deadline_exceeded:", "invalid_request:"))


def test_overloaded_is_429_with_retry_after():
    app, _ = make_app(FakeTriton(script=[TritonOverloaded("the component holds its cap")]), retry_after_s=3)
    r = TestClient(app).post("/v1/completions", json=BODY)
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["code"] == "overloaded" and "cap" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/images/generations", {"model": "klein", "prompt": "a cat"}),
    ("/generate", {"model": "klein", "text": "a cat"}),
])
def test_the_image_routes_send_the_deployments_retry_after(path, body):
    """The image routes answered every 429 and 503 with `Retry-After: 1`, whatever admission.retry_after_s said."""
    from mstar_common.proxy.app import ServedModel

    for failure, status in ((TritonOverloaded("at its cap"), 429), (TritonRefusedNow("waited 60.0 s"), 503)):
        app, _ = make_app(FakeTriton(script=[failure]), retry_after_s=7,
                          models=[ServedModel("klein", "flux2_klein_walk", kind="image")])
        r = TestClient(app).post(path, json=body)
        assert r.status_code == status and r.headers["retry-after"] == "7", (r.status_code, r.headers)


def test_queue_wait_is_503_with_retry_after_and_the_reason():
    app, _ = make_app(FakeTriton(script=[TritonRefusedNow("the request waited 60.0 s for admission")]))
    r = TestClient(app).post("/v1/completions", json={**BODY, "stream": True})
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and "waited" in r.json()["error"]["message"]


def test_a_model_that_is_not_ready_is_503_with_retry_after_and_an_error_id():
    app, _ = make_app(FakeTriton(script=[TritonUnavailable("Stub process 'qwen3_llm_0_0' is not healthy.")]))
    r = TestClient(app).post("/v1/completions", json=BODY)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert "Stub" not in error["message"] and error["code"] in error["message"]


def test_deadline_is_504_naming_the_limit():
    app, _ = make_app(FakeTriton(script=[TritonTimeout("deadline")]), request_timeout_s=2.5)
    r = TestClient(app).post("/v1/completions", json=BODY)
    assert r.status_code == 504 and "2.5 s" in r.json()["error"]["message"]


def test_the_proxy_deadline_travels_as_the_triton_request_timeout():
    request = build_request("m", "r", GenerationRequest(text="x"), timeout_s=2.5)
    assert request.parameters["timeout"].int64_param == 2_500_000
    assert "timeout" not in build_request("m", "r", GenerationRequest(text="x")).parameters
    # a deadline under 1 us is 1 us, not 0 (none); one not a whole number of us in binary is not cut short (4.1 s
    # was 4,099,999 us)
    def timeout_us(timeout_s):
        return build_request("m", "r", GenerationRequest(text="x"), timeout_s=timeout_s).parameters["timeout"]

    assert timeout_us(4e-7).int64_param == 1 and timeout_us(4.1).int64_param == 4_100_000
    app, fake = make_app(FakeTriton(), request_timeout_s=7.0)
    TestClient(app).post("/v1/completions", json=BODY)
    assert fake.requests[-1].timeout_s == 7.0


@pytest.mark.parametrize("url, allow, ok", [
    ("data:audio/wav;base64,AAAA", False, True),
    ("https://example.com/a.wav", True, True),
    ("https://example.com/a.wav", False, False),
    ("file:///etc/passwd", True, False),
    ("/etc/passwd", True, False),
    ("../../secret.wav", False, False),
    ("ftp://host/a.wav", True, False),
    ("", True, False),
])
def test_media_urls_never_read_server_paths_and_remote_is_opt_in(url, allow, ok):
    if ok:
        assert check_media_url(url, "audio_url", allow) in ("data", "http", "https")
        return
    with pytest.raises(APIError) as info:
        check_media_url(url, "audio_url", allow)
    assert info.value.status == 400 and "audio_url" in info.value.message and "/etc" not in info.value.message

