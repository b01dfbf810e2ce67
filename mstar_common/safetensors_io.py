"""Reading HF/diffusers safetensors checkpoints with the checks every loader needs.

A folder holds `<stem>.safetensors`, or shards listed in `<stem>.safetensors.index.json`, or any
`*.safetensors`. A tensor name seen in two shards, a shape that disagrees with the module, and (in the
callers) a missing parameter or an unused tensor all fail the load, naming the tensors.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

MAX_NAMES_SHOWN = 10


def safetensors_files(folder: Path, stem: str = "model") -> list[Path]:
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if bad := [name for name in names if not isinstance(name, str) or not name]:
                raise TypeError(f"weight_map's values are shard file names, got {bad[0]!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not JSON, no weight_map, not a mapping
            raise ValueError(f"checkpoint {folder.name}: {index.name} is not a safetensors index "
                             f"({type(exc).__name__}: {exc})") from None
        return [folder / name for name in names]
    single = folder / f"{stem}.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint folder {folder.name}")
    return files


@contextlib.contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
    """`safe_open(file)`, whose failure on a file that is not safetensors (a Git LFS pointer, a download cut short:
    "header too large", "incomplete metadata") names no file, as a ValueError that does."""
    try:
        reader = safe_open(str(file), framework="pt", device="cpu")
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors' own error type
        raise ValueError(unreadable(file, exc)) from None
    with reader:
        yield reader


def unreadable(file: Path, exc: BaseException) -> str:
    return f"{file} is not a readable safetensors file ({exc}); a Git LFS pointer or an unfinished download?"


def check_readable(files: list[Path]) -> None:
    """Open each file's header (milliseconds, whatever its size): a ValueError naming the first that is not
    safetensors, before a load would meet it."""
    for file in files:
        with open_safetensors(file):
            pass


def tensor_readers(folder: Path, stem: str = "model") -> Iterator[tuple[str, Any]]:
    """(name, open reader) for every tensor, so callers read only the tensors they keep."""
    seen: set[str] = set()
    for file in safetensors_files(folder, stem):
        with open_safetensors(file) as reader:
            for name in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name in seen:
                    raise ValueError(f"checkpoint tensor {folder.name}/{name} appears in more than one shard")
                seen.add(name)
                yield name, reader


def iter_tensors(folder: Path, stem: str = "model") -> Iterator[tuple[str, torch.Tensor]]:
    for name, reader in tensor_readers(folder, stem):
        yield name, reader.get_tensor(name)


def copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.copy_(tensor)


def format_names(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:MAX_NAMES_SHOWN])
    return shown + (f" and {len(names) - MAX_NAMES_SHOWN} more" if len(names) > MAX_NAMES_SHOWN else "")
