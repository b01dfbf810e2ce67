"""Run folders: a new start deletes the oldest folders of stopped servers beyond the number kept, and never a
folder whose process runs, another deployment's, or one that is not ours."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from mstar_common import run_folders


def _folder(root, name, pid, age_s):
    folder = root / name
    folder.mkdir()
    if pid is not None:
        (folder / run_folders.OWNER).write_text(f"{pid}\n")
    stamp = time.time() - age_s
    os.utime(folder, (stamp, stamp))
    return folder


def test_a_folder_another_start_pruned_a_moment_ago_is_passed_over(tmp_path, monkeypatch):
    """Two starts of one deployment prune at once: a folder the other removed between the glob and the sort raised
    FileNotFoundError, and `mstar serve` refused to start."""
    import shutil

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stopped = [_folder(tmp_path, f"mstar-q-{i:08d}", int(dead.stdout), age_s=100 + i) for i in range(3)]
    judged = run_folders._stopped

    def other_start_prunes(folder):
        verdict = judged(folder)
        if folder == stopped[1]:
            shutil.rmtree(folder)  # the other process, between this one's check and its sort
        return verdict

    monkeypatch.setattr(run_folders, "_stopped", other_start_prunes)
    assert run_folders.prune(tmp_path, "mstar-q-", 1) == [stopped[2]]
    assert stopped[0].exists() and not stopped[2].exists()


def test_the_oldest_stopped_folders_beyond_the_kept_number_are_deleted(tmp_path, monkeypatch):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    gone = int(dead.stdout)  # a pid whose process has exited
    stopped = [_folder(tmp_path, f"mstar-q-{i:08d}", gone, age_s=100 + i) for i in range(4)]  # newest first
    running = _folder(tmp_path, "mstar-q-running0", os.getpid(), age_s=1000)
    foreign = _folder(tmp_path, "mstar-q-noowner0", None, age_s=1000)
    other = _folder(tmp_path, "mstar-q-b-0000000", gone, age_s=1000)  # deployment "q-b": not "q"'s
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    new = run_folders.make("mstar-q-", keep=2)
    assert new.parent == tmp_path and (new / run_folders.OWNER).read_text() == f"{os.getpid()}\n"
    assert [f.exists() for f in stopped] == [True, True, False, False]
    assert running.exists() and foreign.exists() and other.exists()
    assert run_folders.make("mstar-q-", keep=0) and not any(f.exists() for f in stopped)
    assert new.exists()  # this process still runs
