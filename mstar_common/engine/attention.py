"""Paged attention: the per-step metadata, the backend interface and the plain-torch reference backend.

Layout. The KV pool of one layer is `[num_pages, page_size, num_kv_heads, head_dim]` for K and the same for V.
A token at position `p` of a sequence lives in slot `pages[p // page_size] * page_size + p % page_size`.

A step packs the rows' new tokens back to back (`[T, ...]`, varlen). Row `r` owns packed tokens
`query_start_loc[r]:query_start_loc[r + 1]`; its context after this step's writes holds `context_lens[r]`
tokens, the row's new tokens being the last ones. Attention is causal: the new token at position `p` sees
context positions `<= p`. A decode row is simply a row with one new token.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch layout, on the device, plus host copies of the small per-row lists."""

    query_start_loc: torch.Tensor  # [B + 1] int32: packed-token offsets of each row's new tokens
    context_lens: torch.Tensor  # [B] int32: tokens in each row's context after this step's writes
    block_tables: torch.Tensor  # [B, max_pages] int32: each row's pages in order, padded with the sink page
    slot_mapping: torch.Tensor  # [T] int64: KV slot each packed token writes
    max_query_len: int
    max_context_len: int
    query_start_loc_host: list[int]
    context_lens_host: list[int]

    @property
    def num_rows(self) -> int:
        return len(self.context_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]


def build_attention_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    *,
    page_size: int,
    sink_page: int,
    device: torch.device | str,
) -> AttentionMetadata:
    """Metadata for rows whose new tokens are the last `query_lens[r]` of `context_lens[r]` context tokens."""
    query_start_loc = [0]
    slots: list[int] = []
    for query_len, context_len, pages in zip(query_lens, context_lens, page_tables, strict=True):
        query_start_loc.append(query_start_loc[-1] + query_len)
        for pos in range(context_len - query_len, context_len):
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
    max_pages = max((math.ceil(c / page_size) for c in context_lens), default=0)
    block_tables = [list(pages[:max_pages]) + [sink_page] * (max_pages - len(pages)) for pages in page_tables]
    return AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        context_lens=torch.tensor(list(context_lens), dtype=torch.int32, device=device),
        block_tables=torch.tensor(block_tables, dtype=torch.int32, device=device).view(len(page_tables), max_pages),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens, default=0),
        max_context_len=max(context_lens, default=0),
        query_start_loc_host=query_start_loc,
        context_lens_host=list(context_lens),
    )


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged pool and attends each row's queries to its paged context.

    Call order per step: `prepare(metadata)` once, then for every layer `write_kv` followed by `attend`.
    Tensors: `key`/`value` `[T, num_kv_heads, head_dim]`, `query` `[T, num_heads, head_dim]` with
    `num_heads % num_kv_heads == 0` (GQA); caches as in the module docstring, same dtype as key/value.
    """

    name: str = "abstract"

    def prepare(self, metadata: AttentionMetadata) -> None:  # noqa: B027 - optional hook, no-op by default
        """Per-step planning (e.g. FlashInfer's plan) shared by all layers; the reference needs none."""

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None: ...

    @abstractmethod
    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Returns `[T, num_heads, head_dim]` in the query's dtype."""


class TorchPagedAttention(AttentionBackend):
    """Reference backend in plain torch (CPU or GPU): gathers each row's pages and runs SDPA per row.

    Clear rather than fast: one SDPA call per row per layer. Faster backends are checked against it.
    """

    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, metadata) -> None:
        slots = metadata.slot_mapping
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value)

    def attend(self, query, k_cache, v_cache, metadata, scale) -> torch.Tensor:
        out = torch.empty_like(query)
        starts = metadata.query_start_loc_host
        for row, context_len in enumerate(metadata.context_lens_host):
            q_start, q_end = starts[row], starts[row + 1]
            if q_end == q_start:
                continue
            key, value = self._gather_context(k_cache, v_cache, metadata.block_tables[row], context_len)
            out[q_start:q_end] = _causal_sdpa(query[q_start:q_end], key, value, scale)
        return out

    @staticmethod
    def _gather_context(k_cache, v_cache, block_table, context_len):
        page_size = k_cache.shape[1]
        pages = block_table[: math.ceil(context_len / page_size)].long()
        key = k_cache[pages].flatten(0, 1)[:context_len]
        value = v_cache[pages].flatten(0, 1)[:context_len]
        return key, value


def _causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """`query` `[q, Hq, D]` are the last q of the `k` context positions in `key`/`value` `[k, Hkv, D]`."""
    num_queries, num_keys = query.shape[0], key.shape[0]
    mask = None
    if num_queries > 1:
        # Query i sits at position num_keys - num_queries + i (bottom-right aligned causal mask).
        offset = num_keys - num_queries
        q_pos = torch.arange(num_queries, device=query.device)[:, None] + offset
        mask = torch.arange(num_keys, device=query.device)[None, :] <= q_pos
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(0, 1)
