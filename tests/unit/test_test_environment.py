"""The test session's own environment: what tests/conftest.py sets for every test."""

import urllib.request

import httpx

from tests.unit.local_http import answering


def test_the_tests_clients_reach_this_host_directly_whatever_http_proxy_says(monkeypatch):
    """On a host with http_proxy set, httpx and urllib sent the tests' own loopback requests through it (gRPC too)."""
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(urllib.request, "_opener", None)
    with answering(b"ok") as url:
        assert httpx.get(url, timeout=5).text == "ok"
        with httpx.Client(timeout=5) as client:
            assert client.get(url.replace("127.0.0.1", "localhost")).text == "ok"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.read() == b"ok"
