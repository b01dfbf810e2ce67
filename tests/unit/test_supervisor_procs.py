"""The supervisor's /proc readers: a process's state and parent, whether it runs, and a set of parents' children."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from mstar_common.supervisor import child_pids, is_running, process_state


def test_a_child_is_found_runs_and_then_is_a_zombie_until_reaped():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        state, parent = process_state(child.pid)
        assert parent == os.getpid() and state in ("R", "S", "D")  # D: a fresh interpreter reading its files
        assert is_running(child.pid) and child.pid in child_pids({os.getpid()})
        assert child_pids({child.pid}) == []  # it started none
        child.kill()
        deadline = time.monotonic() + 10
        while process_state(child.pid)[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not is_running(child.pid)  # exited, not yet reaped: a zombie does not run
        assert child.pid not in child_pids({os.getpid()})
    finally:
        child.kill()
        child.wait()
    assert child.pid not in child_pids({os.getpid()})  # reaped (its number may already serve another process)
