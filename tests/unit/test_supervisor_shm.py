"""The supervisor removes the shared-memory regions of supervisors no longer running (a test or a server killed
before its stop), and only those."""

from __future__ import annotations

import os
import subprocess
import sys

from mstar_common.supervisor import remove_stale_shm


def test_only_regions_of_supervisors_no_longer_running_are_removed(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(gone.stdout)  # exited: no process has that pid (barring reuse within this test)
    names = {
        f"mstar{dead_pid}_0a1b2c_9f8e": False,
        f"mstar{os.getpid()}_0a1b2c_1234": True,  # this process: kept
        f"mstar{os.getppid()}_abcdef_5678": True,  # alive: kept
        "mstar_not_ours": True,  # another naming
        "other-region": True,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert remove_stale_shm(tmp_path) == 1
    assert {p.name for p in tmp_path.iterdir()} == {name for name, kept in names.items() if kept}
    assert remove_stale_shm(tmp_path / "missing") == 0
