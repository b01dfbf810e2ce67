"""Paged decode attention (one query token per row), split over the context for parallelism (flash-decoding).

Grid `(rows, kv_heads, splits)`: each program takes the `GROUP` query heads that share one KV head (GQA,
padded to 16 rows for `tl.dot`) and one contiguous share of the row's context, looked up token by token through
the row's block table, so any page size works. With one split it writes the output directly; otherwise a
second kernel merges the splits' partial softmax states. The grid depends only on the row count, never on the
context lengths (read on the device), so the launch is CUDA-graph safe.

Layouts: query/out `[B, Hq, D]`; caches `[P, page, Hkv, D]`; `block_tables` `[B, W]` int32; `context_lens` `[B]`.
Two forms: heads-major (`_decode_split_kernel`, the query heads as the dots' rows) and tokens-major
(`_decode_split_tokens_kernel`, the context tokens as the rows; with an fp8 pool its q.k is an fp8 dot). In a
mixed step (`query_start_loc` given) both attend only the rows of one new token, at their packed positions.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from mstar_common.config import env_switch
from mstar_common.engine.attention import KERNEL_HEAD_DIMS
from mstar_kernels._pdl import _num_sms, gdc_enter, pdl_launch
from mstar_kernels._rounding import round_to
from mstar_kernels.qk_norm_rope_kv import INTERPRETED, cos_sin, decode_prefetch

_LOG2E = 1.4426950408889634
BLOCK_N = 64  # context tokens per inner iteration


@triton.jit
def _split_span(ctx_ptr, row, split, NUM_SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """This split's share [start, end) of the row's context, in whole BLOCKs but the last."""
    ctx = tl.load(ctx_ptr + row)
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK) * BLOCK
    start = split * per_split
    return start, tl.minimum(start + per_split, ctx)


@triton.jit
def _group_query(q_ptr, tok, kv_head, stride_qb, stride_qh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    """The query heads sharing `kv_head`, padded to GROUP_PAD rows: (g, d, heads, q [GROUP_PAD, HEAD_DIM])."""
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + tok * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None],
                other=0.0)
    return g, d, heads, q


@triton.jit
def _token_slots(bt_ptr, row, stride_bt, t, t_mask, stride_slot, kv_head, stride_kv_head, PAGE_SIZE: tl.constexpr):
    """Where tokens `t` of `row`'s context sit in the pool for `kv_head`: offsets of their first element (int64)."""
    page = tl.load(bt_ptr + row * stride_bt + t // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)
    return (page * PAGE_SIZE + t % PAGE_SIZE) * stride_slot + kv_head * stride_kv_head


@triton.jit
def _l2_prefetch_block(k_ptr, v_ptr, bt_ptr, ctx_ptr, row, split, kv_head, stride_bt, stride_slot, stride_kv_head,
                       PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr,
                       LINES: tl.constexpr):
    """Asks L2 for the K and V rows of this split's first block (`LINES` 128-byte lines a token row) and holds
    nothing: the loads after the PDL wait then hit L2. The newest token's lines may be fetched before the prologue
    writes them; its write goes through L2, and `prefetch.global.L2` fills no L1 line, so the loads still see it."""
    start, end = _split_span(ctx_ptr, row, split, NUM_SPLITS, BLOCK)
    t = start + tl.arange(0, BLOCK)
    t = tl.where(t < end, t, start)  # past the context: the first token's lines again (a repeat is free)
    slots = _token_slots(bt_ptr, row, stride_bt, t, t >= 0, stride_slot, kv_head, stride_kv_head, PAGE_SIZE)
    line = tl.arange(0, LINES).to(tl.int64)[None, :] * 128
    _l2_prefetch((k_ptr + slots).to(tl.int64)[:, None] + line)
    _l2_prefetch((v_ptr + slots).to(tl.int64)[:, None] + line)


@triton.jit
def _l2_prefetch(addr):
    """`prefetch.global.L2` at each byte address of `addr` (int64); its dummy result is discarded."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _empty_state(GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The online softmax's start for a group of query heads: (running max, running sum, accumulator)."""
    return (tl.full([GROUP_PAD], float("-inf"), tl.float32), tl.zeros([GROUP_PAD], tl.float32),
            tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32))


@triton.jit
def _attend_tile(q, k, v, t_mask, m, lsum, acc, scale_log2, DOT_PRECISION: tl.constexpr):
    """A block of context (`t_mask`: its tokens; at least one) into the split kernel's running softmax state: the
    ops of its loop, in the same order (so the prefetched block gives the same bits)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(t_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    lsum = lsum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, lsum, acc


@triton.jit
def _store_heads(out_ptr, part_acc_ptr, part_ml_ptr, acc, m, lsum, row, tok, split, g, d, heads, stride_ob,
                 stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """A heads-major program's result: with one split the output rows of its query heads at `tok`, else its
    partials: acc [B, Hq, S, D], (m, l) [B, Hq, S, 2]."""
    g_mask = (g < GROUP)[:, None]
    if NUM_SPLITS == 1:
        out = acc / lsum[:, None]
        tl.store(out_ptr + tok * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask)
    else:
        num_q_heads = tl.num_programs(1) * GROUP
        part = (row * num_q_heads + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask)
        tl.store(part_ml_ptr + part * 2, m, mask=g < GROUP)
        tl.store(part_ml_ptr + part * 2 + 1, lsum, mask=g < GROUP)


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, qsl_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                         stride_qb, stride_qh, stride_ob, stride_oh, stride_slot, stride_kv_head, stride_bt,
                         scale_log2, PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, FP16_DOTS: tl.constexpr, MIXED: tl.constexpr,
                         PREFETCH: tl.constexpr, PREFETCH_L2: tl.constexpr, L2_LINES: tl.constexpr,
                         USE_GDC: tl.constexpr):
    """One (row, KV head, context split): the split's softmax state over its context for the query heads that
    share the KV head. `PREFETCH` (decode steps under PDL, one new token per row at position `ctx - 1`): the
    split's first block of context is loaded before the PDL wait, all but the new token, which the kernel before
    this one (the prologue) writes to the pool; after the wait that token's rows are read from L2 and put into the
    block, so the dots see the same tiles, and give the same bits, as without it. `PREFETCH_L2` asks L2 for that
    block ahead of the wait instead and holds no registers across it (`_l2_prefetch_block`); the kernel after the
    wait is the plain form's."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    d = tl.arange(0, HEAD_DIM)
    if PREFETCH_L2:  # never interpreted (no PTX there); nothing after the wait depends on it
        _l2_prefetch_block(k_ptr, v_ptr, bt_ptr, ctx_ptr, row, split, kv_head, stride_bt, stride_slot,
                           stride_kv_head, PAGE_SIZE, BLOCK, NUM_SPLITS, L2_LINES)
    if PREFETCH:  # older tokens, block tables and lengths: nothing an unfinished kernel writes
        start, end = _split_span(ctx_ptr, row, split, NUM_SPLITS, BLOCK)
        if split > 0 and start >= end:
            return
        t0 = start + tl.arange(0, BLOCK)
        in0 = t0 < end
        new_pos = tl.load(ctx_ptr + row) - 1
        is_new0 = in0 & (t0 == new_pos)
        slots0 = _token_slots(bt_ptr, row, stride_bt, t0, in0, stride_slot, kv_head, stride_kv_head, PAGE_SIZE)
        offs0 = slots0[:, None] + d[None, :]
        k0 = tl.load(k_ptr + offs0, mask=(in0 & ~is_new0)[:, None], other=0.0)
        v0 = tl.load(v_ptr + offs0, mask=(in0 & ~is_new0)[:, None], other=0.0)
        new_offs = tl.sum(tl.where(is_new0, slots0, 0), axis=0) + d  # the newest token's row, if in this block
        new_in0 = (tl.sum(is_new0.to(tl.int32), axis=0) + d * 0) > 0
    gdc_enter(USE_GDC)
    tok = row
    if MIXED:  # a mixed step's packed queries: only rows with exactly one new token are this kernel's
        tok = tl.load(qsl_ptr + row).to(tl.int64)
        if tl.load(qsl_ptr + row + 1) - tok != 1:
            return
    if not PREFETCH:
        start, end = _split_span(ctx_ptr, row, split, NUM_SPLITS, BLOCK)
        if split > 0 and start >= end:  # past the context: no partials (the merge reads only the splits that ran)
            return
    g, d, heads, q = _group_query(q_ptr, tok, kv_head, stride_qb, stride_qh, GROUP, GROUP_PAD, HEAD_DIM)
    if FP16_DOTS:  # an fp8 pool read back as fp16 (the hardware's e4m3 -> f16 conversion), dots in fp16
        q = q.to(tl.float16)
    m, lsum, acc = _empty_state(GROUP_PAD, HEAD_DIM)
    first = start
    if PREFETCH:
        # the new token's rows, past L1 (lines loaded ahead of the wait may hold them from before it)
        k_new = tl.load(k_ptr + new_offs, mask=new_in0, other=0.0, cache_modifier=".cg")
        v_new = tl.load(v_ptr + new_offs, mask=new_in0, other=0.0, cache_modifier=".cg")
        k = tl.where(is_new0[:, None], k_new[None, :], k0).to(q.dtype)
        v = tl.where(is_new0[:, None], v_new[None, :], v0).to(q.dtype)
        m, lsum, acc = _attend_tile(q, k, v, in0, m, lsum, acc, scale_log2, DOT_PRECISION)
        first = start + BLOCK
    for n0 in range(first, end, BLOCK):
        t = n0 + tl.arange(0, BLOCK)
        t_mask = t < end
        offs = _token_slots(bt_ptr, row, stride_bt, t, t_mask, stride_slot, kv_head, stride_kv_head,
                            PAGE_SIZE)[:, None] + d[None, :]
        k = tl.load(k_ptr + offs, mask=t_mask[:, None], other=0.0).to(q.dtype)  # an fp8 pool: read back
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offs, mask=t_mask[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    _store_heads(out_ptr, part_acc_ptr, part_ml_ptr, acc, m, lsum, row, tok, split, g, d, heads, stride_ob,
                 stride_oh, GROUP, HEAD_DIM, NUM_SPLITS)


@triton.jit
def _decode_split_tokens_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, qsl_ptr, out_ptr, part_acc_ptr,
                                part_ml_ptr, stride_qb, stride_qh, stride_ob, stride_oh, stride_slot, stride_kv_head,
                                stride_bt, scale_log2, PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr,
                                GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                                NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, FP16_DOTS: tl.constexpr,
                                MIXED: tl.constexpr, QK_FP8: tl.constexpr, USE_GDC: tl.constexpr):
    """The same attention with the context tokens as the dots' M dimension: scores^T = K q^T and
    out^T = V^T p^T. K and V are then the dots' left operands and M is a full 64/128-token tile instead of 16
    padded query rows (the reasoning: a left operand converted from fp8 can stay in registers; measured
    only end to end, see `paged_decode_attention`). `QK_FP8` (an fp8 pool only): the query is quantised per
    head to e4m3 (scale max|q| / 448) and q.K runs as an fp8 dot on the pool's bytes, with no conversion of
    K at all."""
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    tok = row
    if MIXED:
        tok = tl.load(qsl_ptr + row).to(tl.int64)
        if tl.load(qsl_ptr + row + 1) - tok != 1:
            return
    start, end = _split_span(ctx_ptr, row, split, NUM_SPLITS, BLOCK)
    if split > 0 and start >= end:  # past the context: no partials (the merge reads only the splits that ran)
        return
    g, d, heads, q = _group_query(q_ptr, tok, kv_head, stride_qb, stride_qh, GROUP, GROUP_PAD, HEAD_DIM)
    q_scale = tl.full([GROUP_PAD], 1.0, tl.float32)
    if QK_FP8:
        q_scale = tl.maximum(tl.max(tl.abs(q.to(tl.float32)), axis=1), 1e-12) / 448.0
        q = (q.to(tl.float32) / q_scale[:, None]).to(k_ptr.dtype.element_ty)
    elif FP16_DOTS:
        q = q.to(tl.float16)
    q_t = tl.trans(q)  # [HEAD_DIM, GROUP_PAD]
    col_scale = q_scale * scale_log2
    pv_dtype: tl.constexpr = tl.float16 if (FP16_DOTS or QK_FP8) else q_ptr.dtype.element_ty
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    lsum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([HEAD_DIM, GROUP_PAD], tl.float32)
    for n0 in range(start, end, BLOCK):
        t = n0 + tl.arange(0, BLOCK)
        t_mask = t < end
        slot = _token_slots(bt_ptr, row, stride_bt, t, t_mask, stride_slot, kv_head, stride_kv_head, PAGE_SIZE)
        k = tl.load(k_ptr + slot[:, None] + d[None, :], mask=t_mask[:, None], other=0.0)
        if not QK_FP8:
            k = k.to(q_t.dtype)
        s = tl.dot(k, q_t, input_precision=DOT_PRECISION) * col_scale[None, :]  # [BLOCK, GROUP_PAD]
        s = tl.where(t_mask[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[None, :])
        lsum = lsum * alpha + tl.sum(p, axis=0)
        v_t = tl.load(v_ptr + slot[None, :] + d[:, None], mask=t_mask[None, :], other=0.0).to(pv_dtype)
        acc = acc * alpha[None, :] + tl.dot(v_t, p.to(pv_dtype), input_precision=DOT_PRECISION)
        m = m_new
    g_mask = (g < GROUP)[None, :]
    if NUM_SPLITS == 1:
        out = acc / lsum[None, :]
        tl.store(out_ptr + tok * stride_ob + heads[None, :] * stride_oh + d[:, None],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask)
    else:
        num_q_heads = tl.num_programs(1) * GROUP
        part = (row * num_q_heads + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[None, :] * HEAD_DIM + d[:, None], acc, mask=g_mask)
        tl.store(part_ml_ptr + part * 2, m, mask=g < GROUP)
        tl.store(part_ml_ptr + part * 2 + 1, lsum, mask=g < GROUP)


@triton.jit
def _norm_rope_heads(qkv_ptr, w_ptr, row, stride_qkv, heads, h_mask, c, s, eps, HAS_NORM: tl.constexpr,
                     HEAD_DIM: tl.constexpr):
    """Heads `heads` of the packed projection's `row`, RMS-normed per head (with `HAS_NORM`) and rotated
    (rotate-half pairing, angles `c`/`s` [HEAD_DIM]), as fp32 [R, HEAD_DIM] holding model-dtype values: the
    roundings of mstar_kernels/qk_norm_rope_kv.py (norm, weight multiply, `x*cos`, `partner*sin`, sum)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    partner = (d + HALF) % HEAD_DIM
    base = qkv_ptr + row * stride_qkv + heads[:, None] * HEAD_DIM
    x = tl.load(base + d[None, :], mask=h_mask[:, None], other=0.0)
    dtype = x.dtype
    a = x.to(tl.float32)
    b = tl.load(base + partner[None, :], mask=h_mask[:, None], other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(a * a, axis=1) / HEAD_DIM + eps)[:, None]
        a = round_to(round_to(a * rstd, dtype) * tl.load(w_ptr + d).to(tl.float32)[None, :], dtype)
        b = round_to(round_to(b * rstd, dtype) * tl.load(w_ptr + partner).to(tl.float32)[None, :], dtype)
    sign = tl.where(d < HALF, -1.0, 1.0)[None, :]
    return round_to(a * c[None, :], dtype) + sign * round_to(b * s[None, :], dtype)


@triton.jit
def _attend_block(q, k, v, t_mask, m, lsum, acc, scale_log2, DOT_PRECISION: tl.constexpr):
    """One BLOCK of context into the running softmax state; a block may hold no token of `t_mask` (the new
    token's block when it holds only that token)."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(t_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    lsum = lsum * alpha + tl.sum(p, axis=1)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, lsum, acc


@triton.jit
def _decode_rope_split_kernel(qkv_ptr, pos_ptr, inv_freq_ptr, qw_ptr, kw_ptr, slot_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr,
                              out_ptr, part_acc_ptr, part_ml_ptr, stride_qkv, stride_ob, stride_oh, stride_slot,
                              stride_kv_head, stride_bt, scale_log2, eps, NUM_Q_HEADS: tl.constexpr,
                              HAS_NORM: tl.constexpr, PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr,
                              GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                              NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, FP16_DOTS: tl.constexpr,
                              INTERPRETED: tl.constexpr, USE_GDC: tl.constexpr):
    """`_decode_split_kernel` with the attention prologue inside (decode steps: one new token per row, at context
    position `ctx - 1`). Each program norms and rotates its query heads from the packed projection; the program
    whose split holds the new token also norms and rotates its key, writes key and value to the pool at the row's
    slot, and adds them to its softmax state from registers after its loop. The loop's tiles go untouched from
    load to dot: a first version that swapped the new token into each tile was 40% slower at 64 rows (H200).
    Loading the first block before the PDL wait (the context but the new token is older than this step) made
    no difference at 1-16 rows and was dropped."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start, end = _split_span(ctx_ptr, row, split, NUM_SPLITS, BLOCK)
    if split > 0 and start >= end:
        return
    holds_new = end == tl.load(ctx_ptr + row)  # this split holds the row's last token, the one this step writes
    new_pos = tl.where(holds_new, end - 1, -1)
    d = tl.arange(0, HEAD_DIM)
    gdc_enter(USE_GDC)
    dtype = qkv_ptr.dtype.element_ty
    angle = tl.load(pos_ptr + row).to(tl.float32) * tl.load(inv_freq_ptr + d % (HEAD_DIM // 2))
    c, s = cos_sin(angle, INTERPRETED)
    c = round_to(c, dtype)
    s = round_to(s, dtype)
    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    q = _norm_rope_heads(qkv_ptr, qw_ptr, row, stride_qkv, heads, g < GROUP, c, s, eps, HAS_NORM,
                         HEAD_DIM).to(dtype)
    if FP16_DOTS:
        q = q.to(tl.float16)
    one = tl.arange(0, 1)
    k_new = _norm_rope_heads(qkv_ptr, kw_ptr, row, stride_qkv, NUM_Q_HEADS + kv_head + one, one == 0, c, s, eps,
                             HAS_NORM, HEAD_DIM).to(dtype)
    v_new = tl.load(qkv_ptr + row * stride_qkv + (NUM_Q_HEADS + tl.num_programs(1) + kv_head) * HEAD_DIM
                    + d[None, :] + one[:, None] * 0)
    cache_type = k_ptr.dtype.element_ty  # explicit casts: the pool may be fp8 (e4m3)
    k_new = k_new.to(cache_type)
    v_new = v_new.to(cache_type)
    if holds_new:
        slot = tl.load(slot_ptr + row).to(tl.int64)
        tl.store(k_ptr + slot * stride_slot + kv_head * stride_kv_head + d[None, :] + one[:, None] * 0, k_new)
        tl.store(v_ptr + slot * stride_slot + kv_head * stride_kv_head + d[None, :] + one[:, None] * 0, v_new)
    m, lsum, acc = _empty_state(GROUP_PAD, HEAD_DIM)
    for n0 in range(start, end, BLOCK):
        t = n0 + tl.arange(0, BLOCK)
        t_mask = t < end
        offs = _token_slots(bt_ptr, row, stride_bt, t, t_mask, stride_slot, kv_head, stride_kv_head,
                            PAGE_SIZE)[:, None] + d[None, :]
        old = t_mask & (t != new_pos)
        k = tl.load(k_ptr + offs, mask=old[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=old[:, None], other=0.0)
        m, lsum, acc = _attend_block(q, k, v, old, m, lsum, acc, scale_log2, DOT_PRECISION)
    if holds_new:  # the new token, as the pool reads it back: one more score per head
        s_new = tl.sum(q.to(tl.float32) * k_new.to(q.dtype).to(tl.float32), axis=1) * scale_log2
        m_new = tl.maximum(m, s_new)
        alpha = tl.exp2(m - m_new)
        p_new = tl.exp2(s_new - m_new)
        lsum = lsum * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(q.dtype).to(tl.float32)
        m = m_new
    _store_heads(out_ptr, part_acc_ptr, part_ml_ptr, acc, m, lsum, row, row, split, g, d, heads, stride_ob,
                 stride_oh, GROUP, HEAD_DIM, NUM_SPLITS)


@triton.jit
def _decode_merge_kernel(part_acc_ptr, part_ml_ptr, ctx_ptr, qsl_ptr, out_ptr, stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK: tl.constexpr, MIXED: tl.constexpr,
                         EARLY: tl.constexpr, USE_GDC: tl.constexpr):
    """Merges the splits that held context (split 0 always writes; a split past the row's context writes
    nothing): at one row the grid has 32 splits, but 640 tokens fill only 10 of them. `EARLY`: the step's
    lengths (which say which splits ran) are read before the PDL wait, so after it the partials' loads are the
    first."""
    if not EARLY:
        gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    tok = row
    if MIXED:
        tok = tl.load(qsl_ptr + row).to(tl.int64)
        if tl.load(qsl_ptr + row + 1) - tok != 1:
            return
    base = row * tl.num_programs(1) + head
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    start, _ = _split_span(ctx_ptr, row, s, NUM_SPLITS, BLOCK)
    used = (s == 0) | (start < tl.load(ctx_ptr + row))
    if EARLY:
        gdc_enter(USE_GDC)
    m = tl.load(part_ml_ptr + (base * NUM_SPLITS + s) * 2, mask=used, other=float("-inf"))
    lsum = tl.load(part_ml_ptr + (base * NUM_SPLITS + s) * 2 + 1, mask=used, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    acc = tl.load(part_acc_ptr + (base * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :], mask=used[:, None],
                  other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)
    tl.store(out_ptr + tok * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def decode_num_splits(num_rows: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Splits per row so that about two waves of programs fill the GPU (a power of two, 1..32)."""
    want = max(1, (2 * num_sms) // max(1, num_rows * num_kv_heads))
    return min(32, 1 << (want.bit_length() - 1))


def decode_num_stages(num_rows: int, num_kv_heads: int, splits: int) -> int:
    """Pipeline stages of the split kernel: 3 once the grid is many waves deep with one split per row, else 2.
    `MSTAR_DECODE_STAGES=N` forces N (read at each launch, so at capture for a graph). 3 stages for every
    one-split grid of the bf16 form was 2.3% faster alone at 64 rows x 700 tokens (Qwen3-0.6B's heads), but in
    the captured step (H200, 2026-12-02, `ab_decode_step.py`) 1.1% faster at 32 rows and 0.3% slower at 64, so
    the rule stayed."""
    raw = os.environ.get("MSTAR_DECODE_STAGES", "") or "0"
    if not raw.isdigit():
        raise ValueError(f"MSTAR_DECODE_STAGES={raw!r}: expected a positive integer (or 0 / unset for the rule)")
    if int(raw):
        return int(raw)
    return 3 if splits == 1 and num_rows * num_kv_heads >= 1024 else 2


# Programs of the split kernel an SM holds with `PREFETCH` (its first block held in registers across the PDL wait):
# scripts/probe_kernel_resources.py, Triton 3.6 for sm_90 (2026-12-04): 175 registers a thread against 96 without
# (4 warps, 64 tokens a block, GQA 2 or 3, head size 128), so 2 programs an SM against 5. Qwen3-0.6B's 64-row step
# (512 programs) then takes two waves instead of one; under PDL there its attention took 1,411 us of the step
# against 1,206 without PDL (docs/benchmarks.md, 2026-12-04 night).
PREFETCH_PROGRAMS_PER_SM = 2


def prefetch_fits(programs: int, sms: int) -> bool:
    """Whether a split grid of `programs` programs runs in one wave at the prefetching form's occupancy, so that
    holding its first block costs no wave (grids of up to 32 rows x 8 KV heads, 256 programs, do on 132 SMs).
    `MSTAR_DECODE_PREFETCH_ANY_GRID=1` (for A/Bs) prefetches on any grid, as before 2026-12-04 late night."""
    return programs <= PREFETCH_PROGRAMS_PER_SM * sms


def prefetch_forms(under_pdl: bool, programs: int, sms: Callable[[], int]) -> tuple[bool, bool]:
    """How a decode step's split kernel reads its first block ahead of the PDL wait: (held in registers, asked of L2).
    Held where the grid fits one wave at that form's occupancy (`prefetch_fits`, or any grid with
    `MSTAR_DECODE_PREFETCH_ANY_GRID=1`); on a wider grid, asked of L2 with `MSTAR_DECODE_PREFETCH_L2=1` (default 0:
    timed on the H200 on 2026-12-05, no gain at 64 rows; the L2 form keeps the plain form's 96 registers and 5 programs
    an SM, compiled by Triton 3.6 for sm_90), else not read ahead. Nothing ahead without PDL or with
    `MSTAR_DECODE_PREFETCH=0`. `sms` gives the GPU's SM count (asked only under PDL)."""
    if not (under_pdl and decode_prefetch()):
        return False, False
    if prefetch_fits(programs, sms()) or env_switch("MSTAR_DECODE_PREFETCH_ANY_GRID", False):
        return True, False
    return False, env_switch("MSTAR_DECODE_PREFETCH_L2", False)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, block: int | None = None, num_warps: int = 4,
                           num_stages: int | None = None, fp16_dots: bool = False, tokens_major: bool = False,
                           qk_fp8: bool = False, query_start_loc: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, prefetch: bool | None = None,
                           prefetch_l2: bool | None = None) -> torch.Tensor:
    """Launch knobs (`block` context tokens per iteration, warps, pipeline stages) default to the measured
    choice: scripts/sweep_decode_attention.py on the H200 found 64 tokens, 4 warps and 2 stages within a few
    percent of the best everywhere, and 3 stages 5% faster once the grid is many waves deep (256 rows x 8
    KV heads: 163 us, 4.1 TB/s of KV, the copy bandwidth). `fp16_dots` (an fp8 pool only) converts K/V
    e4m3 -> fp16 (one hardware conversion, where bf16 takes two) and runs the dots in fp16; queries must fit
    fp16's range. `tokens_major` runs `_decode_split_tokens_kernel` (context tokens as the dots' rows), and
    `qk_fp8` (with it, an fp8 pool only) its fp8 q.k: the `--variants` sweep on the H200 (2026-12-01) timed an
    fp8 pool at 256 rows x 640 tokens (Llama-3.2-3B heads) at 108 us this way (128 tokens per iteration,
    3.1 TB/s of fp8 KV), against 147 us heads-major with fp16 dots and 158 us for the bf16 pool. On a grid of
    fewer than 1,024 programs 64 tokens per iteration are faster: Qwen3-0.6B's 64 rows x 700 tokens, 37.3 us
    against 41.2 (`--focus qwen3-64`, 2026-12-02).

    Mixed steps: with `query_start_loc` ([rows + 1], packed `query` [T, Hq, D]) the kernel attends only the rows
    that have exactly one new token, each at its packed position, and writes those rows' outputs into `out`
    (the ragged prefill kernel's output for the other rows), so a mixed step's decode rows keep this kernel's
    GQA-shared, split-K reads instead of the prefill kernel's one pass per query head.

    `prefetch` / `prefetch_l2` force how a decode step reads its first block ahead of the PDL wait (held in
    registers / asked of L2); unset, `prefetch_forms` decides. Either gives the plain form's bits."""
    mixed = query_start_loc is not None
    num_heads, head_dim = query.shape[1:]
    num_rows = block_tables.shape[0] if mixed else query.shape[0]
    assert not mixed or (query_start_loc.shape == (num_rows + 1,) and query_start_loc.dtype == torch.int32)
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    assert query.stride(2) == 1
    _check_inputs(k_cache, v_cache, block_tables, context_lens, num_rows, num_heads, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    assert not (fp16_dots or qk_fp8) or k_cache.element_size() == 1, "fp16_dots and qk_fp8 are for an fp8 pool"
    assert not qk_fp8 or tokens_major, "qk_fp8 runs in the tokens-major kernel"
    splits = num_splits or decode_num_splits(num_rows, num_kv_heads)
    if block is None:  # an fp8 tile of 128 tokens moves as many bytes as a bf16 one of 64; it pays on deep grids
        block = 128 if qk_fp8 and num_rows * num_kv_heads * splits >= 1024 else BLOCK_N
    if num_stages is None:
        num_stages = decode_num_stages(num_rows, num_kv_heads, splits)
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(2) == 1
    if num_rows == 0:
        return out
    part_acc, part_ml = _partials(out, num_rows, splits)
    programs = num_rows * num_kv_heads * splits
    pdl = pdl_launch(query, num_rows, programs, kind="split")
    held, asked = prefetch_forms(bool(pdl["USE_GDC"]) and not mixed, programs, lambda: _num_sms(query.device))
    prefetch = held if prefetch is None else prefetch
    prefetch_l2 = asked if prefetch_l2 is None else prefetch_l2
    kernel, extra = _decode_split_kernel, {
        "PREFETCH": prefetch and not mixed, "PREFETCH_L2": prefetch_l2 and not (prefetch or mixed or INTERPRETED),
        "L2_LINES": max(1, head_dim * k_cache.element_size() // 128)}
    if tokens_major:
        kernel, extra = _decode_split_tokens_kernel, {"QK_FP8": qk_fp8}
    kernel[(num_rows, num_kv_heads, splits)](
        query, k_cache, v_cache, block_tables, context_lens, query_start_loc if mixed else context_lens, out,
        part_acc, part_ml,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), scale * _LOG2E,
        PAGE_SIZE=page_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK=block, NUM_SPLITS=splits, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        FP16_DOTS=fp16_dots, MIXED=mixed, num_warps=num_warps, num_stages=num_stages, **extra, **pdl,
    )
    _merge(part_acc, part_ml, context_lens, query_start_loc, out, num_rows, splits, block)
    return out


def _check_inputs(k_cache, v_cache, block_tables, context_lens, num_rows, num_heads, num_kv_heads, head_dim):
    """The pool `[P, page, Hkv, D]` (contiguous pages, K and V alike) and the int32 block tables and lengths."""
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.stride(3) == 1
    assert num_heads % num_kv_heads == 0 and head_dim in KERNEL_HEAD_DIMS
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1), "each page must be contiguous"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_rows and block_tables.stride(1) == 1
    assert context_lens.shape == (num_rows,) and block_tables.dtype == context_lens.dtype == torch.int32


def _partials(out: torch.Tensor, num_rows: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel's partials (acc [B, Hq, S, D], (m, l) [B, Hq, S, 2]); `out` stands in with one split."""
    if splits == 1:
        return out, out
    num_heads, head_dim = out.shape[1:]
    return (torch.empty((num_rows, num_heads, splits, head_dim), dtype=torch.float32, device=out.device),
            torch.empty((num_rows, num_heads, splits, 2), dtype=torch.float32, device=out.device))


def _merge(part_acc, part_ml, context_lens, query_start_loc, out, num_rows: int, splits: int, block: int) -> None:
    """The merge of the splits' partials into `out` (none with one split)."""
    if splits == 1:
        return
    mixed = query_start_loc is not None
    num_heads, head_dim = out.shape[1:]
    pdl = pdl_launch(out, num_rows, num_rows * num_heads, kind="merge")
    early = bool(pdl["USE_GDC"]) and decode_prefetch()
    _decode_merge_kernel[(num_rows, num_heads)](part_acc, part_ml, context_lens, query_start_loc if mixed else part_ml,
                                                out, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
                                                NUM_SPLITS=splits, BLOCK=block, MIXED=mixed, EARLY=early, num_warps=4,
                                                **pdl)


ROPE_IN_ATTENTION_ROWS = (3, 16)  # decode steps of these many rows take `paged_decode_attention_rope` by default


def rope_in_attention(num_rows: int) -> bool:
    """Whether a decode step of `num_rows` rows (Triton backend, heads form) runs the attention prologue inside
    the decode kernel (`paged_decode_attention_rope`). `MSTAR_DECODE_ROPE_IN_ATTENTION`: `rule` (default) for
    3-16 rows, `1` always, `0` never; read at each call, so at capture for a graph. The rule is the A/B of
    2026-12-02 (H200, Qwen3-0.6B, context 640, `scripts/ab_decode_step.py`, ms per step, prologue kernel ->
    inside): 1 row 0.852 -> 0.869, 2 rows 1.025 -> 1.036 (the prologue's launch is already hidden by PDL
    there), 4 rows 1.297 -> 1.277, 8 rows 1.400 -> 1.356, 16 rows 1.587 -> 1.542, 64 rows 2.343 -> 2.704 (each
    of 512 programs redoes its query heads' norm and RoPE, and the heavier kernel reads the pool slower)."""
    mode = os.environ.get("MSTAR_DECODE_ROPE_IN_ATTENTION", "rule") or "rule"
    if mode not in ("rule", "0", "1"):
        raise ValueError(f"MSTAR_DECODE_ROPE_IN_ATTENTION={mode!r}: expected rule, 0 or 1")
    if mode == "rule":
        return ROPE_IN_ATTENTION_ROWS[0] <= num_rows <= ROPE_IN_ATTENTION_ROWS[1]
    return mode == "1"


def paged_decode_attention_rope(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                                eps: float, positions: torch.Tensor, inv_freq: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                                context_lens: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                                scale: float, num_splits: int | None = None, num_warps: int = 4,
                                num_stages: int | None = None, fp16_dots: bool = False) -> torch.Tensor:
    """A decode step's attention prologue and attention in one launch (plus the merge): mstar_kernels/qk_norm_rope_kv.py
    on the packed projection `qkv` `[B, (Hq + 2 Hkv) * D]` (the per-head q/k RMSNorm with `q_weight`, RoPE from
    `positions` `[B]` and `inv_freq` `[D/2]` fp32, the new key and value into the pool at `slot_mapping` `[B]`),
    then `paged_decode_attention` (heads form) for the one new token per row, whose context (`context_lens`,
    counting the new token) ends at the written slot. Returns the attention output `[B, Hq, D]`. The query and
    the new key are the prologue's up to the order of the norm's sum, and the new token's score is a sum rather
    than a dot, so outputs agree with the two-launch path to rounding."""
    num_rows = qkv.shape[0]
    assert qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert positions.shape == slot_mapping.shape == context_lens.shape == (num_rows,)
    assert inv_freq.shape == (head_dim // 2,) and inv_freq.dtype == torch.float32
    _check_inputs(k_cache, v_cache, block_tables, context_lens, num_rows, num_heads, num_kv_heads, head_dim)
    assert k_cache.dtype in (qkv.dtype, torch.float8_e4m3fn), "the pool holds the model dtype or fp8 (e4m3)"
    assert not fp16_dots or k_cache.element_size() == 1, "fp16_dots is for an fp8 pool"
    out = torch.empty((num_rows, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_rows == 0:
        return out
    group = num_heads // num_kv_heads
    splits = num_splits or decode_num_splits(num_rows, num_kv_heads)
    if num_stages is None:
        num_stages = decode_num_stages(num_rows, num_kv_heads, splits)
    part_acc, part_ml = _partials(out, num_rows, splits)
    has_norm = q_weight is not None
    _decode_rope_split_kernel[(num_rows, num_kv_heads, splits)](
        qkv, positions, inv_freq.contiguous(), q_weight if has_norm else qkv, k_weight if has_norm else qkv,
        slot_mapping, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml,
        qkv.stride(0), out.stride(0), out.stride(1), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale * _LOG2E, eps, NUM_Q_HEADS=num_heads, HAS_NORM=has_norm, PAGE_SIZE=k_cache.shape[1], GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK=BLOCK_N, NUM_SPLITS=splits,
        DOT_PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32", FP16_DOTS=fp16_dots,
        INTERPRETED=INTERPRETED, num_warps=num_warps, num_stages=num_stages,
        **pdl_launch(qkv, num_rows, num_rows * num_kv_heads * splits),
    )
    _merge(part_acc, part_ml, context_lens, None, out, num_rows, splits, BLOCK_N)
    return out


def paged_decode_attention_ref(query, k_cache, v_cache, block_tables, context_lens, scale, num_splits=None):
    """Plain torch: gather each row's context and run softmax attention in fp32."""
    out = torch.empty_like(query)
    page_size = k_cache.shape[1]
    group = query.shape[1] // k_cache.shape[2]
    for row in range(query.shape[0]):
        n = int(context_lens[row])
        pages = block_tables[row, : -(-n // page_size)].long()
        key = k_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        value = v_cache[pages].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[row].float(), key) * scale
        out[row] = torch.einsum("hn,nhd->hd", scores.softmax(-1), value).to(query.dtype)
    return out
