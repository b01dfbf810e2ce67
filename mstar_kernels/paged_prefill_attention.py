"""Causal attention for ragged (varlen) query rows over a paged KV cache: prefill chunks, mixed steps.

Row `r` owns packed queries `query_start_loc[r]:query_start_loc[r+1]`, the last tokens of its context of
`context_lens[r]` tokens (already written to the cache). Work is a host-built list of (row, first query of a
BLOCK_M block) items, padded with row -1, so the grid `(items, Hq)` depends only on a step's token/row bucket:
CUDA-graph safe. Each program runs a flash-attention loop over the row's keys up to the block's last position.

Two forms (`MSTAR_PREFILL_ATTENTION`): `plain`, one query head a program with the causal mask on every block of
keys; `grouped`, the query heads of one KV head together in a program (up to 128 query rows: one load of each K
and V block serves them all, in one larger dot), the keys below the block's diagonal in a loop without the mask,
and, where a page holds whole blocks of keys, one page-table read a block instead of one a key.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from mstar_common.engine.attention import (  # noqa: F401 - re-exported
    KERNEL_HEAD_DIMS,
    build_prefill_work,
    prefill_work_capacity,
)
from mstar_common.engine.attention import PREFILL_BLOCK_M as BLOCK_M  # queries per program

_LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys per inner iteration
FORMS = ("plain", "grouped")
SWITCH_VALUES = (*FORMS, "auto")
GROUPED_ROWS = 128  # query rows (heads x queries) a grouped program takes at most
# Query heads a grouped program takes unless asked (`heads_per_program`): one. Timed on the H200 (2026-12-05,
# scripts/sweep_decode_attention.py --prefill, docs/benchmarks.md): one head a program, 64 keys, 4 warps, 2 stages was
# the best grouped launch at every shape (Qwen3-0.6B 8x512 47.9 us, 1x4096 219.8 us; Llama-3.2-3B 8x512 65.9 us,
# 1x4096 303.5 us), 12-30% under the plain form's best (53.9, 285.9, 74.6, 394.9 us); two heads a program (128
# rows) gained nothing over the plain form. The gain is the unmasked blocks below the diagonal and the page table
# read once a block, not the shared K/V loads.
GROUPED_HEADS = 1


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


@triton.jit
def _block_slots(bt_ptr, row, stride_bt, n0, t, t_mask, PAGE_SIZE: tl.constexpr, BN: tl.constexpr,
                 MASKED: tl.constexpr):
    """The KV slots of keys `n0 .. n0 + BN`: one page-table read where a page holds whole blocks, else one a key."""
    if PAGE_SIZE % BN == 0:
        page = tl.load(bt_ptr + row * stride_bt + n0 // PAGE_SIZE).to(tl.int64)
        return page * PAGE_SIZE + (n0 % PAGE_SIZE) + tl.arange(0, BN)
    elif MASKED:
        page = tl.load(bt_ptr + row * stride_bt + t // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)
        return page * PAGE_SIZE + t % PAGE_SIZE
    else:
        page = tl.load(bt_ptr + row * stride_bt + t // PAGE_SIZE).to(tl.int64)
        return page * PAGE_SIZE + t % PAGE_SIZE


@triton.jit
def _grouped_block(q, k_ptr, v_ptr, bt_ptr, row, stride_bt, n0, kv_end, q_pos, kv_off, d, stride_slot, m, lsum,
                   acc, scale_log2, PAGE_SIZE: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """One block of keys into the running softmax of every query row; `MASKED` for the blocks that reach the
    context's end or a query's own position, the others take no mask at all."""
    t = n0 + tl.arange(0, BN)
    t_mask = t < kv_end
    slots = _block_slots(bt_ptr, row, stride_bt, n0, t, t_mask, PAGE_SIZE, BN, MASKED)
    offs = slots[:, None] * stride_slot + kv_off + d[None, :]
    if MASKED:
        k = tl.load(k_ptr + offs, mask=t_mask[:, None], other=0.0).to(q.dtype)
    else:
        k = tl.load(k_ptr + offs).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        s = tl.where(t_mask[None, :] & (t[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    lsum = lsum * alpha + tl.sum(p, axis=1)
    if MASKED:
        v = tl.load(v_ptr + offs, mask=t_mask[:, None], other=0.0).to(q.dtype)
    else:
        v = tl.load(v_ptr + offs).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, lsum, acc


@triton.jit
def _prefill_grouped_kernel(q_ptr, k_ptr, v_ptr, o_ptr, qsl_ptr, ctx_ptr, bt_ptr, work_row_ptr, work_q_ptr,
                            num_items, stride_qt, stride_qh, stride_ot, stride_oh, stride_slot, stride_kv_head,
                            stride_bt, scale_log2, PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr,
                            HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            DOT_PRECISION: tl.constexpr):
    """`HEADS` query heads of one KV head (a power of two; those past the group are padding) x the `BM` queries
    of one work item, as one tile of `HEADS * BM` rows (row `r`: head `r // BM`, query `r % BM`). Items run last
    first: a row's later query blocks attend over more keys, so the longest programs start first."""
    item = num_items - 1 - tl.program_id(0)
    CHUNKS: tl.constexpr = (GROUP + HEADS - 1) // HEADS
    kv_head = tl.program_id(1) // CHUNKS
    first_local = (tl.program_id(1) % CHUNKS) * HEADS
    row_raw = tl.load(work_row_ptr + item)
    row = tl.maximum(row_raw, 0).to(tl.int64)
    q_first = tl.load(work_q_ptr + item)
    q_start = tl.load(qsl_ptr + row)
    q_len = tl.where(row_raw >= 0, tl.load(qsl_ptr + row + 1) - q_start, 0)
    ctx = tl.load(ctx_ptr + row)
    r = tl.arange(0, HEADS * BM)
    m_idx = q_first + r % BM
    local = first_local + r // BM
    r_mask = (m_idx < q_len) & (local < GROUP)
    head = kv_head * GROUP + tl.minimum(local, GROUP - 1)
    q_pos = ctx - q_len + m_idx
    d = tl.arange(0, HEAD_DIM)
    tok = (q_start + m_idx).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=r_mask[:, None],
                other=0.0)
    m = tl.full([HEADS * BM], float("-inf"), tl.float32)
    lsum = tl.zeros([HEADS * BM], tl.float32)
    acc = tl.zeros([HEADS * BM, HEAD_DIM], tl.float32)
    first_pos = ctx - q_len + q_first  # the block's first query sees every key up to here
    kv_end = tl.where(q_len > 0, tl.minimum(ctx, first_pos + BM), 0)
    open_end = tl.where(q_len > 0, (first_pos + 1) // BN * BN, 0)
    kv_off = kv_head * stride_kv_head
    for n0 in range(0, open_end, BN):
        m, lsum, acc = _grouped_block(q, k_ptr, v_ptr, bt_ptr, row, stride_bt, n0, kv_end, q_pos, kv_off, d,
                                      stride_slot, m, lsum, acc, scale_log2, PAGE_SIZE, BN, False, DOT_PRECISION)
    for n0 in range(open_end, kv_end, BN):
        m, lsum, acc = _grouped_block(q, k_ptr, v_ptr, bt_ptr, row, stride_bt, n0, kv_end, q_pos, kv_off, d,
                                      stride_slot, m, lsum, acc, scale_log2, PAGE_SIZE, BN, True, DOT_PRECISION)
    out = acc / lsum[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=r_mask[:, None])


def prefill_form() -> str:
    """`MSTAR_PREFILL_ATTENTION`: `grouped` (the default: 12-30% faster on the H200, `GROUPED_HEADS`), `plain`, or
    `auto` (each shape of heads times both forms on its GPU once, `auto_form`)."""
    value = os.environ.get("MSTAR_PREFILL_ATTENTION", "") or "grouped"
    if value not in SWITCH_VALUES:
        raise ValueError(f"MSTAR_PREFILL_ATTENTION={value!r}: expected one of {', '.join(SWITCH_VALUES)}")
    return value


# MSTAR_PREFILL_ATTENTION=auto: the forms are timed on these steps of fresh prompts (prompts, tokens each: the
# benchmark's step and a prompt of the default step budget), summed, and the grouped form is kept where it is at
# least AUTO_MIN_GAIN faster. One choice a process per (heads, KV heads, head size, page size, dtype, device).
AUTO_WORKLOADS = ((8, 512), (1, 2048))
AUTO_MIN_GAIN = 0.02
_AUTO_CHOICES: dict[tuple, str] = {}
_logger = logging.getLogger(__name__)


def _bench_us(fn: Callable[[], object], form: str) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=25) * 1e3


Timer = Callable[[Callable[[], object], str], float]  # (the launch, its form) -> microseconds


def fresh_prompts(rows: int, prompt: int, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                  dtype: torch.dtype, kv_dtype: torch.dtype, device, seed: int = 0) -> tuple:
    """`paged_prefill_attention`'s arguments (through the scale) for `rows` fresh prompts of `prompt` tokens each,
    random, in shuffled pages: what `choose_form` and scripts/sweep_decode_attention.py time."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = rows * -(-prompt // page_size)
    shape = (pages + 1, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device).to(kv_dtype)
    v_cache = torch.randn(shape, generator=gen, device=device).to(kv_dtype)
    tables = (torch.randperm(pages, generator=gen, device=device).to(torch.int32) + 1).view(rows, -1)
    ctx = torch.full((rows,), prompt, dtype=torch.int32, device=device)
    qsl = torch.arange(0, (rows + 1) * prompt, prompt, dtype=torch.int32, device=device)
    query = torch.randn((rows * prompt, num_heads, head_dim), generator=gen, device=device).to(dtype)
    work = [torch.tensor(w, dtype=torch.int32, device=device)
            for w in build_prefill_work([prompt] * rows, prefill_work_capacity(rows * prompt, rows))]
    return (query, k_cache, v_cache, qsl, ctx, tables, *work, head_dim**-0.5)


def choose_form(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                kv_dtype: torch.dtype, device: torch.device, timer: Timer = _bench_us,
                workloads=AUTO_WORKLOADS) -> tuple[str, dict[str, float]]:
    """Both forms timed (`timer(fn, form)` -> us) on `workloads` of fresh prompts with these heads (queries in
    `dtype`, a pool in `kv_dtype`), summed:
    (`grouped` where it is AUTO_MIN_GAIN faster than `plain`, else `plain`; the totals)."""
    totals = dict.fromkeys(FORMS, 0.0)
    for rows, prompt in workloads:
        args = fresh_prompts(rows, prompt, num_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype, device)
        for form in FORMS:
            totals[form] += timer(lambda a=args, f=form: paged_prefill_attention(*a, form=f), form)
    chosen = "grouped" if totals["grouped"] <= totals["plain"] * (1 - AUTO_MIN_GAIN) else "plain"
    return chosen, totals


def auto_form(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
              kv_dtype: torch.dtype, device: torch.device) -> str:
    """The form `MSTAR_PREFILL_ATTENTION=auto` runs for these heads: timed on the first call outside a graph
    capture (a captured step's warm-ups run first), then kept. `plain` off CUDA (where nothing is timed) and, with
    a warning, in a capture that finds no choice made."""
    key = (num_heads, num_kv_heads, head_dim, page_size, str(dtype), str(kv_dtype), str(device))
    if key in _AUTO_CHOICES:
        return _AUTO_CHOICES[key]
    if device.type != "cuda":
        return "plain"
    if torch.cuda.is_current_stream_capturing():
        _logger.warning("prefill attention (MSTAR_PREFILL_ATTENTION=auto): no form timed before this capture; "
                        "it runs the plain form")
        return "plain"
    chosen, totals = choose_form(num_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype, device)
    _AUTO_CHOICES[key] = chosen
    _logger.info("prefill attention (MSTAR_PREFILL_ATTENTION=auto), %d/%d heads of %d, pages of %d, %s pool: "
                 "plain %.1f us, grouped %.1f us over %s prompts x tokens: %s", num_heads, num_kv_heads, head_dim,
                 page_size, str(kv_dtype).removeprefix("torch."), totals["plain"], totals["grouped"],
                 " + ".join(f"{r}x{p}" for r, p in AUTO_WORKLOADS), chosen)
    return chosen


def grouped_heads(group: int, block_m: int = BLOCK_M) -> int:
    """Query heads a grouped program can take: the group rounded up to a power of two, at most GROUPED_ROWS rows
    (the default is `GROUPED_HEADS`)."""
    return max(1, min(triton.next_power_of_2(group), GROUPED_ROWS // block_m))


def grouped_launch(heads: int) -> tuple[int, int, int]:
    """(keys per iteration, warps, pipeline stages) of a grouped program of `heads` query heads, as compiled for
    sm_90 (`scripts/probe_kernel_resources.py --kernel prefill`, Triton 3.6 and 3.9): a 128-row tile takes 32 keys,
    8 warps and 3 stages, 115-127 registers and no spills, two programs an SM (2 stages: 139 registers for a group
    of 3, one program; 64 keys: 161-170, one; 4 warps spill); a 64-row tile the plain form's 64 keys, 4 warps and
    2 stages. Timed on the H200: the 64-row tile's launch is the best of the sweep (`GROUPED_HEADS`)."""
    return (32, 8, 3) if heads * BLOCK_M >= 128 else (BLOCK_N, 4, 2)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                            work_rows: torch.Tensor, work_firsts: torch.Tensor, scale: float,
                            block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                            form: str | None = None, heads_per_program: int | None = None) -> torch.Tensor:
    """`query` `[T, Hq, D]` -> `[T, Hq, D]`; tokens not covered by a work item are left unwritten. `form`:
    `plain`, `grouped` or `auto` (None: `MSTAR_PREFILL_ATTENTION`); `heads_per_program` (grouped only, a power of two;
    None: `GROUPED_HEADS`). The launch knobs (keys per iteration, warps, pipeline stages; None takes 64, 4 and 2, or
    `grouped_launch`'s) are swept by `scripts/sweep_decode_attention.py --prefill`."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    assert query.stride(2) == 1 and num_heads % num_kv_heads == 0 and head_dim in KERNEL_HEAD_DIMS
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert k_cache.stride(0) == page_size * k_cache.stride(1), "each page must be contiguous"
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1 and block_tables.dtype == torch.int32
    assert work_rows.shape == work_firsts.shape and work_rows.dtype == work_firsts.dtype == torch.int32
    form = form or prefill_form()
    if form == "auto":
        form = auto_form(num_heads, num_kv_heads, head_dim, page_size, query.dtype, k_cache.dtype, query.device)
    if form not in FORMS:
        raise ValueError(f"prefill attention form must be one of {SWITCH_VALUES}, got {form!r}")
    out = torch.empty_like(query)
    if num_tokens == 0 or work_rows.numel() == 0:
        return out
    group = num_heads // num_kv_heads
    dot_precision = "ieee" if query.dtype == torch.float32 else "tf32"
    if form == "grouped":
        heads = heads_per_program or GROUPED_HEADS
        if heads & (heads - 1):
            raise ValueError(f"heads_per_program must be a power of two, got {heads}")
        default_n, default_warps, default_stages = grouped_launch(heads)
        _prefill_grouped_kernel[(work_rows.shape[0], num_kv_heads * -(-group // heads))](
            query, k_cache, v_cache, out, query_start_loc, context_lens, block_tables, work_rows, work_firsts,
            work_rows.shape[0], query.stride(0), query.stride(1), out.stride(0), out.stride(1), k_cache.stride(1),
            k_cache.stride(2), block_tables.stride(0), scale * _LOG2E,
            PAGE_SIZE=page_size, GROUP=group, HEADS=heads, HEAD_DIM=head_dim, BM=BLOCK_M, BN=block_n or default_n,
            DOT_PRECISION=dot_precision, num_warps=num_warps or default_warps, num_stages=num_stages or default_stages,
        )
        return out
    _prefill_kernel[(work_rows.shape[0], num_heads)](
        query, k_cache, v_cache, out, query_start_loc, context_lens, block_tables, work_rows, work_firsts,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), scale * _LOG2E,
        PAGE_SIZE=page_size, GROUP=group, HEAD_DIM=head_dim, BM=BLOCK_M, BN=block_n or BLOCK_N,
        DOT_PRECISION=dot_precision, num_warps=num_warps or 4, num_stages=num_stages or 2,
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
