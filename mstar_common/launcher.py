"""Start and stop tritonserver (and the proxy) for a deployment: used by `mstar serve` and the tests."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mstar_common.config import Deployment, DeploymentError
from mstar_common.families.registry import get_family
from mstar_common.orphan_watch import kill_group_when_orphaned
from mstar_common.triton_env import find_triton, server_command, server_env

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # prctl(2)
ORPHAN_GRACE_S = 15  # past the server's drain: how long a server outliving its launcher may take before SIGKILL
_prctl = None
if sys.platform.startswith("linux"):
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        _prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it


def ends_with_parent(parent_pid: int):
    """A `preexec_fn`: the child gets SIGTERM when the thread that started it ends (Linux's parent-death signal),
    so that a `mstar serve` killed outright (SIGKILL, the OOM killer) leaves no server running unsupervised on its
    ports. The check after it covers a parent that died before the call."""
    def arm() -> None:
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:
            os._exit(1)
    return arm


@dataclass(slots=True)
class Ports:
    """A deployment's listening ports; the URLs are the local ones a client on this host uses."""

    http: int
    grpc: int
    metrics: int
    proxy: int

    @classmethod
    def free(cls, proxy: bool = True) -> Ports:
        """Free 127.0.0.1 ports for Triton's three endpoints, and for the proxy unless `proxy` is false (then 0)."""
        http, grpc, metrics, proxy_port = free_ports(4)
        return cls(http=http, grpc=grpc, metrics=metrics, proxy=proxy_port if proxy else 0)

    @property
    def triton_ready_url(self) -> str:
        return f"http://127.0.0.1:{self.http}/v2/health/ready"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics}/metrics"

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy}"

    @property
    def proxy_health_url(self) -> str:
        return f"{self.proxy_url}/health"


def triton_args(repo: Path, dep: Deployment, ports: Ports) -> list[str]:
    s = dep.server
    return [
        f"--model-repository={repo}",
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        "--http-address=127.0.0.1",
        "--grpc-address=127.0.0.1",
        f"--backend-config=python,shm-default-byte-size={s.shm_default_byte_size}",
        f"--backend-config=python,shm-growth-byte-size={s.shm_growth_byte_size}",
        f"--backend-config=python,stub-timeout-seconds={s.stub_timeout_seconds}",
        f"--exit-timeout-secs={s.drain_timeout_s}",
        "--log-verbose=0",
    ]


def start_triton(
    repo: Path, dep: Deployment, ports: Ports, log_path: Path, extra_args: tuple[str, ...] = ()
) -> subprocess.Popen:
    install = find_triton()
    cmd = server_command(install, [*triton_args(repo, dep, ports), *extra_args])
    log = log_path.open("ab")
    logger.info("starting tritonserver: %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, env=server_env(install), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=ends_with_parent(os.getpid()))  # noqa: PLW1509 - it calls prctl alone
    kill_group_when_orphaned(proc.pid, dep.server.drain_timeout_s + ORPHAN_GRACE_S)
    return proc


def start_proxy(
    dep: Deployment, entry_model: str, ports: Ports, log_path: Path, host: str = "127.0.0.1"
) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "mstar_common.proxy",
        "--triton-url", f"127.0.0.1:{ports.grpc}",
        "--host", host,
        "--port", str(ports.proxy),
        "--model", f"{dep.name}={entry_model}:{get_family(dep.family).proxy_kind}",
        *proxy_limit_args(dep),
    ]  # fmt: skip
    log = log_path.open("ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=ends_with_parent(os.getpid()))  # noqa: PLW1509 - it calls prctl alone
    kill_group_when_orphaned(proc.pid, dep.server.drain_timeout_s + ORPHAN_GRACE_S)
    return proc


def proxy_limit_args(dep: Deployment) -> list[str]:
    """The deployment's admission and input limits as proxy flags."""
    adm, lim = dep.admission, dep.limits
    args = [
        "--request-timeout-s", str(adm.request_timeout_s or 0),
        "--retry-after-s", str(adm.retry_after_s),
        "--max-body-bytes", str(lim.max_body_bytes),
        "--drain-timeout-s", str(dep.server.drain_timeout_s),
        "--workers", str(dep.server.proxy_workers),
    ]  # fmt: skip
    return args + (["--allow-remote-urls"] if lim.allow_remote_urls else [])


class StopRequested(Exception):
    """A stop (Ctrl-C, SIGTERM) came while a start waited for its process to be ready."""


class LogEcho:
    """Echoes the start-up progress lines a server writes to its log (the CUDA-graph captures, which take minutes)
    to the console while `mstar serve` or a benchmark waits for it: the lines added to `log_path` since this was
    made that hold one of `MARKERS`, from the marker on, each once."""

    MARKERS = ("[cuda graphs]",)

    def __init__(self, log_path: Path, prefix: str = "[mstar] ", out=None) -> None:
        self.log_path, self.prefix, self.out = log_path, prefix, out
        try:
            self._offset = log_path.stat().st_size  # a relaunch appends to the log of the launch before
        except OSError:
            self._offset = 0
        self._partial = b""

    def __call__(self) -> None:
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._offset)
                data = log.read(1 << 20)
        except OSError:
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8", "replace")
            for marker in self.MARKERS:
                if (at := line.find(marker)) >= 0:
                    print(self.prefix + line[at:].rstrip(), file=self.out or sys.stdout, flush=True)
                    break


# Readiness (and a benchmark's metrics) are asked of our own servers, never through the environment's http_proxy:
# urllib sends even a loopback request there on Linux, and a start on a host with a proxy set never saw its server
# ready.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def open_direct(url: str, timeout: float):
    """`urllib.request.urlopen(url, timeout)`, bypassing any http_proxy (our own servers, on this host)."""
    return _DIRECT.open(url, timeout=timeout)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, what: str,
               stop: threading.Event | None = None, progress=None) -> None:
    """Until `url` answers 200; raises RuntimeError if `proc` exits first, TimeoutError after `timeout`, and
    StopRequested as soon as `stop` is set (a start can take minutes: weight loads, graph captures). `progress`
    (a LogEcho) is called on each check, and once more when the server is ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if progress is not None:
            progress()
        if stop is not None and stop.is_set():
            raise StopRequested(f"stopped while {what} was starting")
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was ready")
        try:
            with open_direct(url, timeout=2) as resp:
                if resp.status == 200:
                    if progress is not None:
                        progress()
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        except ValueError as exc:  # a URL that cannot be (http.client.InvalidURL, an IDNA label too long)
            raise RuntimeError(f"{what}: cannot check {url!r}: {exc}") from None
        if stop is not None:
            stop.wait(0.25)
        else:
            time.sleep(0.25)
    raise TimeoutError(f"{what} not ready at {url} after {timeout:.0f} s")


def connect_host(bind_host: str) -> str:
    """The host a local client reaches a server bound to `bind_host` at: a wildcard's loopback, else the address
    itself (an IPv6 literal in brackets)."""
    if bind_host in ("", "0.0.0.0", "*"):
        return "127.0.0.1"
    if bind_host == "::":
        return "[::1]"
    return f"[{bind_host}]" if ":" in bind_host and not bind_host.startswith("[") else bind_host


def stop_process(proc: subprocess.Popen | None, grace: float = 25.0) -> None:
    """SIGTERM the process group we started, then SIGKILL what is left of it after `grace` seconds. The group is
    signalled even where its leader has exited: a proxy whose main process was killed leaves its uvicorn workers
    listening on the port."""
    if proc is None:
        return
    deadline = time.monotonic() + grace
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        pass  # the group is gone


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free 127.0.0.1 ports. The sockets stay bound until all are picked: one closed before the next
    bind may be handed out again, and two servers told the same port fail to start."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def port_in_use(port: int, host: str = "") -> bool:
    """Whether something listens on `port` (at `host`; "" is every address, which any listener on the port blocks).
    A port left in TIME_WAIT by a server that just stopped counts as free, as it does for the servers' own bind."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except PermissionError:  # a port below 1024 (or one the system reserves) for a user who may not bind it
            raise DeploymentError(f"port {port}: this user may not bind it (ports below 1024 need privileges); "
                                  f"choose another") from None
        except OSError:
            return True
    return False


PORT_LOCK_DIR = Path(tempfile.gettempdir()) / "mstar-port-locks"
_HELD_PORT_LOCKS: dict[int, tuple[int, Path]] = {}  # port -> (the open lock file, its path), for this process's life


def _lock_file(path: Path) -> tuple[int | None, str | None]:
    """(fd holding `path`'s lock, None), or (None, who holds it); (None, None) where it cannot be opened. A file
    its holder unlinked while this one waited on it is opened again (the lock must be on the file the path names).
    Never through a symlink, and only a regular file of this user's is written (the folder is shared: another
    user's link there made a serve truncate and overwrite the file it named)."""
    for _ in range(5):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError:  # another user's (0644), or a symlink: only asked
            return None, _holder(path)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            return None, None
        if info.st_uid != os.geteuid():  # another user's (root opens it read-write): asked, never written
            os.close(fd)
            return None, _holder(path)
        if (holder := _lock_or_holder(fd)) is not None:
            os.close(fd)
            return None, holder
        try:
            if os.lstat(path).st_ino == info.st_ino:
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(os.getpid()).encode(), 0)
                return fd, None
        except FileNotFoundError:
            pass
        os.close(fd)  # released and removed by its holder meanwhile: lock the path's new file
    return None, None


def _holder(path: Path) -> str | None:
    """Who holds the lock on another user's lock file (read only, not followed), or None where no one does or it
    cannot be asked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _lock_or_holder(fd) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    finally:
        os.close(fd)


def _lock_or_holder(fd: int) -> str | None:
    """Take the lock on `fd` (None), or who holds it: the pid its holder wrote there."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner = os.pread(fd, 64, 0).decode(errors="replace").strip()
        return f"mstar serve pid {owner}" if owner.isdigit() else "another mstar serve"
    return None


def _unlock_file(fd: int, path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()  # while still locked, so a later serve never locks a file no path names
    os.close(fd)


def reserve_ports(ports: list[int], lock_dir: Path | None = None) -> dict[int, str]:
    """Lock each port for this process (a file lock the kernel drops when the process ends, however it ends): a
    second `mstar serve` on one of them, started while this one's tritonserver loads its models (it binds its
    ports only after the load, so `port_in_use` sees nothing), is refused instead of loading the models again and
    then taking the first one's readiness answer for its own. Returns {port: who holds it} for the ports another
    process holds, having taken none; {} when all are now this process's (`release_ports` lets them go and removes
    the files). Another user's lock file is asked (read, never written), a symlink never followed."""
    folder = PORT_LOCK_DIR if lock_dir is None else lock_dir
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
    try:
        info = os.lstat(folder)
    except OSError:
        return {}
    if not stat.S_ISDIR(info.st_mode):  # a symlink (or a file) where the folder should be: not followed, unchecked
        logger.warning("%s is not a folder (a symlink?): the ports are not locked against a second serve", folder)
        return {}
    if info.st_uid == os.geteuid():
        with contextlib.suppress(OSError):
            folder.chmod(0o1777)  # every user's servers share it; each lock file stays its owner's
    taken: dict[int, tuple[int, Path]] = {}
    held: dict[int, str] = {}
    for port in ports:
        if port in _HELD_PORT_LOCKS:
            continue
        path = folder / f"{port}.lock"
        fd, holder = _lock_file(path)
        if holder is not None:
            held[port] = holder
        elif fd is not None:
            taken[port] = (fd, path)
    if held:
        for fd, path in taken.values():
            _unlock_file(fd, path)
        return held
    _HELD_PORT_LOCKS.update(taken)
    return {}


def release_ports(ports: list[int]) -> None:
    """Let go of the locks `reserve_ports` took for these ports, removing their files (a process that ends lets go
    of its locks; the files of one killed outright stay, unlocked, for the next serve to take)."""
    for port in ports:
        if (entry := _HELD_PORT_LOCKS.pop(port, None)) is not None:
            _unlock_file(*entry)


@contextlib.contextmanager
def bare_triton(repo: Path, log_path: Path, extra_args: tuple[str, ...] = (), timeout: float = 120.0) -> Iterator[str]:
    """A tritonserver on a throwaway model repository (the platform probes in scripts/): yields its gRPC address,
    prints the tail of its log should it fail to start, and always stops it."""
    http, grpc = free_ports(2)
    install = find_triton()
    cmd = server_command(install, [f"--model-repository={repo}", f"--http-port={http}", f"--grpc-port={grpc}",
                                   "--allow-metrics=false", "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
                                   *extra_args])
    with open(log_path, "wb") as log:
        server = subprocess.Popen(cmd, env=server_env(install), stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        try:
            wait_ready(f"http://127.0.0.1:{http}/v2/health/ready", server, timeout, "tritonserver")
        except (RuntimeError, TimeoutError):
            print(log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise
        yield f"127.0.0.1:{grpc}"
    finally:
        stop_process(server)
