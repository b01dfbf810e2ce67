"""A native (C-level) backtrace on a fatal signal, for faults in threads that run no Python.

Python's faulthandler prints the Python stacks of a crashing process but nothing of a Triton stub's own
C++ threads or a driver thread. `build()` compiles a tiny shared library whose load-time constructor
installs SIGSEGV/SIGBUS/SIGFPE/SIGILL/SIGABRT handlers that write the crashing thread's native frames
(`backtrace_symbols_fd`: library, symbol, offset) to stderr, then die with the same signal. Load it before
`faulthandler.enable()` (which chains to the handler it finds): a component does that when the environment
names the library in `MSTAR_NATIVE_BACKTRACE` (backends/node_setup.py).

    python -m mstar_common.native_backtrace /tmp/mstar_backtrace.so    # needs a C compiler (cc)
    MSTAR_NATIVE_BACKTRACE=/tmp/mstar_backtrace.so tritonserver ...
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_fatal(int sig, siginfo_t *info, void *context) {
    static const char head[] = "\nmstar native backtrace (fatal signal, crashing thread):\n";
    void *frames[64];
    int count = backtrace(frames, 64);
    (void)info; (void)context;
    write(2, head, sizeof(head) - 1);
    backtrace_symbols_fd(frames, count, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    static const int signals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
    struct sigaction action;
    void *warm[1];
    backtrace(warm, 1);  /* loads libgcc's unwinder now, not inside the handler */
    memset(&action, 0, sizeof(action));
    action.sa_sigaction = on_fatal;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    for (unsigned i = 0; i < sizeof(signals) / sizeof(signals[0]); i++) sigaction(signals[i], &action, 0);
}
"""

ENV = "MSTAR_NATIVE_BACKTRACE"


def build(out: str | Path) -> Path:
    """Compile the library to `out`; raises RuntimeError without a C compiler or on a compile error."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH; the native backtrace library cannot be built")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "mstar_backtrace.c"
        source.write_text(SOURCE)
        result = subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(out), str(source)],
                                capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"compiling the native backtrace library failed: {result.stderr.strip()}")
    return out


def library_path() -> str | None:
    """The library MSTAR_NATIVE_BACKTRACE names (None: unset or empty); a path to no file is refused naming it
    (`mstar serve` checks it before tritonserver starts: every model's load failed on an OSError naming a path)."""
    path = os.environ.get(ENV, "").strip()
    if path and not os.path.isfile(path):
        raise ValueError(f"{ENV}={path!r}: no such file; expected the library `python -m mstar_common.native_backtrace "
                         "OUT` builds")
    return path or None


def load_from_env() -> bool:
    """Load the library named by MSTAR_NATIVE_BACKTRACE (its constructor installs the handlers)."""
    path = library_path()
    if path is None:
        return False
    try:
        ctypes.CDLL(path)
    except OSError as exc:
        raise ValueError(f"{ENV}={path!r}: not a loadable library ({exc})") from None
    return True


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mstar_backtrace.so"))
