"""The native backtrace library: a segfault in a process that loaded it (then enabled faulthandler, as every
component does) prints faulthandler's Python stacks AND the crashing thread's native frames, then dies with
SIGSEGV as before."""

import shutil
import signal
import subprocess
import sys

import pytest

from mstar_common import native_backtrace

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="needs a C compiler")

CRASH = """
import ctypes, faulthandler, sys
from mstar_common.native_backtrace import load_from_env
assert load_from_env()
faulthandler.enable(file=sys.__stderr__, all_threads=True)
ctypes.string_at(0)  # a read of address 0: SIGSEGV
"""


def test_segfault_prints_python_stacks_then_native_frames(tmp_path):
    library = native_backtrace.build(tmp_path / "bt.so")
    result = subprocess.run([sys.executable, "-c", CRASH], capture_output=True, text=True, timeout=60,
                            env={"MSTAR_NATIVE_BACKTRACE": str(library), "PATH": "/usr/bin:/bin",
                                 "PYTHONPATH": ":".join(sys.path)})
    assert result.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in result.stderr
    native = result.stderr.split("mstar native backtrace", 1)
    assert len(native) == 2, result.stderr[-2000:]
    frames = [line for line in native[1].splitlines()[1:] if line.strip()]
    assert len(frames) >= 3 and any("libc" in f or "python" in f or "ctypes" in f for f in frames), frames


def test_nothing_is_loaded_without_the_variable(monkeypatch):
    monkeypatch.delenv(native_backtrace.ENV, raising=False)
    assert native_backtrace.load_from_env() is False
