"""Token embedding lookup, with the previous step's sampled tokens gathered into the ids on the way.

A captured decode step used to begin with two launches before its first layer: the token gather
(mstar_kernels/gather_tokens.py: each decode row's placeholder id takes the token step N-1 sampled) and torch's
embedding lookup, neither launched with PDL (the one-row Qwen3-0.6B profile of 2026-12-04: 0.8 and 2.4 us, with
2.3 us between them). Here both are one launch: each program owns a token row and a chunk of its hidden columns,
looks up whether the row is one of the `count` gather destinations (a scan of at most a bucket's rows, from L2),
takes the previous token if so, and copies that embedding row. The program with the row's first chunk also
writes the gathered id back to `input_ids`, as the gather did. Launched with PDL at the row counts that use it, so
the first layer's kernel can stream its weights while this one runs.

An id outside [0, vocab) gives a zero row instead of an out-of-bounds read (torch's lookup asserts; the engine
checks prompt ids at admission, so the served path never has one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar_kernels._pdl import gdc_enter, pdl_launch

MAX_BLOCK_H = 1024


@triton.jit
def _embed_kernel(ids_ptr, w_ptr, out_ptr, dst_ptr, src_ptr, count_ptr, prev_ptr, vocab, H, stride_w, stride_o,
                  GATHER: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, USE_GDC: tl.constexpr):
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    gdc_enter(USE_GDC)
    token = tl.load(ids_ptr + t).to(tl.int64)
    if GATHER:
        i = tl.arange(0, ROWS)
        live = i < tl.load(count_ptr)
        hit = live & (tl.load(dst_ptr + i, mask=live, other=-1) == t)
        src = tl.load(src_ptr + i, mask=hit, other=0)
        previous = tl.load(prev_ptr + src, mask=hit, other=0).to(tl.int64)
        found = tl.max(hit.to(tl.int32), axis=0) > 0
        token = tl.where(found, tl.sum(tl.where(hit, previous, 0), axis=0), token)
        tl.store(ids_ptr + t, token.to(ids_ptr.dtype.element_ty), mask=found & (chunk == 0))
    cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    token = token + tl.zeros([BLOCK_H], dtype=tl.int64)  # per column, so that the mask below is a vector
    row = tl.load(w_ptr + token * stride_w + cols, mask=(cols < H) & (token >= 0) & (token < vocab), other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + cols, row, mask=cols < H)


def embed_tokens(weight: torch.Tensor, input_ids: torch.Tensor,
                 gather: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`weight[input_ids]` (`[T]` ids, `[V, H]` weight -> `[T, H]`), after `input_ids[dst[i]] = previous[src[i]]`
    for `i < count[0]` when `gather` = `(dst, src, count, previous)` is given (`dst`/`src` hold at least that many
    entries; the updated ids are written back). One launch, graph safe (no host read of `count`)."""
    assert weight.dim() == 2 and weight.stride(1) == 1 and input_ids.dim() == 1 and input_ids.is_contiguous()
    tokens, (vocab, hidden) = input_ids.shape[0], weight.shape
    out = torch.empty((tokens, hidden), dtype=weight.dtype, device=weight.device)
    if tokens == 0:
        return out
    if gather is not None:
        dst, src, count, previous = gather
        assert dst.shape == src.shape and count.numel() == 1
    else:
        dst = src = count = previous = input_ids
    block_h = min(MAX_BLOCK_H, triton.next_power_of_2(hidden))
    grid = (tokens, triton.cdiv(hidden, block_h))
    _embed_kernel[grid](input_ids, weight, out, dst, src, count, previous, vocab, hidden, weight.stride(0),
                        out.stride(0), GATHER=gather is not None, ROWS=max(16, triton.next_power_of_2(dst.numel())),
                        BLOCK_H=block_h, num_warps=4, **pdl_launch(weight, tokens, grid[0] * grid[1]))
    return out


def embed_tokens_ref(weight: torch.Tensor, input_ids: torch.Tensor,
                     gather: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                     ) -> torch.Tensor:
    """The torch ops `embed_tokens` replaces (the gather, then the lookup)."""
    from mstar_common.layers.embedding import gather_ids

    if gather is not None:
        gather_ids(input_ids, *gather)
    return torch.nn.functional.embedding(input_ids, weight)
