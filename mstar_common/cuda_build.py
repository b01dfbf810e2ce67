"""Build a CUDA C++ source into a shared library that ctypes loads, for this machine's first GPU
(the probes' CUDA forms: scripts/probe_persistent_step.cu, scripts/probe_staged_gemv.cu).
Built once per hash of the source, the local files it includes (`#include "..."`) and the architecture, under the
mstar cache directory (`MSTAR_CACHE_DIR`, else ~/.cache/mstar: a library at a predictable path in the shared temp
directory, built by anyone, would be loaded as is)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from mstar_common.checkpoints import cache_dir


def nvcc() -> str:
    """nvcc on PATH or under $CUDA_HOME/bin (default /usr/local/cuda); RuntimeError if neither."""
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for candidate in (shutil.which("nvcc"), os.path.join(home, "bin", "nvcc")):
        if candidate and os.path.exists(candidate):
            return candidate
    raise RuntimeError("this needs nvcc (on PATH or under $CUDA_HOME/bin)")


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_digest(source: Path, arch: str) -> str:
    """A hash of `source`, of the local headers it includes (transitively, relative to the including file), and of
    `arch`: a header's change rebuilds the library too."""
    digest, seen, todo = hashlib.sha256(arch.encode()), set(), [source.resolve()]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        text = path.read_bytes()
        digest.update(text)
        todo += [(path.parent / name).resolve() for name in _LOCAL_INCLUDE.findall(text.decode())]
    return digest.hexdigest()[:16]


def build_library(source: Path, name: str) -> ctypes.CDLL:
    """`source` compiled with -O3 for GPU 0's architecture (sm_90a on Hopper) into `<cache>/<name>/`, and loaded."""
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    arch = f"sm_{major}{minor}" + ("a" if major == 9 else "")
    digest = source_digest(source, arch)
    library = cache_dir() / name / f"{source.stem}_{digest}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([nvcc(), "-O3", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC", "-o", str(partial),
                        str(source)], check=True)
        partial.replace(library)
    return ctypes.CDLL(str(library))
