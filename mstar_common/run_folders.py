"""The scratch folders `mstar serve` and `mstar bench serve` start their servers from (the generated repository and
the logs), under the system's temporary directory. A folder is kept after its server stops, for its logs; each new
start deletes the oldest folders of stopped servers beyond a number kept (`server.keep_run_folders` for `mstar
serve`). A folder is known as ours, and as stopped, by the `owner.pid` file its starting process writes there:
folders without one, and folders whose process still runs, are never touched."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from mstar_common.config import DeploymentError
from mstar_common.triton_env import shell_unsafe

OWNER = "owner.pid"
_SUFFIX = re.compile(r"[a-z0-9_]{8}")  # what tempfile.mkdtemp adds to the prefix


def usable_root() -> Path:
    """The run folders' parent ($TMPDIR), or a DeploymentError where a shell would split its path."""
    root = Path(tempfile.gettempdir())
    if reason := shell_unsafe(root):
        raise DeploymentError(f"the run folder's parent ($TMPDIR): {reason}; set TMPDIR to such a folder")
    return root


def make(prefix: str, keep: int) -> Path:
    """A new folder `<tmp>/<prefix>XXXXXXXX` owned by this process, after deleting the `<prefix>*` folders of
    stopped servers beyond the newest `keep`. `prefix` ends with the name part that makes a family of folders
    (e.g. `mstar-qwen3-tiny-`), so one deployment's starts never delete another's folders. A temporary directory
    whose path a shell would split is refused (DeploymentError): the repository is generated inside it."""
    root = usable_root()
    prune(root, prefix, keep)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    (folder / OWNER).write_text(f"{os.getpid()}\n")
    return folder


def prune(root: Path, prefix: str, keep: int) -> list[Path]:
    """Delete the folders `root/<prefix>*` of stopped servers beyond the newest `keep` (by modification time);
    returns the deleted ones."""
    dated = []
    for folder in root.glob(f"{prefix}*"):  # `mstar-a-` is not `mstar-a-b-`'s prefix here
        if folder.is_dir() and _SUFFIX.fullmatch(folder.name[len(prefix):]) and _stopped(folder):
            try:
                dated.append((folder.stat().st_mtime, folder))
            except FileNotFoundError:  # another start of this deployment pruned it a moment ago
                continue
    stopped = [folder for _, folder in sorted(dated, key=lambda pair: pair[0], reverse=True)]
    for folder in stopped[keep:]:
        shutil.rmtree(folder, ignore_errors=True)
    return stopped[keep:]


def _stopped(folder: Path) -> bool:
    try:
        pid = int((folder / OWNER).read_text().strip())
    except (OSError, ValueError):
        return False  # not one of ours (or not readable): left alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's live process
    return False
