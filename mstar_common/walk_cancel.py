"""How a walk stops its component requests when its client goes away: Triton 2.51 cannot cancel a BLS request.

The walk router opens each component request ("hop") with an id of the form `<walk id>/<component>`. When it
sees its own client gone, it posts the ids of its hops in flight on a board: a directory that the server's
stubs share (`/dev/shm/mstar-walks-<server pid>`, the stubs' common parent), one empty file per id, named by
a hash of the id. A component asks the board about a request whose id has that form wherever it asks Triton
whether the client cancelled (`backends/responder.py`: one `stat`, ~1 us), and stops the work as for a cancel:
a denoise job at its next step, a batched item before it runs, an LLM row at its next step. The walk removes
an entry once its hop has ended, and the board with its last entry; each stub's orphan watch removes it once
the server is gone (mstar_common/orphan_watch.py).
"""

from __future__ import annotations

import hashlib
import os
import tempfile

BOARD_PREFIX = "mstar-walks-"


def board_dir(server_pid: int | None = None) -> str:
    """The board of the server `server_pid` (default: this stub's parent, the server)."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(root, f"{BOARD_PREFIX}{server_pid if server_pid is not None else os.getppid()}")


def is_hop_id(request_id: str) -> bool:
    """Whether a request id has a walk hop's form (any other request never asks the board)."""
    return "/" in request_id


def _entry(directory: str, request_id: str) -> str:
    return os.path.join(directory, hashlib.blake2b(request_id.encode(errors="replace"), digest_size=16).hexdigest())


class CancelBoard:
    def __init__(self, directory: str | None = None):
        self.directory = directory or board_dir()

    def post(self, request_id: str) -> None:
        """Ask the component serving `request_id` to stop it."""
        for _ in range(8):  # another walk's `clear` may remove the empty board between the two calls
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            try:
                with open(_entry(self.directory, request_id), "wb"):
                    return
            except FileNotFoundError:
                continue
        raise OSError(f"could not post {request_id!r} on the walk cancel board {self.directory}")

    def clear(self, request_id: str) -> None:
        """Take `request_id` off the board, and the board away once it is empty (it exists only while a post
        does, so a server that is killed leaves nothing behind unless a cancel was in flight)."""
        try:
            os.remove(_entry(self.directory, request_id))
        except FileNotFoundError:
            pass
        try:
            os.rmdir(self.directory)  # refused while another walk's entry is on it
        except OSError:
            pass

    def is_posted(self, request_id: str) -> bool:
        return os.path.exists(_entry(self.directory, request_id))
