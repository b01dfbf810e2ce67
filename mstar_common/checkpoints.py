"""Resolve a deployment's `checkpoint` to a local HF-format directory, offline.

Accepted forms:
  builtin:<name>    a tiny random checkpoint the family builds locally on first use (demo and tests)
  /a/local/dir      a directory holding config.json + *.safetensors (+ tokenizer files), or a diffusers
                    pipeline (model_index.json + one folder per component)
  org/name          a repository already in the local Hugging Face cache (never downloaded here)
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BUILTIN_PREFIX = "builtin:"
BUILTIN_DIR = "builtin-v3"  # under cache_dir(): v3 since the builders vary SNAC's Snake alphas too (v2: norms, biases)


def cache_dir() -> Path:
    """`MSTAR_CACHE_DIR`, unset or empty: ~/.cache/mstar (an empty value was the current directory)."""
    return Path(os.environ.get("MSTAR_CACHE_DIR", "").strip() or Path.home() / ".cache" / "mstar")


def expand_home(spec: str) -> Path:
    """Path(spec) with a leading ~ or ~user expanded; FileNotFoundError naming the user a home is unknown for."""
    try:
        return Path(spec).expanduser()
    except RuntimeError:  # pathlib's answer for ~user without such a user (or ~ without HOME)
        raise FileNotFoundError(f"{spec}: no home folder is known for {spec.split('/')[0]!r}") from None


def resolve_checkpoint(spec: str, builtins: dict[str, Callable[[Path], Path]]) -> Path:
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX):]
        if name not in builtins:
            raise FileNotFoundError(f"checkpoint: unknown builtin {name!r}; available: {sorted(builtins)}")
        out = cache_dir() / BUILTIN_DIR / name
        if _is_checkpoint_dir(out):  # builders rename a finished build into place, so present means complete
            return out
        return builtins[name](out)
    try:
        path = expand_home(spec)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"checkpoint: {exc}") from None
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "model_index.json").is_file():
            raise FileNotFoundError(f"checkpoint: {spec} has no config.json (transformers layout) or model_index.json "
                                    "(diffusers layout)")
        return path
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return _from_hf_cache(spec)
    raise FileNotFoundError(f"checkpoint: {spec} is not a directory, a builtin:<name> or a cached HF repo id")


def find_checkpoint(spec: str, builtins: dict[str, Callable[[Path], Path]]) -> Path | None:
    """The checkpoint's directory where it is already on this machine, else None: nothing is built or fetched.
    What can be refused here is refused as `resolve_checkpoint` refuses it (FileNotFoundError): a builtin name the
    family does not have, a path that is a file or a folder with no config."""
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX):]
        if name not in builtins:
            raise FileNotFoundError(f"checkpoint: unknown builtin {name!r}; available: {sorted(builtins)}")
        out = cache_dir() / BUILTIN_DIR / name
        return out if _is_checkpoint_dir(out) else None
    try:
        return resolve_checkpoint(spec, builtins)
    except FileNotFoundError as exc:
        try:
            here = expand_home(spec).exists()
        except FileNotFoundError:  # ~user with no such user: resolve_checkpoint's refusal names the key
            raise exc from None
        if here:
            raise  # here, and not a checkpoint
        return None


def _from_hf_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # the hub raises several types for "not cached"
        raise FileNotFoundError(
            f"checkpoint: {repo_id} is not in the local Hugging Face cache and nothing is downloaded at serve "
            f"time; fetch it first (e.g. `huggingface-cli download {repo_id}`) or give a local directory"
        ) from exc


def _is_checkpoint_dir(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / "model_index.json").is_file()


def write_once(out_dir: str | Path, write: Callable[[Path], object], required: Sequence[str]) -> Path:
    """Build a checkpoint directory at `out_dir` unless all `required` files are already there; return the path.

    `write(tmp)` fills a temporary sibling directory, which is then renamed into place (atomic; it also replaces
    an empty directory), so concurrent callers never see or leave a half-written checkpoint."""
    out = Path(out_dir)
    if _has_all(out, required):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            if not _has_all(out, required):
                raise
            logging.getLogger(__name__).debug("another caller built %s first", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _has_all(path: Path, required: Sequence[str]) -> bool:
    return all((path / name).exists() for name in required)


def vary_norms_and_biases(model: Any, scale: float = 0.2) -> Any:
    """Make a freshly initialised random model's normalisation weights and zero biases vary: transformers and
    diffusers initialise every norm weight to 1 and every norm (and Whisper's linear) bias to 0, so a parity test on
    such a checkpoint passed with norm weights ignored or swapped, and with biases dropped. Norm weights are scaled
    by 1 + `scale` x N(0, 1), norm biases and all-zero biases get `scale` / 2 x N(0, 1). Snake activations' `alpha`
    (SNAC's codec), which start at 1 as well, are scaled by |1 + `scale` x N(0, 1)|. Draws from the global torch
    RNG (seed it first); returns the model."""
    import torch
    from torch import nn

    with torch.no_grad():
        for module in model.modules():
            is_norm = isinstance(module, nn.LayerNorm | nn.GroupNorm) or type(module).__name__.endswith("RMSNorm")
            weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
            if is_norm and isinstance(weight, torch.Tensor):
                weight.mul_(1 + scale * torch.randn_like(weight))
            if isinstance(bias, torch.Tensor) and bias.dim() == 1 and (is_norm or not bias.any()):
                bias.add_(scale / 2 * torch.randn_like(bias))
            alpha = getattr(module, "alpha", None)
            if isinstance(alpha, nn.Parameter) and bool((alpha == 1).all()):  # x + sin(ax)^2 / a; a = 1 hid a swap
                alpha.mul_((1 + scale * torch.randn_like(alpha)).abs())
    return model
