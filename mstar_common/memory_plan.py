"""What a deployment will hold, printed by `mstar check`: each paged KV pool's pages, tokens and bytes per instance,
and the checkpoint's weights on disk. The byte counts need the checkpoint's config (layers, KV heads, head dim);
without a local checkpoint the pool is given in pages and tokens alone. Nothing here imports torch."""

from __future__ import annotations

import math
from pathlib import Path

from mstar_common.config import Deployment
from mstar_common.families.base import Family

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1}
MIB, GIB = 2**20, 2**30


def plan_lines(dep: Deployment, family: Family, checkpoint: Path | None) -> list[str]:
    lines = []
    for name, comp in sorted(dep.components.items()):
        where = "cpu" if comp.placement.device == "cpu" else f"gpu {comp.placement.gpus}"
        lines.append(f"{name}: {where} x{comp.placement.instances}{', cuda graphs' if comp.cuda_graphs else ''}")
    for name in (n for n in family.graph.kv_holders if n in dep.components):
        lines.append(_kv_line(dep, family, name, checkpoint))
    if checkpoint is None:
        lines.append(f"checkpoint {dep.checkpoint}: not on this machine yet, so no byte counts")
    else:
        weights = sum(f.stat().st_size for f in checkpoint.rglob("*.safetensors"))
        if weights:
            lines.append(f"weights: {_size(weights)} of safetensors in {checkpoint}")
    return lines


def _kv_line(dep: Deployment, family: Family, name: str, checkpoint: Path | None) -> str:
    kv, comp = dep.resources.kv_cache, dep.components[name]
    full = dep.max_concurrent_requests * math.ceil(dep.resources.max_model_len / kv.page_size)
    cap = f"max_concurrent_requests={dep.max_concurrent_requests} at max_model_len={dep.resources.max_model_len}"
    try:
        shape = family.kv_shape(checkpoint) if checkpoint is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        shape = None  # an unreadable config: `mstar check` has refused it by now, other callers get no bytes
    if shape is None:
        per_page = None
        page_note = ""
    else:
        layers, heads, head_dim = shape
        dtype = _kv_dtype(dep, comp.placement.device)
        per_page = layers * 2 * kv.page_size * heads * head_dim * DTYPE_BYTES[dtype]
        page_note = f" ({_size(per_page)} a page: {layers} layers x K and V x {heads} heads x {head_dim} x {dtype})"
    if kv.is_auto:
        need = f"; {cap} needs {full} pages" + (f" = {_size(full * per_page)}" if per_page else "")
        return (f"kv pool ({name}, per instance): auto, sized at start-up from {kv.fraction:g} of each GPU shared by "
                f"its {comp.placement.instances} instance(s) there{page_note}{need}")
    size = f" = {_size((kv.num_pages + 1) * per_page)}" if per_page else ""  # and the sink page
    return (f"kv pool ({name}, per instance): {kv.num_pages} pages x {kv.page_size} tokens = "
            f"{kv.num_pages * kv.page_size} tokens{size}{page_note}; {cap} needs {full} pages")


def _kv_dtype(dep: Deployment, device: str) -> str:
    if dep.resources.kv_cache.dtype != "auto":
        return dep.resources.kv_cache.dtype
    return dep.model_kwargs.get("dtype") or ("float32" if device == "cpu" else "bfloat16")


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes / 1024:.1f} KiB"
