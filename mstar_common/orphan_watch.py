"""A stub whose tritonserver is gone ends, even when its interpreter is wedged.

Triton's Python-backend stub has its own parent-death monitor, but it can deadlock. Seen on the CPU machine
(2026-12-05): SIGKILL a tritonserver and its stub lives on, reparented to init, ignoring SIGTERM, holding its
shared memory (and, on a GPU, its device memory). gdb showed why: a thread setting a custom metric waits in
`Stub::SendMessage` for a server that will never answer, holding the GIL, and the stub's own monitor waits on a
mutex. A watch thread in the stub would need that GIL, so the watch is a separate, tiny `/bin/sh` process: while
the stub's parent is still the server that started it, it sleeps; once the stub is orphaned it gives the stub
`grace_s` to end by itself, then sends it SIGKILL, and removes the stub's shared-memory region (the server,
killed, could not) and the server's walk cancel board. It exits when the stub does. It runs in a session of its
own, so that a stop that kills the server's whole process group, stubs included, still leaves it to clean up.
"""

from __future__ import annotations

import os
import re
import subprocess

GRACE_S = 5

_WATCH = """
server=$1 stub=$2 grace=$3 region=$4
# a /proc/PID/stat field after skipping N: 2 -> the state, 3 -> the parent's pid; "" once the process is gone
field() { n=$2; s=$(cat /proc/"$1"/stat 2>/dev/null) || { echo; return; }; set -- $s; shift "$n"; echo "$1"; }
while [ "$(field "$stub" 3)" = "$server" ]; do sleep 1; done
if [ -e /proc/"$stub" ]; then  # reparented: its server is gone
    echo "[orphan-watch] stub $stub outlived its server $server; SIGKILL in $grace s unless it ends" >&2
    sleep "$grace"
    [ -e /proc/"$stub" ] && kill -9 "$stub"
elif [ -e /proc/"$server" ] && [ "$(field "$server" 2)" != Z ]; then
    exit 0  # the server reaped its stub: a normal unload
fi
# the server and the stub are gone: nobody else maps the stub's shared-memory region, which the server would
# have removed had it exited normally
if [ -n "$region" ]; then
    for _ in 1 2 3 4 5 6 7 8 9 10; do [ -e /proc/"$stub" ] || break; sleep 0.5; done
    rm -f /dev/shm/"$region"
fi
rm -rf /dev/shm/mstar-walks-"$server"  # the server's walk cancel board (mstar_common/walk_cancel.py), if any
exit 0
"""
_REGION = re.compile(r"[A-Za-z0-9_.-]{1,200}")


def kill_when_orphaned(grace_s: float = GRACE_S) -> subprocess.Popen | None:
    """Watch this process (a stub) from outside; returns the watcher, or None where /proc is missing."""
    if not os.path.isdir(f"/proc/{os.getpid()}"):
        return None
    args = ["/bin/sh", "-c", _WATCH, "orphan-watch", str(os.getppid()), str(os.getpid()), f"{grace_s:g}",
            stub_shm_region()]
    # A session of its own: a stop that kills the server's process group (mstar serve's, the tests' launcher)
    # kills the stubs with it, and the watcher must outlive them to clean up after them.
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True,
                            start_new_session=True)


def stub_shm_region() -> str:
    """The shared-memory region of this process when it is a Python-backend stub (its argv[2], a name under
    /dev/shm), else ""."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return ""
    is_stub = argv[0].endswith("triton_python_backend_stub") and len(argv) > 2
    return argv[2] if is_stub and _REGION.fullmatch(argv[2]) else ""
