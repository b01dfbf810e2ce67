"""What a deployment will hold, printed by `mstar check`: each paged KV pool's pages, tokens and bytes per instance,
and the checkpoint's weights on disk. The byte counts need the checkpoint's config (layers, KV heads, head dim);
without a local checkpoint the pool is given in pages and tokens alone. Nothing here imports torch."""

from __future__ import annotations

import math
import os
from pathlib import Path

from mstar_common.config import Deployment, DeploymentError
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
    for name, what, num_bytes, key in _extra_pools(dep, family, checkpoint):
        lines.append(f"{what} ({name}, per instance): {_size(num_bytes)}, sized by {key}")
    if checkpoint is None:
        lines.append(f"checkpoint {dep.checkpoint}: not on this machine yet, so no byte counts")
    else:
        weights = sum(f.stat().st_size for f in checkpoint.rglob("*.safetensors"))
        if weights:
            lines.append(f"weights: {_size(weights)} of safetensors in {checkpoint}")
    lines.extend(shared_gpu_notes(dep, family))
    return lines


def shared_gpu_notes(dep: Deployment, family: Family) -> list[str]:
    """A step-loop component with several instances on one GPU: their engines time-share the GPU (no MPS), which
    served less than one instance did, so the deployment is allowed but told so."""
    return [f"note: {name}: {comp.placement.instances} instances on each of gpu {comp.placement.gpus} take turns on "
            f"it, each with its own step loop; on an H100 two Qwen3-0.6B instances served 62% of one instance's "
            f"tok/s at 64 streams and 49% at 8 (docs/deployment.md). One instance with a larger "
            f"max_concurrent_requests batches the same streams in one step"
            for name, comp in sorted(dep.components.items())
            if name in family.graph.kv_holders and comp.placement.device == "gpu" and comp.placement.instances > 1]


def _page_bytes(dep: Deployment, family: Family, name: str, checkpoint: Path | None) -> tuple[int, str] | None:
    """Bytes of one KV page of component `name`'s pool, and how they are made; None without the checkpoint's
    config (or with one that cannot be read: `mstar check` has refused it by then)."""
    try:
        shape = family.kv_shape(checkpoint) if checkpoint is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        shape = None
    if shape is None:
        return None
    layers, heads, head_dim = shape
    dtype = _kv_dtype(dep, dep.components[name].placement.device)
    per_page = layers * 2 * dep.resources.kv_cache.page_size * heads * head_dim * DTYPE_BYTES[dtype]
    return per_page, f"{layers} layers x K and V x {heads} heads x {head_dim} x {dtype}"


def check_cpu_pools_fit(dep: Deployment, family: Family, checkpoint: Path, source: str,
                        memory: int | None = None) -> None:
    """The counted KV pools of cpu placements, all instances together, must fit the machine's memory (`memory`
    bytes; default the physical memory): a larger one failed as the model loaded, in the allocator."""
    kv = dep.resources.kv_cache
    memory = memory if memory is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    total, count = 0, 0
    for name in family.graph.kv_holders if not kv.is_auto else ():  # auto: sized on a GPU, from its memory
        comp = dep.components.get(name)
        page = _page_bytes(dep, family, name, checkpoint) if comp and comp.placement.device == "cpu" else None
        if page is not None:
            total += (kv.num_pages + 1) * page[0] * comp.placement.total_instances  # and each pool's sink page
            count += comp.placement.total_instances
    extra = [(what, num_bytes * dep.components[name].placement.total_instances, key)
             for name, what, num_bytes, key in _extra_pools(dep, family, checkpoint)
             if dep.components[name].placement.device == "cpu"]
    if total + sum(num_bytes for _, num_bytes, _ in extra) > memory:
        parts = [f"resources.kv_cache.num_pages: {count} cpu pool(s) of {kv.num_pages} pages need {_size(total)}"
                 ] if total else []
        parts += [f"{key}: the {what} need {_size(num_bytes)}" for what, num_bytes, key in extra]
        raise DeploymentError(f"{source}: {'; '.join(parts)}, more than this machine's {_size(memory)} of memory")


def _extra_pools(dep: Deployment, family: Family, checkpoint: Path | None) -> list[tuple[str, str, int, str]]:
    if checkpoint is None:
        return []
    try:
        return [pool for pool in family.extra_pools(dep, checkpoint) if pool[0] in dep.components]
    except (OSError, ValueError, KeyError, TypeError):  # a config that cannot be read: refused elsewhere by then
        return []


def _kv_line(dep: Deployment, family: Family, name: str, checkpoint: Path | None) -> str:
    kv, comp = dep.resources.kv_cache, dep.components[name]
    full = dep.max_concurrent_requests * math.ceil(dep.resources.max_model_len / kv.page_size)
    cap = f"max_concurrent_requests={dep.max_concurrent_requests} at max_model_len={dep.resources.max_model_len}"
    page = _page_bytes(dep, family, name, checkpoint)
    per_page, page_note = (None, "") if page is None else (page[0], f" ({_size(page[0])} a page: {page[1]})")
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
