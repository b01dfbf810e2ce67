"""An autoregressive component's step loop in a process of its own (`MSTAR_ENGINE_PROCESS=1`).

Which components: those whose family's `engine_process_refusal` allows it (qwen3, llama, and orpheus's LM unless its
codec runs in the LM's stub): requests of token ids and sampling parameters alone, and no other user of the weights
in the stub. The others keep their engine in the stub and log why (backends/node_setup.py).

Why. In the component's stub process the step loop shares one GIL with the output pump (detokenizing, sending
responses), Triton's `execute` threads and the metrics sampler. At 64 streams on the H200 the loop's own Python is
~0.25 ms of a ~2.6 ms step, yet it spent 1.36-1.56 ms of each step launching (docs/benchmarks.md, 2026-12-05), and
each of the pump's sends took ~1 ms; with more sender threads the loop's host time per step tripled. Here the engine
(scheduler, KV pages, graphs, step loop) runs in a child process with a GIL of its own, and the stub keeps what
needs Triton: parsing, the output pump and the metrics. This is how vLLM's v1 engine core and SGLang's scheduler
sit apart from their front ends.

Processes. The stub starts `python -m mstar_common.engine.engine_process FD` (the interpreter the stub runs, or
`MSTAR_ENGINE_PYTHON`), with one end of a socket pair as FD and the stub's stdout/stderr (the server log). The child
builds the component exactly as the stub would (`Family.build_component`: weights, KV pool, GEMV tuning, graph
capture) and answers `ready` with the engine's limits and the runtime without its engine (the tokenizer, pickled).
Messages are pickled tuples (`multiprocessing.connection`):

    stub -> engine: ("add", request_id, prompt_ids, params, timeout_s, request_state), ("cancel", request_id), ("stop",)
    engine -> stub: ("ready", EngineInfo) | ("failed", traceback), then ("out", outputs, stats) ... ("bye",)

`outputs` is every `on_output` call the step loop made since the last message, in order (one message a step when
the stub keeps up), `stats` the engine's `stats()` every STATS_S and with every message that ends a request (None
otherwise; sent alone when idle).

Admission. The stub checks each request against the engine's rules (`check_request`) and its capacity itself (it
knows every live request), so `RemoteEngine.add_request` raises what `AREngine.add_request` raises, at once, with
no round trip. Deadlines and queue limits run in the engine, as in the stub.

Failure. An engine process that dies ends every live request with a server error and refuses new ones as
unavailable, then calls the stub's `on_exit`: the Triton node ends its stub (backends/node_setup.py), so that `mstar
serve`'s supervisor relaunches the server as for any dead stub. The log holds the child's last words. The child
exits when the stub closes its end of the socket, also when the stub dies, so a GPU is never held by an orphan. It
ignores SIGTERM and SIGINT, which a stopping server's process group gets: it stops when the stub stops it, after
tritonserver's drain.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from mstar_common import wire
from mstar_common.config import env_switch
from mstar_common.devices import on_device, use_device
from mstar_common.engine.admission import Admission, AdmissionRefused, EngineUnavailable
from mstar_common.engine.ar_engine import check_request
from mstar_common.engine.sequence import OutputCallback
from mstar_common.engine.types import FinishReason, SamplingParams

logger = logging.getLogger(__name__)

SWITCH = "MSTAR_ENGINE_PROCESS"
STATS_S = 0.1  # how often the engine sends its stats() (with its outputs when busy): the metrics sampler's period
STOP_WAIT_S = 10.0  # how long a stopping stub waits for the engine process before it kills it


def enabled() -> bool:
    return env_switch("MSTAR_ENGINE_PROCESS", False)


_LOG_NAME_ENV = "MSTAR_ENGINE_LOG_NAME"  # set for the child by start_engine_process


@dataclass(slots=True)
class EngineSpec:
    """What the child builds: one component of a deployment, as `backends.node_setup.NodeSetup.build` does."""

    model_name: str
    family: str
    component: str
    deployment: Any  # mstar_common.config.Deployment
    checkpoint: Path
    device: str
    instance: str = ""  # the stub's Triton instance, named in the child's log lines


@dataclass(slots=True)
class EngineInfo:
    """The child's answer once its engine is built: the limits the stub checks requests against, and the runtime
    (tokenizer, request parsing) with its `engine` left out."""

    vocab_size: int
    max_model_len: int
    page_size: int
    num_kv_pages: int
    max_num_seqs: int
    max_queue: int | None
    runtime: Any
    stats: dict


# ---- the stub's side -----------------------------------------------------------------------------------------------


def chosen_python() -> str | None:
    """`MSTAR_ENGINE_PYTHON` (None: unset or empty): an executable file, or a command on PATH; anything else is
    refused naming it (the engine process's start failed on a FileNotFoundError naming a path)."""
    chosen = os.environ.get("MSTAR_ENGINE_PYTHON", "").strip()
    if not chosen:
        return None
    # a bare name is looked up as the stubs will: tritonserver runs them with the server's bin folder (the venv's,
    # mstar_common/triton_env.py) ahead of PATH, so `python` names the venv's though no `python` is on PATH here
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    is_file = os.path.isfile(chosen) and os.access(chosen, os.X_OK)
    if is_file or os.sep not in chosen and shutil.which(chosen, path=path):
        return chosen
    raise ValueError(f"MSTAR_ENGINE_PYTHON={chosen!r}: expected a Python interpreter (an executable file, or a "
                     "command on PATH); there is none")


def child_python() -> str:
    """The interpreter for the engine process: `MSTAR_ENGINE_PYTHON`, else the stub's own (its `sys.executable` when
    that is a Python, else `pythonX.Y` beside `sys.executable` or on PATH)."""
    chosen = chosen_python()
    if chosen:
        return chosen
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    exe = sys.executable or ""
    if Path(exe).name.startswith("python") and os.access(exe, os.X_OK):
        return exe
    beside = Path(sys.exec_prefix) / "bin" / version
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(version) or shutil.which("python3")
    if found is None:
        raise RuntimeError(f"{SWITCH}=1: no Python interpreter found for the engine process; set MSTAR_ENGINE_PYTHON")
    return found


def start_engine_process(spec: EngineSpec, ready_timeout_s: float | None = None,
                         on_exit: Callable[[str], None] | None = None):
    """Start the child, wait until its engine is built, and return the runtime with a `RemoteEngine` as its engine.
    A child that fails to build raises RuntimeError with its traceback (the model then fails to load). `on_exit` is
    called with the reason if the child exits without being stopped, after its live requests have been ended."""
    ours, theirs = socket.socketpair()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env[_LOG_NAME_ENV] = f"{spec.instance or spec.model_name} engine"
    # the stub's pid goes with it: a stub that dies while the child still imports torch leaves it another parent
    # before it could ask for its own (it then built the whole engine, holding the device, for nobody)
    command = [child_python(), "-m", "mstar_common.engine.engine_process", str(theirs.fileno()), str(os.getpid())]
    process = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
    theirs.close()
    conn = Connection(ours.detach())
    logger.info("[%s] engine process %d started (%s)", spec.model_name, process.pid, command[0])
    try:
        conn.send(spec)
        message = _await_ready(conn, process, ready_timeout_s)
    except BaseException:
        process.kill()
        process.wait()
        conn.close()
        raise
    if message[0] != "ready":
        _stop_child(process, STOP_WAIT_S)
        conn.close()
        raise RuntimeError(f"{spec.model_name}: the engine process failed to build the component:\n{message[1]}")
    info: EngineInfo = message[1]
    runtime = info.runtime
    runtime.engine = RemoteEngine(conn, process, info, spec.model_name, on_exit)
    return runtime


def _await_ready(conn: Connection, process: subprocess.Popen, timeout_s: float | None) -> tuple:
    started = time.monotonic()
    while not conn.poll(1.0):
        if process.poll() is not None:
            raise RuntimeError(f"the engine process exited with code {process.returncode} before it was ready "
                               "(its log is above)")
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            raise RuntimeError(f"the engine process was not ready within {timeout_s:g} s")
    try:
        return conn.recv()
    except EOFError:
        _stop_child(process, STOP_WAIT_S)
        raise RuntimeError(f"the engine process exited with code {process.returncode} before it was ready "
                           "(its log is above)") from None


def _stop_child(process: subprocess.Popen, wait_s: float) -> None:
    try:
        process.wait(wait_s)
    except subprocess.TimeoutExpired:
        logger.error("engine process %d did not exit within %.0f s; killing it", process.pid, wait_s)
        process.kill()
        process.wait()


class RemoteEngine:
    """The stub's handle on an engine in its own process, with the calls the node, the output pump, the metrics
    and the stall watch make of an `AREngine`: add_request, cancel, start, shutdown, stats, num_live, num_steps."""

    def __init__(self, conn: Connection, process: subprocess.Popen, info: EngineInfo, name: str = "engine",
                 on_exit: Callable[[str], None] | None = None) -> None:
        self._conn, self._process, self.info, self._name = conn, process, info, name
        self._on_exit = on_exit
        self.vocab_size, self.max_model_len = info.vocab_size, info.max_model_len
        self.admission = Admission(info.max_num_seqs, info.max_queue, None, None)  # capacity only
        self._lock = threading.Lock()  # guards _live, _is_closed, _exit and the sends
        self._live: dict[str, OutputCallback] = {}
        self._stats = dict(info.stats)
        self._is_closed = False
        self._exit: str | None = None  # why the engine process is gone, once it is
        self._receiver = threading.Thread(target=self._receive, name=f"{name}-engine-rx", daemon=True)
        self._receiver.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def num_steps(self) -> int:
        return int(self._stats.get("num_steps", 0))

    def stats(self) -> dict:
        """The engine's stats() as it last sent them (every STATS_S and with each message that ends a request), with
        the stub's refusals added."""
        stats = dict(self._stats)
        stats["num_refused"] = stats.get("num_refused", 0) + self.admission.num_refused
        return stats

    def start(self) -> None:
        """The engine's loop runs from the moment it was ready; kept for the node's start-up sequence."""

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, on_output: OutputCallback,
                    timeout_s: float | None = None, request_state: Any = None) -> None:
        """As `AREngine.add_request`: raises ValueError/AdmissionError naming the field and the rule, and
        AdmissionRefused when the component cannot take the request now."""
        prompt = check_request(prompt_ids, params, self.vocab_size, self.max_model_len, self.info.page_size,
                               self.info.num_kv_pages)
        with self._lock:
            if self._exit is not None:
                raise EngineUnavailable(f"the component's engine process has stopped ({self._exit})")
            if self._is_closed:
                raise EngineUnavailable("the component is shut down and accepts no requests")
            if request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already in use by a live request")
            self.admission.check_capacity(len(self._live))
            self._live[request_id] = on_output
            try:
                self._conn.send(("add", request_id, prompt, params, timeout_s, request_state))
            except OSError as exc:
                del self._live[request_id]
                raise EngineUnavailable(f"the component's engine process cannot be reached ({exc})") from None

    def cancel(self, request_id: str) -> None:
        """Cancel a live request within a step of the engine's (one CANCELLED call); unknown ids are ignored."""
        with self._lock:
            if request_id not in self._live or self._exit is not None:
                return
            try:
                self._conn.send(("cancel", request_id))
            except OSError:
                pass  # the receiver ends every live request once it sees the process gone

    def shutdown(self, timeout: float = STOP_WAIT_S) -> None:
        """Stop the engine process; every request not yet finished gets CANCELLED. Safe to call more than once."""
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
        if threading.current_thread() is not self._receiver:
            self._receiver.join(timeout)
        _stop_child(self._process, timeout)
        self._end_all(FinishReason.CANCELLED, None)

    def _receive(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "bye":
                break
            _, outputs, stats = message
            if stats is not None:
                self._stats = stats
            with self._lock:  # once a message: a step's outputs, whose finals leave the live set
                live = self._live
                calls = [(live.get(out[0]) if out[2] is None else live.pop(out[0], None), out) for out in outputs]
            for callback, (request_id, token_ids, finish, error) in calls:
                if callback is None:
                    continue
                try:
                    callback(request_id, token_ids, finish, error)
                except Exception:  # noqa: BLE001 - one stream's callback must not stop every other stream
                    logger.exception("on_output for request %r raised", request_id)
        self._conn.close()
        if not self._is_closed:
            code = self._process.wait()
            self._exit = f"exit code {code}"
            logger.error("[%s] the engine process %d exited (code %s); failing its %d live requests", self._name,
                         self._process.pid, code, len(self._live))
            self._end_all(FinishReason.ERROR, f"the component's engine process exited (code {code})")
            if self._on_exit is not None:
                self._on_exit(self._exit)

    def _end_all(self, reason: FinishReason, error: str | None) -> None:
        with self._lock:
            live, self._live = self._live, {}
        for request_id, callback in live.items():
            try:
                callback(request_id, [], reason, error)
            except Exception:  # noqa: BLE001
                logger.exception("on_output for request %r raised", request_id)


# ---- the engine's side ---------------------------------------------------------------------------------------------


class _Outbox:
    """The step loop's `on_output`: queue only; a sender thread sends everything queued as one message."""

    _CLOSE = object()

    def __init__(self, conn: Connection, engine: Any) -> None:
        self._conn, self._engine = conn, engine
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.is_broken = threading.Event()  # the stub is gone
        self._thread = threading.Thread(target=on_device(self._run), name="engine-outbox", daemon=True)
        self._thread.start()

    def on_output(self, request_id: str, token_ids: list[int], finish: FinishReason | None, error: str | None) -> None:
        self._queue.put((request_id, list(token_ids), finish, error))

    def close(self) -> None:
        """Send what is queued, then `bye`."""
        self._queue.put(self._CLOSE)
        self._thread.join(STOP_WAIT_S)

    def _run(self) -> None:
        next_stats = 0.0
        closing = False
        while not closing:
            try:
                first = self._queue.get(timeout=STATS_S)
            except queue.Empty:
                first = None
            batch = []
            for item in self._take(first):
                if item is self._CLOSE:
                    closing = True
                else:
                    batch.append(item)
            now = time.monotonic()
            stats = None
            # due, or the batch ends a request: its stats (taken after its step counted itself) then reach the stub
            # with its final, before the client can see that final, so a reader of the metrics after a level's
            # last final (bench/cli.py's bracket) finds the level's steps in the next sample (they came up to
            # STATS_S later)
            if now >= next_stats or any(item[2] is not None or item[3] is not None for item in batch):
                stats, next_stats = self._engine.stats(), now + STATS_S
            if not (batch or stats):
                continue
            try:
                self._conn.send(("out", batch, stats))
            except OSError:
                self.is_broken.set()
                return
        try:
            self._conn.send(("bye",))
        except OSError:
            self.is_broken.set()

    def _take(self, first):
        if first is not None:
            yield first
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return


def _build(spec: EngineSpec) -> tuple[Any, EngineInfo]:
    from mstar_common.families.registry import get_family

    use_device(spec.device)  # this process's threads and launches on the instance's GPU (mstar_common/devices.py)
    runtime = get_family(spec.family).build_component(spec.component, spec.deployment, spec.checkpoint, spec.device)
    engine = runtime.engine
    config = engine.config
    runtime.engine = None
    info = EngineInfo(engine.vocab_size, engine.max_model_len, config.page_size, config.num_kv_pages,
                      config.max_num_seqs, config.max_queue, runtime, engine.stats())
    return engine, info


def _serve(conn: Connection, engine: Any, outbox: _Outbox) -> None:
    """Hand the stub's requests and cancels to the engine until it says stop or goes away."""
    while not outbox.is_broken.is_set():
        try:
            message = conn.recv()
        except (EOFError, OSError):
            logger.info("the stub closed the connection; stopping")
            return
        kind = message[0]
        if kind == "add":
            _, request_id, prompt_ids, params, timeout_s, state = message
            extra = {} if state is None else {"request_state": state}
            try:
                engine.add_request(request_id, prompt_ids, params, outbox.on_output, timeout_s=timeout_s, **extra)
            except AdmissionRefused as exc:
                outbox.on_output(request_id, [], FinishReason.ERROR, exc.wire_message)
            except ValueError as exc:
                outbox.on_output(request_id, [], FinishReason.ERROR, wire.invalid_request_message(str(exc)))
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the engine
                logger.exception("add_request %r failed", request_id)
                outbox.on_output(request_id, [], FinishReason.ERROR, f"adding the request failed: {exc}")
        elif kind == "cancel":
            engine.cancel(message[1])
        elif kind == "stop":
            return
        else:
            logger.error("unknown message %r from the stub; ignored", kind)


def watch_parent(parent: int, until: threading.Event, interval_s: float = 0.5) -> threading.Thread:
    """Until `until` is set, end this process as soon as its parent (the stub) is gone. Nothing reads the socket
    while the engine builds (weights, tuning, graph captures: minutes), so without this a stub killed during the
    build would leave this process holding the device until the build ended."""
    def run() -> None:
        while not until.wait(interval_s):
            if os.getppid() != parent:
                logger.error("the stub (pid %d) is gone while the engine was building: exiting", parent)
                sys.stderr.flush()
                os._exit(1)

    thread = threading.Thread(target=run, name="parent-watch", daemon=True)
    thread.start()
    return thread


def main(argv: list[str]) -> int:
    import faulthandler

    from mstar_common.gc_policy import settle_heap
    from mstar_common.gil import apply_switch_interval
    from mstar_common.process_log import configure_logging

    configure_logging(os.environ.get(_LOG_NAME_ENV, "engine"))  # its lines go to the server's log too
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # The server's stop signals reach its whole process group, this process too: the stub decides when the engine
    # stops (after tritonserver's drain, at the model's finalize), and its socket closing stops it in any case.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(argv[1]))
    parent = int(argv[2]) if len(argv) > 2 else os.getppid()
    if os.getppid() != parent:  # the stub died while this process started (imports take seconds)
        logger.error("the stub (pid %d) is gone before the engine was built: exiting", parent)
        return 1
    built = threading.Event()  # from `ready` on, the socket's end stops this process (`_serve`)
    watch_parent(parent, built)
    try:
        spec: EngineSpec = conn.recv()
    except EOFError:
        return 1
    name = f"{spec.model_name} engine process {os.getpid()}"
    try:
        apply_switch_interval()
        engine, info = _build(spec)
    except Exception:  # noqa: BLE001 - the stub shows the traceback and fails the model's load
        logger.exception("[%s] building the component failed", name)
        with contextlib.suppress(OSError):
            conn.send(("failed", traceback.format_exc()))
        return 1
    try:
        conn.send(("ready", info))
    except OSError:  # the stub went away as the build ended
        return 1
    built.set()
    outbox = _Outbox(conn, engine)  # after `ready`: from here on only the outbox's thread sends
    engine.start()
    settle_heap(name)
    logger.info("[%s] ready on %s", name, spec.device)
    try:
        _serve(conn, engine, outbox)
    finally:
        engine.shutdown()  # every live request gets its CANCELLED call, through the outbox
        outbox.close()
        conn.close()
    logger.info("[%s] stopped", name)
    return 0


if __name__ == "__main__":
    # run as `-m`, this file is `__main__`: the messages' classes must pickle under the module's own name
    from mstar_common.engine import engine_process

    code = engine_process.main(sys.argv)
    # Skip the interpreter's teardown: the engine is stopped and its outputs sent, and tearing down the kernel
    # libraries' bindings only fills the server log with their leak reports.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
