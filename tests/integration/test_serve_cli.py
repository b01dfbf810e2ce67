"""`mstar serve`: validates, starts tritonserver + proxy, serves, and shuts both down on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from mstar_common.launcher import free_ports

pytestmark = pytest.mark.server


def _start_serve(target: str, tmp_path, timeout: float) -> tuple[subprocess.Popen, dict[str, int], list[str]]:
    """`mstar serve TARGET` on free ports, read until it says it is serving: (process, ports, its lines)."""
    names = ("port", "http-port", "grpc-port", "metrics-port")
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    cmd = [sys.executable, "-m", "mstar_common.cli", "serve", target, "--timeout", str(int(timeout))]
    cmd += [f"--{name}={port}" for name, port in ports.items()]
    env = {**os.environ, "MSTAR_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while not any("Ctrl-C stops both servers" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc, ports, lines


def test_serve_starts_both_and_stops_cleanly_on_sigterm(tmp_path):
    proc, ports, lines = _start_serve("qwen3", tmp_path, 240)
    try:
        assert any(f"http://localhost:{ports['port']}/v1" in line for line in lines), "".join(lines)
        base = f"http://127.0.0.1:{ports['port']}"
        reply = httpx.post(base + "/v1/completions", json={"model": "qwen3-tiny", "prompt": "hi", "max_tokens": 3})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for port in (ports["port"], ports["http-port"]):
            with pytest.raises(httpx.TransportError):
                httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_serve_killed_outright_takes_its_servers_with_it(tmp_path):
    """SIGKILL (or the OOM killer) gives `mstar serve` no chance to stop anything: tritonserver and the proxy, each in
    a session of their own, went on serving unsupervised on its ports. They now get SIGTERM when it dies."""
    proc, ports, _ = _start_serve("qwen3", tmp_path, 240)
    try:
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            open_ports = [port for port in ports.values() if _listening(port)]
            if not open_ports:
                break
            time.sleep(0.5)
        assert not open_ports, f"still served on {open_ports} after its mstar serve was killed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_proxy_that_dies_is_relaunched_and_serving_goes_on(tmp_path):
    proc, ports, _ = _start_serve("qwen3", tmp_path, 240)
    base = f"http://127.0.0.1:{ports['port']}"
    body = {"model": "qwen3-tiny", "prompt": "hi", "max_tokens": 3}
    try:
        proxy_pid = _proxy_of(proc.pid)
        os.kill(proxy_pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        reply = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                reply = httpx.post(base + "/v1/completions", json=body, timeout=10)
                break
            except httpx.TransportError:
                time.sleep(0.5)
        assert proc.poll() is None and reply is not None and reply.status_code == 200, reply
        assert _proxy_of(proc.pid) != proxy_pid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _proxy_of(serve_pid: int) -> int:
    """The proxy process `mstar serve` started (a child running `-m mstar_common.proxy`)."""
    from mstar_common.supervisor import child_pids

    for pid in child_pids({serve_pid}):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"mstar_common.proxy" in f.read():
                return pid
    raise AssertionError(f"no proxy under {serve_pid}")


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_serve_refuses_a_bad_deployment_before_starting(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nfamily: qwen3\ncheckpoint: builtin:qwen3-tiny\ncomponents: {}\n")
    out = subprocess.run([sys.executable, "-m", "mstar_common.cli", "serve", str(bad)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "components: missing ['llm']" in out.stderr


def test_serve_refuses_a_misspelt_switch_before_starting():
    env = {**os.environ, "MSTAR_PDL": "yes", "MSTAR_PREFILL_ATTENTION": "fast"}
    out = subprocess.run([sys.executable, "-m", "mstar_common.cli", "serve", "qwen3"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "mstar: error: environment switches refused" in out.stderr
    assert "MSTAR_PDL='yes': expected 0 or 1" in out.stderr and "MSTAR_PREFILL_ATTENTION='fast'" in out.stderr
    assert "tritonserver starting" not in out.stdout


def _deployment(tmp_path, **replace: str):
    from mstar_common.cli import DEFAULT_DEPLOYMENT

    text = DEFAULT_DEPLOYMENT.read_text()
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "dep.yaml"
    path.write_text(text)
    return path


def _serve(path, tmp_path, timeout: float = 180) -> subprocess.CompletedProcess:
    names = ("port", "http-port", "grpc-port", "metrics-port")
    ports = [f"--{name}={port}" for name, port in zip(names, free_ports(len(names)), strict=True)]
    env = {**os.environ, "MSTAR_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "mstar_common.cli", "serve", str(path), "--timeout", "120", *ports],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_serve_refuses_gpus_it_cannot_see_and_a_checkpoint_too_short_before_starting(tmp_path):
    out = _serve(_deployment(tmp_path, **{"{device: cpu, instances: 1}": "{device: gpu, gpus: [64]}"}), tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "components.llm.placement.gpus: [64] not visible on this machine" in out.stderr
    assert "tritonserver starting" not in out.stdout
    out = _serve(_deployment(tmp_path, **{"max_model_len: 512": "max_model_len: 100000",
                                          "num_pages: 512": "num_pages: 100000"}), tmp_path)
    assert out.returncode == 2 and "resources.max_model_len: 100000 exceeds the checkpoint's" in out.stderr
    assert "tritonserver starting" not in out.stdout


def test_serve_says_why_a_model_failed_to_load(tmp_path):
    """Weights the checks before the start cannot see wrong (a tensor of another shape than the config gives) fail
    the load inside tritonserver: serve prints the model's own error lines from the server log (not a traceback of
    its own) and exits 1. (Weights that are no safetensors at all are refused before the start since 2026-12-07.)"""
    import shutil

    from safetensors.torch import load_file, save_file

    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.families.registry import get_family

    tiny = resolve_checkpoint("builtin:qwen3-tiny", get_family("qwen3").builtin_checkpoints)
    broken = shutil.copytree(tiny, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, broken / "model.safetensors")
    out = _serve(_deployment(tmp_path, **{"builtin:qwen3-tiny": str(broken)}), tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "mstar: error: tritonserver exited" in out.stderr and "failed to load 'qwen3_llm'" in out.stderr
    assert f"checkpoint tensor {name} has shape" in out.stderr
    assert "Traceback" not in out.stderr.split("mstar: error:")[1]


def test_sigterm_lets_a_walks_in_flight_request_finish(tmp_path):
    """A walk's request (BLS hops between components) in flight when `mstar serve` gets SIGTERM completes: the
    proxy drains first, against a Triton that still serves every component (stopped together, Triton unloaded
    the components under the walk and the request failed with a 500)."""
    import threading

    from mstar_common.cli import CONFIGS

    proc, ports, _ = _start_serve(str(CONFIGS / "z_image_turbo.yaml"), tmp_path, 300)
    try:
        body = {"model": "z-image-turbo-tiny", "prompt": "a cat", "size": "256x256", "n": 4,
                "num_inference_steps": 40}
        url = f"http://127.0.0.1:{ports['port']}/v1/images/generations"
        replies = []
        thread = threading.Thread(target=lambda: replies.append(httpx.post(url, json=body, timeout=120)))
        thread.start()
        # SIGTERM once the request is in flight (a fixed 0.5 s could pass before a loaded machine sent it): the
        # walk's gauge counts it, sampled every 0.1 s
        metrics = f"http://127.0.0.1:{ports['metrics-port']}/metrics"
        deadline = time.monotonic() + 60
        while not any(line.startswith("mstar_requests_running{") and float(line.rsplit(" ", 1)[1]) > 0
                      for line in httpx.get(metrics, timeout=5).text.splitlines()):
            assert time.monotonic() < deadline and thread.is_alive(), "the request never ran"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        thread.join(120)
        assert replies and replies[0].status_code == 200, replies and replies[0].text
        assert len(replies[0].json()["data"]) == 4
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_refuses_ports_already_in_use_before_starting(tmp_path):
    """Another server on a port would answer this one's readiness checks: `mstar serve` used to say it was serving
    while its own proxy had failed to bind."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        names = ("http-port", "grpc-port", "metrics-port")
        cmd = [sys.executable, "-m", "mstar_common.cli", "serve", "qwen3", f"--port={port}",
               *(f"--{name}={p}" for name, p in zip(names, free_ports(3), strict=True))]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "MSTAR_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"mstar: error: port(s) already in use: proxy {port} (--port)" in out.stderr
    assert "tritonserver starting" not in out.stdout


def test_ctrl_c_while_tritonserver_loads_stops_at_once(tmp_path):
    """The signal handler only set a flag that nothing read until the server was ready: Ctrl-C (or SIGTERM) during
    a load was ignored for up to --timeout, then reported as a failed start."""
    names = ("port", "http-port", "grpc-port", "metrics-port")
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    cmd = [sys.executable, "-m", "mstar_common.cli", "serve", "qwen3", "--timeout", "240",
           *(f"--{name}={port}" for name, port in ports.items())]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "MSTAR_CACHE_DIR": str(tmp_path / "cache")})
    lines: list[str] = []
    try:
        while not any("tritonserver starting" in line for line in lines):
            assert proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        time.sleep(1.0)  # tritonserver is loading the model (several seconds on the CPU)
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + out
        assert time.monotonic() - started < 20  # tritonserver stopped, not waited for
        assert "[mstar] stopped before tritonserver was ready" in out and "Traceback" not in out, out
        assert not [port for port in ports.values() if _listening(port)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_proxy_that_fails_its_first_start_is_an_error_with_its_log_not_a_traceback(tmp_path, monkeypatch, capsys):
    """launch_proxy's RuntimeError went up as a traceback, and a proxy that never became ready was left running
    (the finally block knew of no proxy yet). Tritonserver is faked here; the proxy is a process that logs a line
    and exits."""
    from mstar_common import cli, launcher, supervisor

    class Ready:
        is_failed, failure = False, ""

        def __init__(self, *args, **kwargs):
            self.stopped = False

        def start(self, stop=None):
            pass

        def watch(self):
            pass

        def stop(self, drain_s=None):
            self.stopped = True

    def failing_proxy(dep, entry, ports, log_path, host="127.0.0.1"):
        log_path.write_text("ERROR:    cannot listen on '10.9.9.9' port 8000: [Errno 99] Cannot assign requested "
                            "address\n")  # as the proxy logs it
        return subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"], start_new_session=True)

    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # serve's handlers would outlive it in pytest
    monkeypatch.setattr(supervisor, "TritonSupervisor", Ready)
    monkeypatch.setattr(launcher, "start_proxy", failing_proxy)
    names = ("port", "http-port", "grpc-port", "metrics-port")
    args = [f"--{name}={port}" for name, port in zip(names, free_ports(len(names)), strict=True)]
    assert cli.main(["serve", "qwen3", "--timeout", "30", *args]) == 1
    err = capsys.readouterr().err
    assert "mstar: error: proxy exited with code 3 before it was ready" in err and "Traceback" not in err, err
    assert "cannot listen on '10.9.9.9' port 8000" in err  # the proxy log's tail


def test_serve_refuses_ports_another_serve_holds_while_it_loads(tmp_path, monkeypatch, capsys):
    """A serve still loading its models has not bound its ports: the port check saw them free, so a second serve
    on them loaded everything again and took the first one's readiness answer for its own."""
    from mstar_common import cli

    ports = free_ports(4)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import time; from mstar_common.launcher import reserve_ports; "
        f"assert reserve_ports({ports}) == {{}}; print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
        names = ("port", "http-port", "grpc-port", "metrics-port")
        assert cli.main(["serve", "qwen3", *(f"--{n}={p}" for n, p in zip(names, ports, strict=True))]) == 2
    finally:
        holder.kill()
        holder.wait(5)
    err = capsys.readouterr().err
    assert f"port(s) taken by a server still starting: Triton HTTP {ports[1]} (--http-port: mstar serve pid " \
           f"{holder.pid})" in err, err


class _FakeSupervisor:
    """tritonserver's supervisor, faked: ready at once; `watch` calls `later` after `delay_s`, on a thread."""

    delay_s = 0.0

    def __init__(self, *args, **kwargs):
        self.is_failed, self.failure = False, ""

    def start(self, stop=None):
        pass

    def later(self):
        pass

    def watch(self):
        import threading
        import time

        threading.Thread(target=lambda: (time.sleep(self.delay_s), self.later()), daemon=True).start()

    def stop(self, drain_s=None):
        pass


def _serve_faked(monkeypatch, tmp_path, triton_class, start_proxy, started: list, on_signal) -> tuple[int, float]:
    """`mstar serve qwen3 --timeout 60` with tritonserver's supervisor and the proxy's start faked (`started`: the
    proxy processes made, killed here at the end): its exit code and the seconds it took."""
    import time

    from mstar_common import cli, launcher, supervisor

    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(signal, "signal", on_signal)
    monkeypatch.setattr(supervisor, "TritonSupervisor", triton_class)
    monkeypatch.setattr(launcher, "start_proxy", start_proxy)
    names = ("port", "http-port", "grpc-port", "metrics-port")
    began = time.monotonic()
    try:
        code = cli.main(["serve", "qwen3", "--timeout", "60",
                         *(f"--{n}={p}" for n, p in zip(names, free_ports(4), strict=True))])
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    return code, time.monotonic() - began


@pytest.mark.parametrize("end", ["triton given up", "ctrl-c"])
def test_a_proxy_relaunch_stops_waiting_when_triton_is_given_up_or_on_ctrl_c(tmp_path, monkeypatch, capsys, end):
    """The proxy's relaunch waited for its /health through --timeout with no stop: after the supervisor gave up on
    tritonserver (the /health would stay 503) or a Ctrl-C, `mstar serve` served nothing for up to 600 s, then
    blamed the proxy. Tritonserver is faked; the first proxy answers /health and exits after a second, the
    relaunched one never answers."""

    started = []

    def proxies(dep, entry, ports_, log_path, host="127.0.0.1"):
        log_path.write_text("")
        code = "import time; time.sleep(60)"
        if not started:  # the first: healthy for a second, then gone
            code = ("import http.server, threading, time\n"
                    "class H(http.server.BaseHTTPRequestHandler):\n"
                    "    def do_GET(self): self.send_response(200); self.end_headers()\n"
                    "    def log_message(self, *args): pass\n"
                    f"server = http.server.HTTPServer(('127.0.0.1', {ports_.proxy}), H)\n"
                    "threading.Thread(target=server.serve_forever, daemon=True).start()\ntime.sleep(1.5)\n")
        started.append(subprocess.Popen([sys.executable, "-c", code], start_new_session=True))
        return started[-1]

    handlers = {}

    class Triton(_FakeSupervisor):
        delay_s = 3.0  # the relaunched proxy is waiting by then

        def later(self):
            if end == "ctrl-c":
                handlers[signal.SIGINT](signal.SIGINT, None)
            else:
                self.failure, self.is_failed = "tritonserver crash loop (simulated)", True

    code, took = _serve_faked(monkeypatch, tmp_path, Triton, proxies, started,
                              lambda sig, handler: handlers.__setitem__(sig, handler))
    out = capsys.readouterr()
    assert len(started) == 2 and took < 20, out  # not the 60 s of --timeout
    if end == "ctrl-c":
        assert code == 0 and "[mstar] stopped" in out.out, out
    else:
        assert code == 1 and "tritonserver crash loop (simulated); shutting down" in out.err, out
        assert "did not come back" not in out.err


def test_the_first_proxy_start_stops_waiting_when_triton_is_given_up(tmp_path, monkeypatch, capsys):
    """The supervisor already watches while the proxy first starts: when it gave up on tritonserver then, the wait
    for the proxy's /health (503 from then on) ran to --timeout and blamed the proxy. Tritonserver is faked; the
    proxy never answers."""

    started = []

    def proxy(dep, entry, ports_, log_path, host="127.0.0.1"):
        log_path.write_text("")
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                        start_new_session=True))
        return started[-1]

    class Triton(_FakeSupervisor):
        delay_s = 1.0

        def later(self):
            self.failure, self.is_failed = "a stub died and server.restart_on_fault is off (simulated)", True

    code, took = _serve_faked(monkeypatch, tmp_path, Triton, proxy, started, lambda sig, handler: None)
    out = capsys.readouterr()
    assert code == 1 and took < 20, out  # not the 60 s of --timeout
    assert "a stub died and server.restart_on_fault is off (simulated); shutting down" in out.err, out
    assert "proxy not ready" not in out.err
