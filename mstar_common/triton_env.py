"""Find the Triton server and its Python backend, and run them with this Python environment.

The server binary, the Python backend and per-Python stubs come from the `nvidia-pytriton` wheel (or a
TRITONSERVER_HOME laid out like /opt/tritonserver). The backend directory must hold the stub built for
the running Python; the stub embeds libpython and finds packages through the `python3` first on PATH, so
the server runs with this environment's bin directory first on PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

STUB = "triton_python_backend_stub"


@dataclass(frozen=True, slots=True)
class TritonInstall:
    binary: Path
    backend_dir: Path  # holds python/ with libtriton_python.so, the utils module and the stub
    lib_dirs: tuple[Path, ...]


# tritonserver's Python backend starts each stub through a shell with the model's folder unquoted: a space splits it
# (the stub dies parsing its arguments and the server never becomes ready) and `$(...)` in it runs
_SHELL_SAFE = re.compile(r"[A-Za-z0-9._/+,:@%=-]")


def shell_unsafe(path: str | Path) -> str | None:
    """Why tritonserver's Python backend cannot start stubs from a repository at `path` (its absolute form holds a
    character a shell splits or expands), or None."""
    text = str(Path(path).absolute())
    # (a non-ASCII letter is neither split nor expanded: its UTF-8 bytes are all >= 0x80, none a shell's)
    if bad := sorted({c for c in text if c.isascii() and not _SHELL_SAFE.fullmatch(c)}):
        return (f"{text} holds {' '.join(repr(c) for c in bad)}: tritonserver's Python backend starts its stubs "
                f"through a shell with this path unquoted, so it must be letters, digits and . _ / + , : @ % = - only")
    return None


def find_triton() -> TritonInstall:
    home = os.environ.get("TRITONSERVER_HOME")
    if home:
        root = Path(home)
        install = TritonInstall(root / "bin" / "tritonserver", root / "backends", (root / "lib",))
    else:
        try:
            import pytriton
        except ImportError:
            raise FileNotFoundError(
                "tritonserver not found: install the project (`pip install -e .` brings nvidia-pytriton) "
                "or set TRITONSERVER_HOME"
            ) from None
        root = Path(pytriton.__file__).parent / "tritonserver"
        install = TritonInstall(root / "bin" / "tritonserver", root / "backends", ())
        _ensure_stub(root)
    if not install.binary.is_file():
        raise FileNotFoundError(f"tritonserver binary missing at {install.binary}")
    if not (install.backend_dir / "python" / STUB).is_file():
        raise FileNotFoundError(f"Python backend stub missing in {install.backend_dir / 'python'}")
    return install


def _ensure_stub(root: Path) -> None:
    """Put the stub for this Python beside libtriton_python.so (the wheel keeps one per Python version)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    src = root / "python_backend_stubs" / version / STUB
    dst = root / "backends" / "python" / STUB
    if not src.is_file():
        raise FileNotFoundError(f"the nvidia-pytriton wheel has no Python-backend stub for Python {version}")
    if not dst.is_file() or dst.stat().st_size != src.stat().st_size or dst.read_bytes() != src.read_bytes():
        shutil.copy2(src, dst)


def server_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    libdir = sysconfig.get_config_var("LIBDIR")  # libpython for the stub: this interpreter's, not the system's
    libs = [str(p) for p in install.lib_dirs] + ([libdir] if libdir else [])
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    return env


def server_command(install: TritonInstall, args: list[str]) -> list[str]:
    extra = []
    if not any(a.startswith("--backend-directory") for a in args):
        extra.append(f"--backend-directory={install.backend_dir}")
    if not any("shm-region-prefix-name" in a for a in args):
        # The Python backend names its shared-memory regions from this prefix; two servers on one host with
        # the default prefix collide and their stubs are declared unhealthy.
        extra.append(f"--backend-config=python,shm-region-prefix-name=mstar{os.getpid()}_{os.urandom(3).hex()}_")
    return [str(install.binary), *extra, *args]


def tritonserver_main() -> None:
    """The `tritonserver` console script: the real binary, with this environment's backend and stub."""
    install = find_triton()
    cmd = server_command(install, sys.argv[1:])
    os.execve(cmd[0], cmd, server_env(install))
