"""Keep a deployment's tritonserver serving: relaunch it when it, or one of its Python stubs, dies.

Why a relaunch. Triton 2.51's Python backend does not restart a dead stub (the upstream restart code was
removed, and the model keeps reporting ready). Requests that were in flight on the dead stub never get a
final response, and new ones fail with "Stub process ... is not healthy". Reloading just that model through
the repository API brings new requests back, but the in-flight ones keep hanging and hold the old model
version (and its shared memory) forever. Killing the server's process group instead ends every in-flight
stream at once (gRPC clients, the proxy included, get an error: the proxy answers 500 with an error id),
frees the stubs' shared memory, and a fresh server serves again after one model load.

The supervisor watches the server process and the stubs it spawned (children of the server, found in
/proc) every `poll_s`. On a death it logs an error id, kills what is left of the process group, removes
the shared-memory regions named by its own region prefix, and relaunches on the same ports. More than
`max_restarts` relaunches within RESTART_WINDOW_S is a crash loop: it gives up and reports failure.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from mstar_common.config import Deployment
from mstar_common.launcher import LogEcho, Ports, StopRequested, start_triton, wait_ready

logger = logging.getLogger(__name__)

RESTART_WINDOW_S = 600.0
STUB_BINARY = "triton_python_backend_stub"
SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True, slots=True)
class Stub:
    pid: int
    model: str  # the Triton model whose instance this stub runs


def process_state(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc, or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after the closing parenthesis
    state, ppid = stat.rsplit(")", 1)[1].split()[:2]
    return state, int(ppid)


def is_running(pid: int) -> bool:
    """Whether `pid` runs: an exited process that its parent has not reaped yet (a zombie) does not."""
    found = process_state(pid)
    return found is not None and found[0] not in ("Z", "X")


def child_pids(parents: set[int]) -> list[int]:
    """The running processes whose parent is one of `parents` (a stub's engine process, for one)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            state = process_state(int(entry))
            if state is not None and state[1] in parents and state[0] not in ("Z", "X"):
                found.append(int(entry))
    return sorted(found)


def find_stubs(server_pid: int) -> dict[int, Stub]:
    """The live (non-zombie) Python-backend stubs whose parent is `server_pid`."""
    stubs = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        found = process_state(int(entry))
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if found is None or found[1] != server_pid or found[0] in ("Z", "X") \
                or not argv[0].endswith(STUB_BINARY.encode()):
            continue
        model = Path(argv[1].decode(errors="replace")).parent.parent.name if len(argv) > 1 else "?"
        stubs[int(entry)] = Stub(int(entry), model)
    return stubs


_REGION = re.compile(r"^mstar(\d+)_[0-9a-f]{6}_")


def remove_stale_shm(shm_dir: Path = SHM_DIR) -> int:
    """Remove the shared-memory regions that supervisors no longer alive left behind: regions are named
    `mstar<supervisor pid>_...` (`_launch`), so those whose pid runs no process belong to no server. Returns how
    many were removed."""
    removed = 0
    if not shm_dir.is_dir():
        return 0
    for region in shm_dir.iterdir():
        match = _REGION.match(region.name)
        if not match or int(match.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # alive (or another user's process): not ours to judge
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            region.unlink(missing_ok=True)
        except OSError:  # another user's region in the sticky /dev/shm: not ours to remove, and no reason to fail
            continue
        removed += 1
    return removed


class RestartBudget:
    """At most `limit` relaunches within RESTART_WINDOW_S: more is a crash loop."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.times: deque[float] = deque()

    def left(self) -> int:
        now = time.monotonic()
        while self.times and now - self.times[0] > RESTART_WINDOW_S:
            self.times.popleft()
        return max(self.limit - len(self.times), 0)

    def take(self) -> bool:
        """Spend one relaunch; False (nothing spent) when none is left."""
        if self.left() == 0:
            return False
        self.times.append(time.monotonic())
        return True


def expected_stubs(dep: Deployment) -> int:
    """The Python stubs a server of `dep` runs once ready: one per instance of each component (per listed GPU on a
    gpu placement), as the generated instance groups ask."""
    return sum(c.placement.total_instances for c in dep.components.values())


class TritonSupervisor:
    def __init__(self, repo: Path, dep: Deployment, ports: Ports, log_path: Path, *,
                 ready_timeout_s: float = 600.0, poll_s: float = 0.5) -> None:
        self.repo, self.dep, self.ports, self.log_path = repo, dep, ports, log_path
        self.ready_timeout_s, self.poll_s = ready_timeout_s, poll_s
        self.proc: subprocess.Popen | None = None
        self.stubs: dict[int, Stub] = {}
        self.num_expected = expected_stubs(dep)
        self.num_restarts = 0
        self.is_failed = False
        self.failure = ""  # why the server was given up (a crash loop, or a fault with restart_on_fault off)
        self._restarts = RestartBudget(dep.server.max_restarts)
        self._shm_prefix = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def ready_url(self) -> str:
        return self.ports.triton_ready_url

    def start(self, stop: threading.Event | None = None) -> None:
        """Launch tritonserver and wait until it is ready (raises if it is not; StopRequested, with the server
        stopped, as soon as `stop` is set)."""
        with self._lock:
            try:
                self._launch(stop)
            except StopRequested:
                self._kill(signal.SIGTERM, 10)
                raise

    def watch(self) -> None:
        """Check for deaths in a background thread until `stop`: a death relaunches the server, or with
        `server.restart_on_fault` off marks it failed (`is_failed`, `failure`) for `mstar serve` to stop."""
        self._thread = threading.Thread(target=self._watch, name="triton-supervisor", daemon=True)
        self._thread.start()

    def stop(self, drain_s: float | None = None) -> None:
        """SIGTERM: Triton refuses new requests and lets in-flight ones finish for up to its exit timeout
        (server.drain_timeout_s); SIGKILL whatever is left after `drain_s` more seconds."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        with self._lock:
            self._kill(signal.SIGTERM, self.dep.server.drain_timeout_s + 10 if drain_s is None else drain_s)

    def check(self) -> bool:
        """One supervision pass; returns whether a fault was found (and the server relaunched)."""
        with self._lock:
            if self._stop.is_set() or self.is_failed or self.proc is None:
                return False
            fault = self._fault()
            if fault is None:
                return False
            error_id = uuid.uuid4().hex[:12]
            if not self.dep.server.restart_on_fault:
                self._give_up(f"{fault} (error id {error_id}); server.restart_on_fault is off")
                return True
            if not self._restarts.take():
                self._give_up(f"{fault} (error id {error_id}); {self._restarts.limit} relaunches within "
                              f"{RESTART_WINDOW_S:.0f} s already (server.max_restarts): a crash loop")
                return True
            logger.error("[supervisor] error id %s: %s; every in-flight request fails; relaunching tritonserver",
                         error_id, fault)
            try:
                self._restart()
            except Exception as exc:  # noqa: BLE001 - not ready within the start timeout, or it exited
                # As at the first start, a server that cannot come up ends `mstar serve`. Retried instead, each
                # try took the whole start timeout, so with the defaults (600 s, 5 relaunches in 600 s) the
                # budget never ran out and the server relaunched every 10 minutes for ever, serving nothing.
                self._give_up(f"{fault} (error id {error_id}); the relaunched tritonserver did not come up: {exc}")
            return True

    # ---- internals ------------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception:  # keep supervising (a failed relaunch itself gives up, in check)
                logger.exception("[supervisor] supervision pass failed")

    def _fault(self) -> str | None:
        if self.proc.poll() is not None:
            return f"tritonserver (pid {self.proc.pid}) exited with code {self.proc.returncode}"
        alive = find_stubs(self.proc.pid)
        if dead := [stub for pid, stub in self.stubs.items() if pid not in alive]:
            return "Python stub(s) died: " + ", ".join(f"{s.model} (pid {s.pid})" for s in dead)
        if len(alive) < self.num_expected:  # e.g. one that died before the list after a relaunch was taken
            return f"{len(alive)} of the deployment's {self.num_expected} Python stubs are running"
        self.stubs = alive  # (a stub that was not up when the list was taken is watched from now on)
        return None

    def _give_up(self, why: str) -> None:
        logger.error("[supervisor] %s: stopping tritonserver", why)
        self.failure = why
        self.is_failed = True
        self._kill(signal.SIGKILL, 10)

    def _restart(self) -> None:
        self._kill(signal.SIGKILL, 10)
        self.num_restarts += 1
        self._launch()

    def _launch(self, stop: threading.Event | None = None) -> None:
        stale = remove_stale_shm()
        if stale:
            logger.info("[supervisor] removed %d shared-memory region(s) left by supervisors no longer running", stale)
        self._shm_prefix = f"mstar{os.getpid()}_{uuid.uuid4().hex[:6]}_"
        prefix_arg = f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}"
        progress = LogEcho(self.log_path)  # the captures' progress on the console, as the docs promise
        self.proc = start_triton(self.repo, self.dep, self.ports, self.log_path, extra_args=(prefix_arg,))
        wait_ready(self.ready_url, self.proc, self.ready_timeout_s, "tritonserver", stop=stop, progress=progress)
        self.stubs = find_stubs(self.proc.pid)
        logger.info("[supervisor] tritonserver pid %d ready with %d of %d stub(s): %s", self.proc.pid,
                    len(self.stubs), self.num_expected, sorted({s.model for s in self.stubs.values()}))

    def _kill(self, sig: int, grace_s: float) -> None:
        proc = self.proc
        if proc is None:
            return
        try:
            if proc.poll() is None:
                os.killpg(proc.pid, sig)
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
            os.killpg(proc.pid, signal.SIGKILL)  # stubs left behind by a server that died first
        except ProcessLookupError:
            pass
        self._remove_shm()

    def _remove_shm(self) -> None:
        if not self._shm_prefix or not SHM_DIR.is_dir():
            return
        for region in SHM_DIR.glob(self._shm_prefix + "*"):
            region.unlink(missing_ok=True)
