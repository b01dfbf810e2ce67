"""Paged KV pool and its page allocator.

Policy: **reserve at admission, allocate as the sequence grows.** A request is admitted only when its whole
footprint, `ceil((prompt_len + max_tokens) / page_size)` pages, fits in the pages no one has reserved yet;
its physical pages are then taken one by one as its KV grows. A reservation can therefore never fail to turn
into pages, so nothing is ever preempted, while `num_used_pages` still shows what the KV really occupies.

The pool has one extra **sink page** past the allocatable ones (index `num_pages`): padding rows and block-table
padding point there, so a kernel that reads or writes a padded slot touches no live sequence.

**Prefix cache** (`prefix_caching`). A full page of a sequence whose KV is written is keyed by the page's token ids
and the key of the page before it (a chain from the sequence's first token, so a key stands for the whole
prefix up to the page's end); `commit` enters such pages in an index. At admission `match_prefix` walks the
index along a new prompt's pages and gives the sequence every page that matches, shared, so its prefill starts
after them. Pages are reference counted: a page that no sequence holds stays in the index, idle, until `grow`
needs a page and the free list is empty, and then the least recently released idle page is evicted. Keys compare
token tuples exactly (a dict), so a hash collision can never serve another prefix's KV. A shared page is never
written: a sequence only writes past its matched pages, and only full pages are keyed.

The reservation rule still holds with sharing: the pages in use are at most the sum of what the running
sequences hold, each holds at most its reservation, and the reservations fit in the pool, so a sequence that
grows within its reservation always finds a free or an idle page.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
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
    num_keyed: int = 0  # leading pages already matched in, or entered into, the prefix index
    last_node: int = 0  # the index node of the last keyed page (0: the root, before the first page)


@dataclass(slots=True)
class _Node:
    """A keyed page: `key` is (the node id of the page before it, this page's token ids)."""

    node_id: int
    page: int
    key: tuple[int, tuple[int, ...]]
    children: dict[int, _Node] = field(default_factory=dict)  # node id -> node, the keyed pages after this one


def pages_for(num_tokens: int, page_size: int) -> int:
    """KV pages that `num_tokens` tokens take."""
    return math.ceil(num_tokens / page_size)


class PageAllocator:
    """Hands out pages `0 .. num_pages - 1` against per-sequence reservations.

    Predicate/action pairs: `can_allocate(n)` / `allocate(table, n)` reserve a footprint of `n` pages at
    admission; `grow(table, num_tokens)` takes physical pages within the reservation; `free(table)` returns both.
    """

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = False) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_kv_pages and page_size must be >= 1, got {num_pages} and {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_pages))
        self._num_reserved = 0
        self._refs = [0] * num_pages  # sequences holding each page
        self._index: dict[tuple[int, tuple[int, ...]], _Node] = {}
        self._keyed: dict[int, _Node] = {}  # page -> its node, for the pages in the index
        self._nodes: dict[int, _Node] = {}  # node id -> node, for the nodes in the index
        self._idle: OrderedDict[int, None] = OrderedDict()  # keyed pages no sequence holds, oldest release first
        self._next_node = 1
        self.num_prefix_queried_tokens = 0  # prompt tokens looked up at admission
        self.num_prefix_hit_tokens = 0  # of those, tokens whose KV came from the index
        self.num_evicted_pages = 0  # idle keyed pages taken back for new KV

    @property
    def num_free_pages(self) -> int:
        """Pages no sequence holds: the free list and the idle keyed pages (evicted when needed)."""
        return len(self._free) + len(self._idle)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Keyed pages no sequence holds (prefix cache entries kept for later prompts)."""
        return len(self._idle)

    @property
    def num_reserved_pages(self) -> int:
        return self._num_reserved

    @property
    def num_unreserved_pages(self) -> int:
        return self.num_pages - self._num_reserved

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

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
            table.pages.append(self._take_page())

    def free(self, table: PageTable) -> None:
        """Return the table's pages and reservation; the table is left empty (so freeing twice is harmless).
        A keyed page nobody else holds stays in the index, idle. Last page first: eviction takes the idle page
        released longest ago, and a prefix's first page is the one every lookup of it must match, so it goes after
        the pages that follow it (every holder of a keyed page holds the pages before it, so they are released no
        earlier)."""
        for page in reversed(table.pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._keyed:
                    self._idle[page] = None
                else:
                    self._free.append(page)
        self._num_reserved -= table.num_reserved
        table.pages.clear()
        table.num_reserved = table.num_keyed = table.last_node = 0

    def match_prefix(self, table: PageTable, token_ids: Sequence[int], max_pages: int) -> int:
        """Give a newly reserved `table` the longest chain of indexed pages that matches `token_ids`, at most
        `max_pages` (a prompt keeps at least one token to compute, whose row samples); returns the tokens matched."""
        if table.pages:
            raise RuntimeError("prefix matching needs an empty page table")
        size = self.page_size
        if not self.prefix_caching:  # nothing is looked up (the queried counter said prompt tokens were)
            return 0
        self.num_prefix_queried_tokens += len(token_ids)
        parent = 0
        for index in range(min(max_pages, table.num_reserved, len(token_ids) // size)):
            node = self._index.get((parent, tuple(token_ids[index * size:(index + 1) * size])))
            if node is None:
                break
            if self._refs[node.page] == 0:
                del self._idle[node.page]
            self._refs[node.page] += 1
            table.pages.append(node.page)
            parent = node.node_id
        table.num_keyed, table.last_node = len(table.pages), parent
        self.num_prefix_hit_tokens += len(table.pages) * size
        return len(table.pages) * size

    def commit(self, table: PageTable, token_ids: Sequence[int], num_tokens: int) -> None:
        """Enter the table's full pages among its first `num_tokens` tokens (whose KV a completed step wrote) in
        the prefix index; a page holding a token not known yet (negative: a placeholder) stops it."""
        if not self.prefix_caching:
            return
        size = self.page_size
        if table.last_node and table.last_node not in self._nodes:
            return  # the page before was evicted from the index: what follows it could never be matched
        for index in range(table.num_keyed, min(num_tokens // size, len(table.pages))):
            tokens = tuple(token_ids[index * size:(index + 1) * size])
            if len(tokens) < size or min(tokens) < 0:
                return
            key = (table.last_node, tokens)
            node = self._index.get(key)
            if node is None:  # else another sequence keyed the same prefix first: ours stays unkeyed
                page = table.pages[index]
                node = _Node(self._next_node, page, key)
                self._next_node += 1
                self._index[key] = node
                self._keyed[page] = node
                self._nodes[node.node_id] = node
                if table.last_node:
                    self._nodes[table.last_node].children[node.node_id] = node
            table.num_keyed, table.last_node = index + 1, node.node_id

    def _take_page(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:  # evict the idle keyed page released longest ago
            page, _ = self._idle.popitem(last=False)
            self._unkey(self._keyed[page])
            self.num_evicted_pages += 1
        self._refs[page] = 1
        return page

    def _unkey(self, node: _Node) -> None:
        """Take `node` and the pages keyed after it out of the index: with it gone no lookup reaches them. Those
        idle go back to the free list; those held go there when released."""
        if (parent := self._nodes.get(node.key[0])) is not None:
            del parent.children[node.node_id]
        stack = [node]
        while stack:  # a loop, not recursion: a long prompt's chain is thousands of pages deep
            node = stack.pop()
            del self._index[node.key], self._keyed[node.page], self._nodes[node.node_id]
            if node.page in self._idle:
                del self._idle[node.page]
                self._free.append(node.page)
            stack.extend(node.children.values())
