"""A process whose parent dies is ended by its watcher (mstar_common/orphan_watch.py) within the grace, even with
its interpreter wedged (a C call holding the GIL, as a stub's metric call to a dead server does), as a Triton
stub must be when its server is gone; one whose parent lives is left alone, and the watcher ends with it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

CHILD = textwrap.dedent("""
    import ctypes, os, signal, sys
    from mstar_common.orphan_watch import kill_when_orphaned
    watcher = kill_when_orphaned(grace_s=0.5)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(os.getpid(), watcher.pid, flush=True)
    if sys.argv[1] == "wedged":
        ctypes.PyDLL(None).sleep(60)  # a C call that keeps the GIL: no Python thread runs again
    else:
        sys.stdin.readline()  # ends when the parent says so
""")
PARENT = textwrap.dedent("""
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    print(child.stdout.readline().strip(), flush=True)
    sys.stdin.readline()
    child.stdin.write("end\\n"); child.stdin.flush(); child.wait()
    print("child ended", flush=True)
    sys.stdin.readline()
""")


def _alive(pid: int) -> bool:
    """Running (a zombie that no reaper has collected yet has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _start(mode: str) -> tuple[subprocess.Popen, int, int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, mode], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    child, watcher = map(int, parent.stdout.readline().split())
    return parent, child, watcher


@pytest.mark.parametrize("mode, kill", [("wedged", "parent"), ("idle", "parent"), ("idle", "group")])
def test_an_orphan_is_killed_after_its_grace_even_when_wedged(mode, kill):
    """`kill`: the parent alone, or its whole process group as `mstar serve` and the tests' launcher stop a server
    (stubs included): the watcher, in a session of its own, survives that to clean up."""
    from mstar_common.walk_cancel import CancelBoard, board_dir

    parent, child, watcher = _start(mode)
    board = CancelBoard(board_dir(parent.pid))  # the dead server's walk cancel board goes with it
    try:
        board.post("req#1.0/denoise")
        time.sleep(1.5)
        assert _alive(child) and _alive(watcher)  # the parent lives: the watch keeps still
        if kill == "group":
            os.killpg(parent.pid, signal.SIGKILL)
        else:
            parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _wait_gone(child, 10), "the orphan was not ended"
        assert _wait_gone(watcher, 10), "the watcher outlived the stub"
        assert not os.path.exists(board.directory)
    finally:
        shutil.rmtree(board.directory, ignore_errors=True)
        if parent.poll() is None:
            parent.kill()


def test_the_watcher_ends_with_a_stub_that_ends_normally():
    parent, child, watcher = _start("idle")
    try:
        parent.stdin.write("go\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "child ended"
        assert _wait_gone(watcher, 5)
    finally:
        parent.kill()

