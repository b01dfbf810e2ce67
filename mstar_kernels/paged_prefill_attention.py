"""Causal attention for ragged (varlen) query rows over a paged KV cache: prefill chunks, mixed steps.

Row `r` owns packed queries `query_start_loc[r]:query_start_loc[r+1]`, the last tokens of its context of
`context_lens[r]` tokens (already written to the cache). Work is a host-built list of (row, first query of a
BLOCK_M block) items, padded with row -1, so the grid `(items, Hq)` depends only on a step's token/row bucket:
CUDA-graph safe. Each program runs a flash-attention loop over the row's keys up to the block's last position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar_common.engine.attention import PREFILL_BLOCK_M as BLOCK_M  # queries per program
from mstar_common.engine.attention import build_prefill_work, prefill_work_capacity  # noqa: F401 - re-exported

_LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys per inner iteration


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, qsl_ptr, ctx_ptr, bt_ptr, work_row_ptr, work_q_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_slot, stride_kv_head, stride_bt, scale_log2,
                    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    item = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    row_raw = tl.load(work_row_ptr + item)
    is_valid = row_raw >= 0
    row = tl.maximum(row_raw, 0).to(tl.int64)
    q_first = tl.load(work_q_ptr + item)
    q_start = tl.load(qsl_ptr + row)
    q_len = tl.where(is_valid, tl.load(qsl_ptr + row + 1) - q_start, 0)
    ctx = tl.load(ctx_ptr + row)
    m_idx = q_first + tl.arange(0, BM)
    m_mask = m_idx < q_len
    q_pos = ctx - q_len + m_idx
    d = tl.arange(0, HEAD_DIM)
    tok = (q_start + m_idx).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head * stride_qh + d[None, :], mask=m_mask[:, None], other=0.0)
    m = tl.full([BM], float("-inf"), tl.float32)
    lsum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, HEAD_DIM], tl.float32)
    kv_end = tl.where(q_len > 0, tl.minimum(ctx, ctx - q_len + q_first + BM), 0)
    for n0 in range(0, kv_end, BN):
        t = n0 + tl.arange(0, BN)
        t_mask = t < kv_end
        page = tl.load(bt_ptr + row * stride_bt + t // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)
        offs = (page * PAGE_SIZE + t % PAGE_SIZE)[:, None] * stride_slot + kv_head * stride_kv_head + d[None, :]
        k = tl.load(k_ptr + offs, mask=t_mask[:, None], other=0.0).to(q.dtype)  # an fp8 pool: read back
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(t_mask[None, :] & (t[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offs, mask=t_mask[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    out = acc / lsum[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=m_mask[:, None])


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                            work_rows: torch.Tensor, work_firsts: torch.Tensor, scale: float, block_n: int = BLOCK_N,
                            num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """`query` `[T, Hq, D]` -> `[T, Hq, D]`; tokens not covered by a work item are left unwritten. The launch
    knobs (keys per iteration, warps, pipeline stages) are swept by `scripts/sweep_decode_attention.py
    --prefill`."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    assert query.stride(2) == 1 and num_heads % num_kv_heads == 0 and head_dim in (16, 32, 64, 128, 256)
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert k_cache.stride(0) == page_size * k_cache.stride(1), "each page must be contiguous"
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1 and block_tables.dtype == torch.int32
    assert work_rows.shape == work_firsts.shape and work_rows.dtype == work_firsts.dtype == torch.int32
    out = torch.empty_like(query)
    if num_tokens == 0 or work_rows.numel() == 0:
        return out
    _prefill_kernel[(work_rows.shape[0], num_heads)](
        query, k_cache, v_cache, out, query_start_loc, context_lens, block_tables, work_rows, work_firsts,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), scale * _LOG2E,
        PAGE_SIZE=page_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BM=BLOCK_M, BN=block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
    )
    return out


def paged_prefill_attention_ref(query, k_cache, v_cache, query_start_loc, context_lens, block_tables,
                                work_rows=None, work_firsts=None, scale=1.0):
    """Plain torch, fp32: each row's queries attend causally to its gathered context."""
    out = torch.empty_like(query)
    page_size = k_cache.shape[1]
    group = query.shape[1] // k_cache.shape[2]
    qsl = query_start_loc.tolist()
    for row, n in enumerate(context_lens.tolist()):
        q0, q1 = qsl[row], qsl[row + 1]
        if q1 == q0:
            continue
        pages = block_tables[row, : -(-n // page_size)].long()
        key = k_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        value = v_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,nhd->hqn", query[q0:q1].float(), key) * scale
        q_pos = torch.arange(n - (q1 - q0), n, device=query.device)
        scores = scores.masked_fill(torch.arange(n, device=query.device)[None, None, :] > q_pos[None, :, None],
                                    float("-inf"))
        out[q0:q1] = torch.einsum("hqn,nhd->qhd", scores.softmax(-1), value).to(query.dtype)
    return out
