"""The test session's own environment: what tests/conftest.py sets for every test."""

import urllib.request

import httpx
import pytest

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


@pytest.mark.parametrize("environ", [{}, {"no_proxy": "*"}, {"NO_PROXY": "*"}, {"no_proxy": "a.com", "NO_PROXY": "*"},
                                     {"no_proxy": "", "NO_PROXY": "*"}, {"no_proxy": "a.com"},
                                     {"no_grpc_proxy": "b.org", "NO_PROXY": "a.com"}])
def test_every_client_kind_is_told_to_skip_the_proxy_for_this_host(environ, monkeypatch):
    """A `*` in one spelling skipped the exemption: gRPC knows no `*` (and reads no_grpc_proxy first), and urllib
    and httpx read the lower-case spelling first, so `no_proxy=a.com NO_PROXY=*` sent loopback through the proxy."""
    from httpx._utils import get_environment_proxies

    from tests.conftest import exempt_loopback

    given = dict(environ)
    exempt_loopback(environ)
    for key in ("no_proxy", "NO_PROXY", "no_grpc_proxy", "HTTP_PROXY", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {**environ, "http_proxy": "http://127.0.0.1:9"}.items():
        monkeypatch.setenv(key, value)
    assert urllib.request.proxy_bypass_environment("127.0.0.1")
    mounts = get_environment_proxies()  # httpx's: no proxy at all, or none for this host
    assert "http://" not in mounts or mounts["all://127.0.0.1"] is None, mounts
    grpc_hosts = environ["no_grpc_proxy"].split(",")
    assert "127.0.0.1" in grpc_hosts and "*" not in grpc_hosts
    assert all(host in grpc_hosts for host in given.get("no_grpc_proxy", "").split(",") if host)
