"""The multi-worker proxy (`--workers`, `server.proxy_workers`): the parent hands its settings to uvicorn's worker
processes through the environment, and each worker builds the same app from them (CPU; no process is started)."""

from __future__ import annotations

import os

import pytest
import yaml

from mstar_common.cli import DEFAULT_DEPLOYMENT
from mstar_common.config import deployment_from_dict
from mstar_common.launcher import proxy_limit_args
from mstar_common.proxy import __main__ as proxy_main


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:  # IPv6 off in the kernel, or no ::1 on lo (some containers)
        return False


needs_ipv6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="needs IPv6 loopback (::1) on this host")


def _run(monkeypatch, *args):
    calls = []
    monkeypatch.setattr(proxy_main, "serve_one", lambda app, **kw: calls.append((app, kw)))
    monkeypatch.setattr(proxy_main, "run_workers",
                        lambda app, workers, **kw: calls.append((app, {"factory": True, "workers": workers, **kw})))
    monkeypatch.delenv(proxy_main.SETTINGS_ENV, raising=False)
    proxy_main.main(["--triton-url", "127.0.0.1:9", "--model", "a=a_llm", "--model", "tts=orpheus_tts:speech",
                     "--request-timeout-s", "0", "--max-body-bytes", "1234", "--allow-remote-urls", *args])
    (app, kwargs), = calls
    return app, kwargs


def test_one_worker_serves_the_app_in_process(monkeypatch):
    app, kwargs = _run(monkeypatch)
    assert not isinstance(app, str) and "workers" not in kwargs
    assert proxy_main.SETTINGS_ENV not in os.environ


def test_workers_rebuild_the_parents_settings_from_the_environment(monkeypatch):
    app, kwargs = _run(monkeypatch, "--workers", "3", "--drain-timeout-s", "7")
    assert app == "mstar_common.proxy.__main__:app_from_env" and kwargs["factory"] and kwargs["workers"] == 3
    assert kwargs["timeout_graceful_shutdown"] == 7.0
    settings, level = proxy_main.settings_from_json(os.environ[proxy_main.SETTINGS_ENV])
    assert level == "info"
    assert settings.triton_url == "127.0.0.1:9" and settings.request_timeout_s is None
    assert settings.max_body_bytes == 1234 and settings.allow_remote_urls
    assert [(m.name, m.triton_model, m.kind) for m in settings.models] == [("a", "a_llm", "text"),
                                                                           ("tts", "orpheus_tts", "speech")]
    assert isinstance(settings.created, int)  # one `created` for every worker's model cards
    worker_app = proxy_main.app_from_env()
    assert worker_app.state.serving.created == settings.created
    assert sorted(worker_app.state.serving.models) == ["a", "tts"]


@pytest.mark.parametrize("workers", ["0", "65"])
def test_worker_count_out_of_range_is_refused(monkeypatch, capsys, workers):
    with pytest.raises(SystemExit):
        _run(monkeypatch, "--workers", workers)
    assert "--workers must be in [1, 64]" in capsys.readouterr().err


def test_the_deployment_key_reaches_the_proxy_command():
    raw = yaml.safe_load(DEFAULT_DEPLOYMENT.read_text())
    raw.setdefault("server", {})["proxy_workers"] = 4
    args = proxy_limit_args(deployment_from_dict(raw, source="test"))
    assert args[args.index("--workers") + 1] == "4"


def test_every_limit_serve_hands_the_proxy_is_a_flag_it_takes_and_none_is_inert(monkeypatch, capsys):
    """`--max-upload-s` was parsed, checked and stored, and nothing read it: a standalone proxy's operator who set
    it still got uploads up to the deployment's limit (the whisper walk applies limits.max_upload_s itself)."""
    raw = yaml.safe_load(DEFAULT_DEPLOYMENT.read_text())
    _, kwargs = _run(monkeypatch, *proxy_limit_args(deployment_from_dict(raw, source="test")))
    with pytest.raises(SystemExit):
        _run(monkeypatch, "--max-upload-s", "30")
    assert "unrecognized arguments: --max-upload-s" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--request-timeout-s", "inf"), ("--request-timeout-s", "nan"),
                                         ("--request-timeout-s", "1e13")])
def test_a_timeout_that_is_no_number_of_seconds_is_a_usage_error(monkeypatch, capsys, flag, value):
    """`--request-timeout-s inf` (a natural "no limit") started the proxy, and every request then failed at the
    deadline's conversion to microseconds: a 500."""
    with pytest.raises(SystemExit) as info:
        _run(monkeypatch, flag, value)
    assert info.value.code == 2 and f"{flag} must be seconds in (0, 604800]" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, rule", [
    ("--port", "70000", "must be a TCP port in [1, 65535]"), ("--port", "-1", "must be a TCP port"),
    ("--drain-timeout-s", "-1", "must be seconds >= 0"), ("--drain-timeout-s", "nan", "must be seconds >= 0"),
    ("--log-level", "nope", "invalid choice: 'nope'"), ("--host", "not a host!", "--host"),
])
def test_the_standalone_proxys_bind_drain_and_log_flags_are_checked(monkeypatch, capsys, flag, value, rule):
    """`mstar serve` checks these; `python -m mstar_common.proxy` passed them on: a traceback for a log level
    logging does not know, a port 70000 that a host name's resolver wrapped to 4464, no drain at all for -1."""
    with pytest.raises(SystemExit) as info:
        _run(monkeypatch, flag, value)
    assert info.value.code == 2 and rule in capsys.readouterr().err


def test_uvicorns_trace_level_is_taken(monkeypatch):
    _, kwargs = _run(monkeypatch, "--log-level", "trace", "--port", "8123")
    assert kwargs["log_level"] == "trace" and kwargs["port"] == 8123


def test_a_draining_multi_worker_proxy_refuses_new_connections(tmp_path):
    """With --workers 2, uvicorn's parent kept its copy of the listening socket open until every worker had drained:
    the kernel accepted new connections that no worker would take, and they hung until the parent exited. A worker
    here drains a request whose body is still on its way; a new connection meanwhile must be refused."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    from mstar_common.launcher import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mstar_common.proxy", "--triton-url", "127.0.0.1:9", "--model",
                             "a=a_llm", "--port", str(port), "--workers", "2", "--drain-timeout-s", "20"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    slow = None
    try:
        deadline = time.monotonic() + 60
        while True:  # up: /health answers (503: no Triton on port 9)
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as probe:
                    probe.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    if probe.recv(64).startswith(b"HTTP/1.1"):
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the proxy did not come up"
            time.sleep(0.2)
        slow = socket.create_connection(("127.0.0.1", port), timeout=5)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\"")  # a request in flight: its body is still coming
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(1.5)
        assert proc.poll() is None  # still draining the slow request
        try:
            late = socket.create_connection(("127.0.0.1", port), timeout=2)
        except ConnectionRefusedError:
            outcome = "refused"
        else:
            with late:
                try:
                    late.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    outcome = "answered" if late.recv(64) else "closed"
                except TimeoutError:
                    outcome = "hung"
                except OSError:
                    outcome = "reset"
        assert outcome in ("refused", "reset", "closed"), outcome
    finally:
        if slow is not None:
            slow.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_every_address_binds_with_several_workers_too(monkeypatch):
    """`mstar serve --host '*'` (every address) started one worker, but with server.proxy_workers > 1 uvicorn binds
    ("*", port) on a socket of its own, which no resolver takes: the proxy exited after the models had loaded."""
    import uvicorn

    _, kwargs = _run(monkeypatch, "--workers", "2", "--host", "*")
    assert kwargs["host"] == ""
    sock = uvicorn.Config("x:y", host=kwargs["host"], port=0).bind_socket()
    sock.close()
    assert _run(monkeypatch, "--host", "10.1.2.3")[1]["host"] == "10.1.2.3"


@needs_ipv6
def test_every_address_is_ipv6_too_with_several_workers():
    """One worker's asyncio server listens on IPv4 and IPv6 for "" (`--host '*'`); with several, uvicorn's own
    socket was AF_INET, so the same deployment refused IPv6 clients once server.proxy_workers > 1."""
    import socket

    from mstar_common.proxy.__main__ import listening_sockets

    (sock,) = listening_sockets("", 0)
    try:
        sock.listen(4)
        port = sock.getsockname()[1]
        for address in ("127.0.0.1", "::1"):
            with socket.create_connection((address, port), timeout=5):
                pass
        assert sock.get_inheritable()
    finally:
        sock.close()
    (named,) = listening_sockets("127.0.0.1", 0)
    assert named.family == socket.AF_INET and named.getsockname()[0] == "127.0.0.1"
    named.close()


@needs_ipv6
def test_a_taken_ipv6_side_refuses_and_a_dual_name_listens_on_both(monkeypatch):
    """Any bind error fell back to IPv4: with [::]:PORT taken the proxy listened on 0.0.0.0 alone and IPv6 clients
    reached the other process (one worker's start refuses). A name with A and AAAA records bound its first
    address only (one worker's server binds both)."""
    import errno
    import socket

    from mstar_common.proxy import __main__ as proxy_main

    taken = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    taken.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    taken.bind(("::", 0))
    taken.listen(1)
    try:
        with pytest.raises(OSError) as refused:
            proxy_main.listening_sockets("", taken.getsockname()[1])
        assert refused.value.errno == errno.EADDRINUSE
    finally:
        taken.close()
    real = socket.getaddrinfo

    def dual(host, *args, **kwargs):
        if host == "dualname":
            return real("::1", *args, **kwargs) + real("127.0.0.1", *args, **kwargs)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(proxy_main.socket, "getaddrinfo", dual)
    sockets = proxy_main.listening_sockets("dualname", 0)
    try:
        assert {s.family for s in sockets} == {socket.AF_INET6, socket.AF_INET}
        assert len({s.getsockname()[1] for s in sockets}) == 1
        for sock in sockets:
            sock.listen(2)
        for address in ("::1", "127.0.0.1"):
            with socket.create_connection((address, sockets[0].getsockname()[1]), timeout=5):
                pass
    finally:
        for sock in sockets:
            sock.close()


def test_a_name_listens_where_the_kernel_has_its_family(monkeypatch):
    """With IPv6 off in the kernel, `localhost` may still resolve to ::1: socket(AF_INET6) fails, and the whole
    multi-worker start was refused where one worker's asyncio server skips that address and listens on the rest."""
    import errno
    import socket

    from mstar_common.proxy import __main__ as proxy_main

    real_socket, real_getaddrinfo = socket.socket, socket.getaddrinfo

    def no_ipv6(family=socket.AF_INET, *args, **kwargs):
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real_socket(family, *args, **kwargs)

    def dual(host, *args, **kwargs):
        return real_getaddrinfo("::1", *args, **kwargs) + real_getaddrinfo("127.0.0.1", *args, **kwargs)

    monkeypatch.setattr(proxy_main.socket, "getaddrinfo", dual)
    monkeypatch.setattr(proxy_main.socket, "socket", no_ipv6)
    (only,) = proxy_main.listening_sockets("localhost", 0)
    assert only.getsockname()[0] == "127.0.0.1"
    only.close()


def _kernel_drops_zero_window_peers() -> bool:
    import platform
    import re
    import socket

    release = re.match(r"(\d+)\.(\d+)", platform.release())
    return hasattr(socket, "TCP_USER_TIMEOUT") and platform.system() == "Linux" and release is not None \
        and (int(release[1]), int(release[2])) >= (5, 11)  # before 5.11 each answered zero-window probe reset it


@pytest.mark.skipif(not _kernel_drops_zero_window_peers(), reason="needs Linux >= 5.11's TCP_USER_TIMEOUT")
def test_a_client_that_stops_reading_is_dropped_and_its_request_cancelled(monkeypatch):
    """A served stream whose client keeps the connection but reads nothing: the stream's own cut freed its Triton
    request, but the socket (its buffer never draining, the peer answering the kernel's zero-window probes) stayed
    until the client left, and a drain at shutdown waited for it. The listening sockets now carry TCP_USER_TIMEOUT,
    which the accepted connection inherits: the kernel drops it, and the proxy sees a disconnect."""
    import asyncio
    import json
    import socket
    import threading
    import time

    import uvicorn

    from mstar_common.proxy import sse
    from mstar_common.proxy.triton_stream import StreamResponse
    from tests.unit.proxy_fake_triton import HANG, FakeTriton, make_app

    monkeypatch.setattr(proxy_main, "SEND_STALL_S", 1.0)
    monkeypatch.setattr(sse, "STALL_CHECK_S", 0.1)
    fake = FakeTriton(script=[StreamResponse(text="x" * 200_000)] * 100 + [HANG])  # ~20 MB: past every buffer
    app, _ = make_app(fake)
    (sock,) = proxy_main.listening_sockets("127.0.0.1", 0)
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 1000
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    client = socket.socket()
    try:
        while not server.started:
            time.sleep(0.05)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(sock.getsockname())
        body = json.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True})
        client.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                       f"x-request-id: stalled-2\r\ncontent-length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 20
        while (fake.cancelled != ["stalled-2"] or server.server_state.connections) and time.monotonic() < deadline:
            time.sleep(0.1)  # the client reads nothing
        assert fake.cancelled == ["stalled-2"]
        assert not server.server_state.connections, "the stalled connection is still open"
    finally:
        client.close()
        server.should_exit = True
        thread.join(10)
        sock.close()
        asyncio.set_event_loop(None)


def test_ctrl_c_stops_a_one_worker_proxy_quietly(tmp_path):
    """Run on the pre-bound sockets, uvicorn's Server raised the SIGINT it had drained on out of `main` (a traceback
    and a death by SIGINT), where uvicorn.run, which it replaced, ends quietly."""
    import signal
    import subprocess
    import sys
    import time

    from mstar_common.launcher import free_ports

    (port,) = free_ports(1)
    log = tmp_path / "proxy.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mstar_common.proxy", "--triton-url", "127.0.0.1:9",
                                 "--model", "a=a_llm", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "Application startup complete" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in log.read_text() and f"listening on 127.0.0.1 port {port} (1 worker)" in log.read_text()
