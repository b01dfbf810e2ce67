"""How many pages an instance's KV pool gets, and whether they fit its GPU.

`num_kv_pages: "auto"` (the deployment's `resources.kv_cache.num_pages: auto`) sizes the pool at start-up, after the
weights are loaded and before anything is captured: the instance may hold `gpu_memory_share` of its GPU's total
memory in all, so the pool gets that share less what the instance already holds (its weights, and for Whisper its
cross-attention slots) and less a bound on what its steps need beside the pool (`step_reserve_bytes`). It never takes
more than is free on the GPU at that moment less that bound, since other processes may hold memory too. A pool too
small for `max_num_seqs` requests of `max_model_len` tokens refuses to start, as a number of pages that small is
refused by `mstar check`. Without a prefix cache, pages past every running request's full footprint would never be
used, so the pool stops there.

A number of pages is checked too: a pool larger than the GPU's free memory refuses to start with the largest count
that fits, instead of a CUDA out-of-memory traceback from inside the model's load; one that leaves less than the
steps' bound free starts with a warning (the bound is an estimate, not a measurement).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mstar_common.engine.kv_cache import KVSpec, pages_for
from mstar_common.engine.types import INT32_MAX

logger = logging.getLogger(__name__)

AUTO = "auto"
GIB = 2**30
FIXED_RESERVE_BYTES = GIB  # cuBLAS workspaces, the graphs' pool and the caching allocator's slack


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """The device's free and total bytes, and what this process holds on it already."""

    free: int
    total: int
    held: int


def cuda_memory(device: torch.device) -> GpuMemory:
    torch.cuda.empty_cache()  # blocks cached from the load (its temporaries) go back, so they count as free
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemory(free, total, torch.cuda.memory_reserved(device))


def bytes_per_page(spec: KVSpec, page_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for `page_size` tokens."""
    return spec.num_layers * 2 * page_size * spec.num_kv_heads * spec.head_dim * dtype.itemsize


def step_reserve_bytes(model: torch.nn.Module, max_batch_tokens: int, max_num_seqs: int, vocab_size: int,
                       dtype: torch.dtype) -> int:
    """A bound on what a step needs beside the pool: the activations of a full token budget, taken as six of the
    model's widest projection outputs a token (a layer's input, norm, qkv, attention output, gate/up and their
    product are no wider), and the logits with their fp32 sampling copies for every row; twice, as the step loop
    keeps one step in flight while it prepares the next; plus a fixed GiB."""
    widest = max((p.shape[0] for p in model.parameters() if p.dim() == 2 and p.shape[0] != vocab_size), default=0)
    activations = max_batch_tokens * 6 * widest * dtype.itemsize
    logits = max_num_seqs * vocab_size * (dtype.itemsize + 8)
    return 2 * (activations + logits) + FIXED_RESERVE_BYTES


def pool_pages(requested: int | str, *, spec: KVSpec, page_size: int, kv_dtype: torch.dtype, reserve: int,
               max_num_seqs: int, max_model_len: int, caches_prefixes: bool, share: float, device: torch.device,
               memory: Callable[[torch.device], GpuMemory] = cuda_memory) -> int:
    """The pool's page count (the sink page not included): `requested` checked against the GPU, or sized for
    `"auto"`. Raises ValueError naming `resources.kv_cache.num_pages` where the pool cannot be held."""
    if requested != AUTO:
        if device.type == "cuda":
            _check_fits(requested, spec, page_size, kv_dtype, reserve, device, memory(device))
        return requested
    if device.type != "cuda":
        raise ValueError(f"resources.kv_cache.num_pages: 'auto' sizes the pool from GPU memory; on {device} give a "
                         f"number of pages")
    if not 0 < share <= 1:
        raise ValueError(f"EngineConfig.gpu_memory_share must be in (0, 1], got {share}")
    mem = memory(device)
    per_page = bytes_per_page(spec, page_size, kv_dtype)
    budget = min(share * mem.total - mem.held, mem.free) - reserve
    pages = int(budget // per_page) - 1  # the sink page comes out of the same budget
    needed = max_num_seqs * pages_for(max_model_len, page_size)
    if pages < needed:
        raise ValueError(
            f"resources.kv_cache.num_pages: auto leaves {max(pages, 0)} pages of {page_size} tokens on {device} "
            f"({_gib(max(budget, 0))} of its {_gib(mem.total)}: a share of {share:.3g} is {_gib(share * mem.total)}, "
            f"{_gib(mem.free)} is free, this instance holds {_gib(mem.held)} and keeps {_gib(reserve)} for its "
            f"steps), which cannot hold max_concurrent_requests={max_num_seqs} requests of max_model_len="
            f"{max_model_len} tokens: need >= {needed}. Lower either, or raise resources.kv_cache.gpu_memory_fraction")
    if not caches_prefixes and pages > needed:
        logger.info("KV pool auto: %d pages would fit; %d hold every request at full length, and without a prefix "
                    "cache no more are used", pages, needed)
        pages = needed
    if pages > INT32_MAX:  # page ids are int32 in the block tables (an explicit count has the same bound)
        logger.info("KV pool auto: %d pages would fit; page ids are int32, so the pool stops at %d", pages, INT32_MAX)
        pages = INT32_MAX
    logger.info("KV pool auto on %s: %d pages of %d tokens (%s; %s free, this instance holds %s, %s kept for its "
                "steps, share %.3g of %s)", device, pages, page_size, _gib((pages + 1) * per_page), _gib(mem.free),
                _gib(mem.held), _gib(reserve), share, _gib(mem.total))
    return pages


def _check_fits(pages: int, spec: KVSpec, page_size: int, kv_dtype: torch.dtype, reserve: int,
                device: torch.device, mem: GpuMemory) -> None:
    per_page = bytes_per_page(spec, page_size, kv_dtype)
    need = (pages + 1) * per_page
    if need > mem.free:
        fit = max(int((mem.free - reserve) // per_page) - 1, 0)
        raise ValueError(
            f"resources.kv_cache.num_pages: {pages} pages of {page_size} tokens need {_gib(need)} on {device}, which "
            f"has {_gib(mem.free)} free after this instance's {_gib(mem.held)}; about {fit} pages fit beside the "
            f"{_gib(reserve)} its steps need. Lower num_pages, or set it to auto")
    if need > mem.free - reserve:
        logger.warning("KV pool: %d pages (%s) leave %s free on %s, less than the %s estimated for the steps; a "
                       "step or a graph capture may run out of memory (num_pages: auto sizes the pool to fit)",
                       pages, _gib(need), _gib(mem.free - need), device, _gib(reserve))


def log_memory(device: torch.device, when: str) -> None:
    """One line with what the instance holds on its GPU and what is left free (how close a pool sits to the edge)."""
    mem = cuda_memory(device)
    logger.info("GPU memory on %s %s: this instance holds %s (peak allocated %s), %s free of %s", device, when,
                _gib(mem.held), _gib(torch.cuda.max_memory_allocated(device)), _gib(mem.free), _gib(mem.total))


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"
