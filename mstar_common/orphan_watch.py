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

# A server (tritonserver, the proxy) whose launcher is gone gets the launcher's parent-death SIGTERM; this kills
# its process group if it is still there `grace` s later. Seen in CI (2026-12-06): a `mstar serve` killed 1 s after
# tritonserver's start; tritonserver logged "Signal (15) received." four times and served on, reparented, for good.
# The process is known by its start time too, so a pid reused after it ended is never signalled.
_GROUP_WATCH = """
pid=$1 parent=$2 grace=$3
field() { n=$2; s=$(cat /proc/"$1"/stat 2>/dev/null) || { echo; return; }; set -- $s; shift "$n"; echo "$1"; }
start=$(field "$pid" 21)
[ -n "$start" ] || exit 0
alive() { [ "$(field "$pid" 21)" = "$start" ] && [ "$(field "$pid" 2)" != Z ]; }
while alive && [ "$(field "$pid" 3)" = "$parent" ]; do sleep 1; done
alive || exit 0
echo "[orphan-watch] $pid outlived its launcher $parent; SIGKILL to its process group in $grace s unless it ends" >&2
sleep "$grace"
alive && kill -9 -"$pid"
exit 0
"""


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


def kill_group_when_orphaned(pid: int, grace_s: float) -> subprocess.Popen | None:
    """Watch `pid`, a child of this process that leads its own process group (a server started with
    `start_new_session`): once this process is gone and the child is still there `grace_s` later, SIGKILL its
    group. The watcher exits as soon as the child ends. None where /proc is missing."""
    if not os.path.isdir(f"/proc/{pid}"):
        return None
    args = ["/bin/sh", "-c", _GROUP_WATCH, "orphan-watch", str(pid), str(os.getpid()), f"{grace_s:g}"]
    # A session of its own, as the stubs' watchers: a stop that kills the launcher's group leaves it running.
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True,
                            start_new_session=True)
