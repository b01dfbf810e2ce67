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


def test_a_stale_region_this_user_may_not_remove_is_skipped_not_fatal(tmp_path, monkeypatch):
    """Another user's stale region in the sticky /dev/shm raised PermissionError out of every `mstar serve` start
    (and made a relaunch give up after a recoverable fault)."""
    from pathlib import Path

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(gone.stdout)
    theirs, ours = tmp_path / f"mstar{dead_pid}_0a1b2c_theirs", tmp_path / f"mstar{dead_pid}_0a1b2c_ours"
    for region in (theirs, ours):
        region.write_bytes(b"x")
    unlink = Path.unlink

    def refuse_theirs(self, missing_ok=False):
        if self.name.endswith("_theirs"):
            raise PermissionError(1, "Operation not permitted", str(self))
        return unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse_theirs)
    assert remove_stale_shm(tmp_path) == 1
    assert theirs.exists() and not ours.exists()
