"""Paged KV pool and its page allocator.

Policy: **reserve at admission, allocate as the sequence grows.** A request is admitted only when its whole
footprint, `ceil((prompt_len + max_tokens) / page_size)` pages, fits in the pages no one has reserved yet;
its physical pages are then taken one by one as its KV grows. A reservation can therefore never fail to turn
into pages, so nothing is ever preempted, while `num_used_pages` still shows what the KV really occupies.

The pool has one extra **sink page** past the allocatable ones (index `num_pages`): padding rows and block-table
padding point there, so a kernel that reads or writes a padded slot touches no live sequence.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVSpec:
    """The KV shape a model needs per token: one K and one V of `[num_kv_heads, head_dim]` per layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


class KVCache:
    """Per-layer K and V tensors `[num_pages + 1, page_size, num_kv_heads, head_dim]` (the last page is the sink)."""

    def __init__(self, spec: KVSpec, num_pages: int, page_size: int, dtype: torch.dtype, device) -> None:
        self.spec, self.num_pages, self.page_size = spec, num_pages, page_size
        self.sink_page = num_pages
        # One allocation for the whole pool; each layer's K and V are contiguous views into it.
        self._pool = torch.zeros(
            spec.num_layers, 2, num_pages + 1, page_size, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device
        )
        self.k_caches = [self._pool[layer, 0] for layer in range(spec.num_layers)]
        self.v_caches = [self._pool[layer, 1] for layer in range(spec.num_layers)]
        logger.info("KV pool: %d pages x %d tokens, %d layers, %.1f MiB", num_pages, page_size,
                    spec.num_layers, self._pool.numel() * self._pool.element_size() / 2**20)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_caches[index], self.v_caches[index]


@dataclass(slots=True)
class PageTable:
    """One sequence's pages in order, and how many pages it may hold in total (its reservation)."""

    pages: list[int] = field(default_factory=list)
    num_reserved: int = 0


class PageAllocator:
    """Hands out pages `0 .. num_pages - 1` against per-sequence reservations.

    Predicate/action pairs: `can_allocate(n)` / `allocate(table, n)` reserve a footprint of `n` pages at
    admission; `grow(table, num_tokens)` takes physical pages within the reservation; `free(table)` returns both.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_kv_pages and page_size must be >= 1, got {num_pages} and {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free: deque[int] = deque(range(num_pages))
        self._num_reserved = 0

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_reserved_pages(self) -> int:
        return self._num_reserved

    @property
    def num_unreserved_pages(self) -> int:
        return self.num_pages - self._num_reserved

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_unreserved_pages

    def allocate(self, table: PageTable, num_pages: int) -> None:
        """Reserve `num_pages` for a new sequence; pages are taken later by `grow`."""
        if table.num_reserved or table.pages:
            raise RuntimeError("page table already holds a reservation")
        if not self.can_allocate(num_pages):
            raise RuntimeError(f"cannot reserve {num_pages} pages: {self.num_unreserved_pages} unreserved")
        table.num_reserved = num_pages
        self._num_reserved += num_pages

    def grow(self, table: PageTable, num_tokens: int) -> None:
        """Make `table` cover `num_tokens` tokens, taking pages from its reservation."""
        needed = self.pages_for(num_tokens)
        if needed > table.num_reserved:
            # The footprint bounds every sequence's KV, so this is an engine bug, not a request error.
            raise RuntimeError(f"sequence needs {needed} pages but reserved {table.num_reserved}")
        while len(table.pages) < needed:
            table.pages.append(self._free.popleft())

    def free(self, table: PageTable) -> None:
        """Return the table's pages and reservation; the table is left empty (so freeing twice is harmless)."""
        self._free.extend(table.pages)
        self._num_reserved -= table.num_reserved
        table.pages.clear()
        table.num_reserved = 0
