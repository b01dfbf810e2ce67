"""Paged attention: the per-step metadata, the backend interface and the plain-torch reference backend.

Layout. The KV pool of one layer is `[num_pages, page_size, num_kv_heads, head_dim]` for K and the same for V.
A token at position `p` of a sequence lives in slot `pages[p // page_size] * page_size + p % page_size`.

A step packs the rows' new tokens back to back (`[T, ...]`, varlen). Row `r` owns packed tokens
`query_start_loc[r]:query_start_loc[r + 1]`; its context after this step's writes holds `context_lens[r]`
tokens, the row's new tokens being the last ones. Attention is causal: the new token at position `p` sees
context positions `<= p`. A decode row is simply a row with one new token.

Backends: `TorchPagedAttention` (the reference; per-row loops over host lists), `TorchStaticAttention` (plain
torch with fixed shapes and device-only metadata, so it can be captured; the CPU stand-in for graph tests) and
`TritonPagedAttention` (`mstar_kernels/`: split-K decode, ragged prefill, fused q/k-norm + RoPE + KV write), the
portable GPU path. `select_attention_backend` picks one for a device.
"""

from __future__ import annotations

import functools
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mstar_common.config import env_switch


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
    # Set for the graph-safe backends (static shapes; host lists above are then not to be read):
    is_decode: bool = False  # every row has exactly one new token (decode kernel)
    work_rows: torch.Tensor | None = None  # [N] int32: prefill work items (row, first query), row -1 = padding;
    # rows with one new token have none (the decode kernel attends them, also in mixed steps)
    work_firsts: torch.Tensor | None = None  # [N] int32
    request_slots: torch.Tensor | None = None  # [B] int32: each row's model-owned slot (scheduler.RequestHooks)
    page_tables_host: Sequence[Sequence[int]] | None = None  # each row's pages (eager steps; the flashinfer plan)

    @property
    def num_rows(self) -> int:
        return len(self.context_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]


PREFILL_BLOCK_M = 64  # queries per work item of the ragged prefill kernel


def prefill_work_capacity(num_tokens: int, num_rows: int) -> int:
    """Work items a step of at most `num_tokens` tokens over at most `num_rows` rows can need."""
    return -(-num_tokens // PREFILL_BLOCK_M) + min(num_rows, num_tokens)


def build_prefill_work(query_lens: Sequence[int], capacity: int | None = None,
                       skip_single: bool = False) -> tuple[list[int], list[int]]:
    """(row, first query) per PREFILL_BLOCK_M block of each row's queries, padded to `capacity` with row -1.
    `skip_single`: no items for rows with one new token (a mixed step's decode rows, which the Triton backend
    hands to the decode kernel)."""
    rows: list[int] = []
    firsts: list[int] = []
    for row, n in enumerate(query_lens):
        if skip_single and n == 1:
            continue
        for first in range(0, n, PREFILL_BLOCK_M):
            rows.append(row)
            firsts.append(first)
    if capacity is not None:
        if len(rows) > capacity:
            raise ValueError(f"{len(rows)} prefill work items exceed the capacity {capacity}")
        rows += [-1] * (capacity - len(rows))
        firsts += [0] * (capacity - len(firsts))
    return rows, firsts


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
    work_rows, work_firsts = build_prefill_work(query_lens, skip_single=True)
    return AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        context_lens=torch.tensor(list(context_lens), dtype=torch.int32, device=device),
        block_tables=torch.tensor(block_tables, dtype=torch.int32, device=device).view(len(page_tables), max_pages),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens, default=0),
        max_context_len=max(context_lens, default=0),
        query_start_loc_host=query_start_loc,
        context_lens_host=list(context_lens),
        is_decode=bool(query_lens) and all(n == 1 for n in query_lens),
        work_rows=torch.tensor(work_rows, dtype=torch.int32, device=device),
        work_firsts=torch.tensor(work_firsts, dtype=torch.int32, device=device),
        page_tables_host=page_tables,
    )


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged pool and attends each row's queries to its paged context.

    Call order per step: `prepare(metadata)` once, then for every layer `write_kv` followed by `attend`.
    Tensors: `key`/`value` `[T, num_kv_heads, head_dim]`, `query` `[T, num_heads, head_dim]` with
    `num_heads % num_kv_heads == 0` (GQA); caches as in the module docstring, same dtype as key/value.
    """

    name: str = "abstract"

    is_graph_safe: bool = False  # reads only device tensors with static shapes (can be CUDA-graph captured)

    def prepare(self, metadata: AttentionMetadata) -> None:  # noqa: B027 - optional hook, no-op by default
        """Per-step planning (e.g. FlashInfer's plan) shared by all layers; the reference needs none."""

    def plan_graph_step(  # noqa: B027 - optional hook, no-op by default
            self, key: tuple, rows: int, tokens: int, host: dict, width: int, page_size: int, sink_page: int) -> None:
        """Per-replay planning of a captured bucket `key` (engine/cuda_graph.py), from the host arrays its inputs
        are copied from (`host`: StepBuffers views; `width`: pages per block-table row). Called before the bucket's
        capture and before each of its replays; the backends that read only the graph's inputs need none."""

    def prologue(self, qkv: torch.Tensor, layer, rope, kv: tuple[torch.Tensor, torch.Tensor],
                 metadata: AttentionMetadata) -> torch.Tensor:
        """Packed `qkv` `[T, (Hq + 2 Hkv) * D]` -> rotated query `[T, Hq, D]`, after per-head q/k norm (when the
        layer has one), RoPE (`rope`: layers/rotary.py `RopeInputs`) and writing k/v to the layer's pool. The
        eager reference; backends may fuse it."""
        from mstar_common.layers.rotary import apply_rotary

        num_tokens, heads, kv_heads, dim = qkv.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
        query, key, value = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        query = query.reshape(num_tokens, heads, dim)
        key = key.reshape(num_tokens, kv_heads, dim)
        value = value.reshape(num_tokens, kv_heads, dim)
        if layer.q_norm is not None:
            query, key = layer.q_norm(query), layer.k_norm(key)
        cos, sin = rope.tables()
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        self.write_kv(key, value, kv[0], kv[1], metadata)
        return query

    def prologue_attend(self, qkv: torch.Tensor, layer, rope, kv: tuple[torch.Tensor, torch.Tensor],
                        metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """`prologue` then `attend`: packed `qkv` -> attention output `[T, Hq, D]`. Backends may fuse the two."""
        query = self.prologue(qkv, layer, rope, kv, metadata)
        return self.attend(query, kv[0], kv[1], metadata, scale)

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
        slots = metadata.slot_mapping.long()
        for cache, src in ((k_cache, key), (v_cache, value)):
            write_slots(cache, slots, src)

    def attend(self, query, k_cache, v_cache, metadata, scale) -> torch.Tensor:
        out = torch.empty_like(query)
        starts = metadata.query_start_loc_host
        for row, context_len in enumerate(metadata.context_lens_host):
            q_start, q_end = starts[row], starts[row + 1]
            if q_end == q_start:
                continue
            key, value = self._gather_context(k_cache, v_cache, metadata.block_tables[row], context_len)
            key, value = key.to(query.dtype), value.to(query.dtype)  # an fp8 pool is read back in the model's dtype
            out[q_start:q_end] = _causal_sdpa(query[q_start:q_end], key, value, scale)
        return out

    @staticmethod
    def _gather_context(k_cache, v_cache, block_table, context_len):
        page_size = k_cache.shape[1]
        pages = block_table[: math.ceil(context_len / page_size)].long()
        key = k_cache[pages].flatten(0, 1)[:context_len]
        value = v_cache[pages].flatten(0, 1)[:context_len]
        return key, value


def write_slots(cache: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """`cache` at flat token slots <- `src`, rounded to the cache's dtype (an fp8 pool through a byte view:
    torch has no fp8 `index_copy_` on the CPU)."""
    flat, src = cache.view(-1, *cache.shape[2:]), src.to(cache.dtype)
    if cache.element_size() == 1 and cache.is_floating_point():
        flat, src = flat.view(torch.uint8), src.view(torch.uint8)
    flat.index_copy_(0, slots, src)


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


class TorchStaticAttention(TorchPagedAttention):
    """Plain torch with static shapes and device-only metadata: graph safe, any device.

    Every token attends over its row's whole block-table width with a mask, so the cost grows with the
    table width; it exists to test graph capture and padding on the CPU, and as a fallback without Triton.
    """

    name = "torch_static"
    is_graph_safe = True

    def attend(self, query, k_cache, v_cache, metadata, scale) -> torch.Tensor:
        num_tokens = query.shape[0]
        qsl, ctx = metadata.query_start_loc.long(), metadata.context_lens.long()
        num_rows = ctx.shape[0]
        token = torch.arange(num_tokens, device=query.device)
        row = (torch.searchsorted(qsl[1: num_rows + 1], token, right=True)).clamp_max(num_rows - 1)
        q_pos = ctx[row] - (qsl[row + 1] - token)  # padding tokens get a position the mask handles
        pages = metadata.block_tables.long()[row]  # [T, W]
        key = k_cache[pages].flatten(1, 2)  # [T, W * page, Hkv, D]
        value = v_cache[pages].flatten(1, 2)
        group = query.shape[1] // k_cache.shape[2]
        key, value = key.repeat_interleave(group, dim=2), value.repeat_interleave(group, dim=2)
        scores = torch.einsum("thd,tnhd->thn", query.float(), key.float()) * scale
        visible = torch.arange(key.shape[1], device=query.device)[None, :] <= q_pos.clamp_min(0)[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        return torch.einsum("thn,tnhd->thd", scores.softmax(-1), value.float()).to(query.dtype)


class TritonPagedAttention(AttentionBackend):
    """The portable GPU path: Triton kernels from `mstar_kernels/`, graph safe.

    Decode steps (`metadata.is_decode`) use the split-K paged decode kernel. Every other step runs the ragged
    paged prefill kernel over the metadata's work list (the rows of several new tokens) and then the decode
    kernel over the rows of one new token, at their packed positions: a mixed step's decodes keep the decode
    kernel's GQA-shared reads (H200, 256 decode rows + a 32-token prompt, Llama-3.2-3B heads: 584 us per layer
    through the prefill kernel alone, 223 us split; fp8 pool 574 -> 168 us). `fused_prologue` runs q/k norm +
    RoPE + KV write as one kernel instead of the eager ops; in decode steps of 3-16 rows (heads form) that kernel
    is the decode attention itself (mstar_kernels/paged_decode_attention.py `rope_in_attention`).
    """

    name = "triton"
    is_graph_safe = True

    def __init__(self, fused_prologue: bool = True) -> None:
        self.fused_prologue = fused_prologue

    def prologue(self, qkv, layer, rope, kv, metadata) -> torch.Tensor:
        if not self.fused_prologue:
            return super().prologue(qkv, layer, rope, kv, metadata)
        from mstar_kernels.qk_norm_rope_kv import qk_norm_rope_kv

        has_norm = layer.q_norm is not None
        return qk_norm_rope_kv(  # the RoPE angles in-kernel, from the positions
            qkv, None, None, layer.q_norm.weight if has_norm else None, layer.k_norm.weight if has_norm else None,
            layer.q_norm.eps if has_norm else 0.0, kv[0], kv[1], metadata.slot_mapping,
            layer.num_heads, layer.num_kv_heads, layer.head_dim, positions=rope.positions, inv_freq=rope.inv_freq(),
        )

    def prologue_attend(self, qkv, layer, rope, kv, metadata, scale) -> torch.Tensor:
        from mstar_kernels.paged_decode_attention import paged_decode_attention_rope, rope_in_attention

        knobs = _decode_knobs(kv[0].element_size() == 1)
        if not (self.fused_prologue and metadata.is_decode and not knobs["tokens_major"]
                and rope_in_attention(qkv.shape[0])):
            return super().prologue_attend(qkv, layer, rope, kv, metadata, scale)
        has_norm = layer.q_norm is not None
        return paged_decode_attention_rope(
            qkv, layer.q_norm.weight if has_norm else None, layer.k_norm.weight if has_norm else None,
            layer.q_norm.eps if has_norm else 0.0, rope.positions, rope.inv_freq(), kv[0], kv[1],
            metadata.slot_mapping, metadata.block_tables, metadata.context_lens, layer.num_heads,
            layer.num_kv_heads, layer.head_dim, scale, fp16_dots=knobs["fp16_dots"],
        )

    def write_kv(self, key, value, k_cache, v_cache, metadata) -> None:
        from mstar_kernels.qk_norm_rope_kv import store_kv

        store_kv(key, value, k_cache, v_cache, metadata.slot_mapping)

    def attend(self, query, k_cache, v_cache, metadata, scale) -> torch.Tensor:
        from mstar_kernels.paged_decode_attention import paged_decode_attention

        knobs = _decode_knobs(k_cache.element_size() == 1)
        if metadata.is_decode:
            return paged_decode_attention(query, k_cache, v_cache, metadata.block_tables, metadata.context_lens,
                                          scale, **knobs)
        from mstar_kernels.paged_prefill_attention import paged_prefill_attention

        if metadata.work_rows is None:
            raise ValueError("the Triton prefill kernel needs metadata.work_rows (build_attention_metadata sets it)")
        # rows of several new tokens through the ragged prefill kernel, the one-token rows (a mixed step's
        # decodes) through the decode kernel into the same output
        out = paged_prefill_attention(query, k_cache, v_cache, metadata.query_start_loc, metadata.context_lens,
                                      metadata.block_tables, metadata.work_rows, metadata.work_firsts, scale)
        return paged_decode_attention(query, k_cache, v_cache, metadata.block_tables, metadata.context_lens, scale,
                                      query_start_loc=metadata.query_start_loc, out=out, **knobs)


BACKENDS = ("auto", "torch", "torch_static", "triton", "triton_unfused", "flashinfer")
KERNEL_BACKENDS = ("auto", "triton", "triton_unfused")  # those that run the Triton kernels on a GPU
KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)  # the head dims those kernels take (mstar_kernels/paged_*_attention.py)


def select_attention_backend(device: torch.device | str, name: str = "auto") -> AttentionBackend:
    """`auto`: the Triton kernels on CUDA when `triton` imports, else the torch reference."""
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {list(BACKENDS)}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and _has_triton() else "torch"
    if name.startswith("triton") and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention backend {name!r} needs a CUDA device, got {device}")
    if name == "torch":
        return TorchPagedAttention()
    if name == "torch_static":
        return TorchStaticAttention()
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError(f"attention backend 'flashinfer' needs a CUDA device, got {device}")
        from mstar_common.engine.flashinfer_backend import FlashInferAttention

        return FlashInferAttention()
    return TritonPagedAttention(fused_prologue=name == "triton")


# An fp8 pool's decode dots in fp16 with the heads form (mstar_kernels/paged_decode_attention.py `fp16_dots`): timed at
# 147 us against the fp8 q.k form's 108 us (docs/deployment.md), so off.
_FP8_FP16_DOTS = env_switch("MSTAR_FP8_FP16_DOTS", False)
# The decode kernel's form (mstar_kernels/paged_decode_attention.py): heads (query heads as the dots' rows) | tokens
# (context tokens as the rows) | tokens_fp16 (and an fp8 pool's dots in fp16) | tokens_qk_fp8 (an fp8 pool's
# q.k as an fp8 dot on the pool's bytes, the query quantised per head). auto: heads for a bf16/fp32 pool,
# tokens_qk_fp8 for an fp8 one (the fastest of each in scripts/sweep_decode_attention.py --variants on the H200:
# 158 us and 108 us at 256 rows x 640 tokens, Llama-3.2-3B's heads).
_DECODE_FORMS = ("auto", "heads", "tokens", "tokens_fp16", "tokens_qk_fp8")
_DECODE_FORM = os.environ.get("MSTAR_DECODE_FORM", "") or "auto"
if _DECODE_FORM not in _DECODE_FORMS:
    raise ValueError(f"MSTAR_DECODE_FORM must be one of {list(_DECODE_FORMS)}, got {_DECODE_FORM!r}")


@functools.cache
def _decode_knobs(fp8: bool) -> dict[str, bool]:
    """paged_decode_attention's form arguments for a pool of this kind, under MSTAR_DECODE_FORM."""
    form = _DECODE_FORM if _DECODE_FORM != "auto" else ("tokens_qk_fp8" if fp8 else "heads")
    return {"tokens_major": form.startswith("tokens"), "qk_fp8": fp8 and form == "tokens_qk_fp8",
            "fp16_dots": fp8 and (_FP8_FP16_DOTS or form == "tokens_fp16")}


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
