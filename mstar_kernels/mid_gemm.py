"""GEMM for decode steps of tens of rows: `out = x @ weight.T + bias`, `x` `[M, K]` with M up to `MAX_ROWS`.

At 16-64 rows a projection is still mostly a weight stream (a 64-row step reads 30 MB of Qwen3-0.6B weights per
layer and does 4 GFLOP with them), but cuBLAS picks tiles made for compute: on the H200 at 64 rows it ran Qwen3-0.6B's
four projections at 1.2 TB/s in all, the o and down projections (N 1,024) at 0.7-0.9 TB/s on a few dozen CTAs,
plus a split-K reduce launch (docs/benchmarks.md, the 64-row step kernel by kernel). Here every program owns all
rows (`BLOCK_M`, padded to 16 for the tensor cores) and `BLOCK_N` output columns, and streams its weight tile in
`BLOCK_K` chunks through a software pipeline (`num_stages`) into `tl.dot`; narrow outputs split K over `SPLIT_K`
programs per column block, so that the grid covers the SMs.

Split K without a second launch: each program stores its fp32 partial sums to a workspace, then counts itself in
a per-tile counter (a CTA barrier, then an atomic at GPU scope with acquire/release); the last to arrive adds
the partials in split order (0, 1, ...: the same bits whichever program arrives last), writes the output and sets
the counter back to zero, so a captured graph replays it. The counters are one int32 buffer per device
(`counters`); kernels that use them must run one after another (one stream), as a decode step's do.

With `SWIGLU`, `x` is a packed gate/up projection `[M, 2K]` and the kernel reads `silu(gate) * up` on load, rounded
as mstar_kernels/silu_mul.py rounds (the SwiGLU down projection without the activation's launch). fp32 sums, the bias
added in fp32, one rounding to the output dtype; sums run in another order than cuBLAS's, so results differ in the
last bit now and then.

Alone it does not beat cuBLAS. `scripts/sweep_mid_gemm.py` on the H200 (2026-12-03, docs/benchmarks.md "A
tensor-core GEMM for steps of 16-64 rows"): at 64 rows cuBLAS and this kernel take the same ~5-6 us for
Qwen3-0.6B's qkv, o and gate_up (a launch floor: gate_up moves 50% more bytes than qkv in 0.6 us more); it won
only the o projections at 16 rows (5.87 -> 5.18 us, Llama's 9.91 -> 8.58), and its SwiGLU load ran 1.3-2x slower
than cuBLAS after `silu_mul`. What it gives is a chain: with `MSTAR_MID_GEMM` (mstar_common/layers/linear.py) the
layers run their projections of 5-64-row steps on it, and every launch of such a step then starts under PDL;
Qwen3-0.6B's 8-row step took 11% less (2026-12-04, docs/benchmarks.md "The projections of 8-32-row steps under
PDL").

Launched with PDL (mstar_kernels/_pdl.py, at the row counts it allows) a program loads its first weight chunk before it
waits for the kernel that writes `x`.

`mid_gemm_norm` takes a pre-norm block's residual add + RMSNorm into the loads (`NORM`): every program first takes
its rows' scales over the whole of K (from L2: tens of KB), then normalises each tile as it loads it, with the
roundings of mstar_kernels/rmsnorm.py; the programs of the first column block store the residual stream. The forms
that compute on their loads (`NORM`, `SWIGLU`) take at most `FOLD_BLOCK_K` columns of K an iteration, which keeps
them from spilling, with more pipeline stages in proportion (`fold_stages`). The decoder uses them with
`MSTAR_MID_GEMM_FOLD` (mstar_common/layers/linear.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar_kernels._pdl import gdc_enter, gdc_start, pdl_launch
from mstar_kernels.gemv import _inv_rms, _x_chunk

MAX_ROWS = 256
MAX_BLOCK_M = 64  # more rows take several row blocks (each streams the weights again, from L2 mostly)
COUNTERS = 1 << 16  # per-tile split-K counters per device: column blocks x row blocks of one launch
SMEM_BYTES = 200 * 1024  # what the pipelined tiles may take (an H100/H200 SM has 228 KB)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fp32: exact products (IEEE dots), for tests
# Columns of K per iteration of the forms that compute on their loads (the pre-norm's RMSNorm, SwiGLU), and of the
# normed form's pass for its row scales. Triton 3.6 for sm_90, 4 warps, 32 columns a program, asked for 256 columns
# and 3 stages (scripts/probe_kernel_resources.py --kernel mid_gemm): at 8 / 32 / 64 rows the normed form compiles to
# 72 / 104 / 150 registers a thread at 64 columns (and `fold_stages`' 12 / 12 / 9 stages), against 168 / 255 / 255
# with spills from 32 rows at 256; SwiGLU to 64 / 72 / 87 against 185 / 255 / 255, spilling from 32 rows (which
# fits the 2026-12-03 sweep's SwiGLU loads, 1.3-2x slower at 64 rows).
FOLD_BLOCK_K = 64


@triton.jit
def _x_tile(x_ptr, res_ptr, g_ptr, res_out_ptr, m, kk, x_mask, K, stride_xm, stride_rm, stride_ro, inv, res_rows,
            SWIGLU: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    if SWIGLU or NORM:
        return _x_chunk(x_ptr, res_ptr, g_ptr, res_out_ptr, m, kk, x_mask, K, stride_xm, stride_rm, stride_ro, inv,
                        res_rows, SWIGLU, NORM, HAS_RES).to(x_ptr.dtype.element_ty)
    return tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=x_mask, other=0.0)


@triton.jit
def _mid_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, res_ptr, g_ptr, res_out_ptr, M, N, K,
                     K_SPLIT, stride_xm, stride_wn, stride_om, stride_rm, stride_ro, eps, HAS_BIAS: tl.constexpr,
                     SWIGLU: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                     STAGES: tl.constexpr, USE_GDC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """With `NORM` (`mid_gemm_norm`): x is the block's input before its RMSNorm; every program takes its rows'
    scales over the whole of K first (`NORM_BLOCK_K` columns at a time, from L2), then normalises each tile as it
    loads it; the programs of the first column block store `x + residual` for their share of K."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = m < M, n < N
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    res_rows = tl.where(pid_n == 0, M, 0)
    inv = tl.zeros([BLOCK_M], dtype=tl.float32)
    start = k_lo
    if USE_GDC:
        # Launched with PDL: the first weight chunk streams in while the kernel that writes x finishes
        gdc_start(USE_GDC)
        kk = k_lo + k
        k_mask = kk < k_hi
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        gdc_enter(USE_GDC, True)
        if NORM:
            inv = _inv_rms(x_ptr, res_ptr, m, m_mask, K, stride_xm, stride_rm, eps, HAS_RES, BLOCK_M, NORM_BLOCK_K)
        x = _x_tile(x_ptr, res_ptr, g_ptr, res_out_ptr, m, kk, m_mask[:, None] & k_mask[None, :], K, stride_xm,
                    stride_rm, stride_ro, inv, res_rows, SWIGLU, NORM, HAS_RES)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        start = k_lo + BLOCK_K
    elif NORM:
        inv = _inv_rms(x_ptr, res_ptr, m, m_mask, K, stride_xm, stride_rm, eps, HAS_RES, BLOCK_M, NORM_BLOCK_K)
    for k0 in tl.range(start, k_hi, BLOCK_K, num_stages=STAGES):
        kk = k0 + k
        k_mask = kk < k_hi
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = _x_tile(x_ptr, res_ptr, g_ptr, res_out_ptr, m, kk, m_mask[:, None] & k_mask[None, :], K, stride_xm,
                    stride_rm, stride_ro, inv, res_rows, SWIGLU, NORM, HAS_RES)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + m[:, None] * stride_om + n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        rows_pad = tl.num_programs(2) * BLOCK_M
        tl.store(part_ptr + (pid_k * rows_pad + m)[:, None] * N + n[None, :], acc, mask=n_mask[None, :])
        tl.debug_barrier()  # every thread of this program has issued its partial sums
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last of the tile's splits: the others' partials are visible
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + (s * rows_pad + m)[:, None] * N + n[None, :], mask=n_mask[None, :],
                                 other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


def counters(device: torch.device | str) -> torch.Tensor:
    """The split-K tile counters of `device` (zeros; each launch leaves them at zero). Made on first use; call it
    before capturing a graph so that the buffer is not one graph's."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device.type, device.index)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def block_m_for(rows: int) -> int:
    return min(MAX_BLOCK_M, max(16, triton.next_power_of_2(max(1, rows))))


def fits(rows: int, n: int, k: int, block_n: int, block_k: int, split_k: int, num_stages: int) -> bool:
    """Whether a setting suits the shape: its tiles in shared memory (with PDL the first chunk's tile takes a buffer
    of its own: (64, 256, 3 stages) at 64 rows asked for 256 KB on the H200), K not split finer than one chunk per
    split, and its tiles within the counters."""
    block_m = block_m_for(rows)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(rows, block_m)
    smem = (block_m + block_n) * block_k * 2 * (max(1, num_stages) + 1)  # + 1: the tile loaded ahead of a PDL wait
    return (smem <= SMEM_BYTES and triton.cdiv(k, block_k) >= split_k and tiles <= COUNTERS
            and block_n >= 16 and block_k >= 16)


def chunking(computes: bool, block_m: int, block_n: int, block_k: int, num_stages: int) -> tuple[int, int]:
    """(BLOCK_K, stages) a launch runs: as asked, or for a form that computes on its loads (`NORM`, `SWIGLU`) at
    most `FOLD_BLOCK_K` columns, with `fold_stages`' stages."""
    if not computes or block_k <= FOLD_BLOCK_K:
        return block_k, num_stages
    return FOLD_BLOCK_K, fold_stages(block_m, block_n, block_k, num_stages)


def fold_stages(block_m: int, block_n: int, block_k: int, num_stages: int) -> int:
    """Pipeline stages for a computing form (`NORM`, `SWIGLU`) asked for `block_k` columns of K a chunk but run at
    `FOLD_BLOCK_K`: as many more as keep the same weight bytes in flight (a program streams its weight slice with
    `num_stages` chunks of `block_n x block_k` in flight; at 8-32 rows the grids hold one program an SM, so those
    bytes set its bandwidth), within `SMEM_BYTES` for tiles of two inputs (x and the residual, or gate and up)."""
    stages = max(num_stages, num_stages * block_k // FOLD_BLOCK_K)
    per_stage = (2 * block_m + block_n) * FOLD_BLOCK_K * 2
    return max(num_stages, min(stages, SMEM_BYTES // per_stage - 1))


def readable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether this kernel takes these tensors: one dtype of `DTYPES`, unit inner strides, 1-MAX_ROWS rows."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in DTYPES and weight.dtype == x.dtype
            and x.stride(1) == 1 and weight.stride(1) == 1
            and (bias is None or bias.dtype == x.dtype and bias.is_contiguous()))


def mid_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int = 32,
             block_k: int = 128, split_k: int = 1, num_warps: int = 4, num_stages: int = 3,
             swiglu: bool = False, kind: str | None = None) -> torch.Tensor:
    """`x` `[M, K]` (M <= MAX_ROWS; `[M, 2K]` gate | up with `swiglu`), `weight` `[N, K]`, `bias` `[N]` ->
    `[M, N]` in x's dtype. `split_k` > 1 spreads K over that many programs per column block (fewer where K has
    fewer `block_k` chunks than that; with `swiglu` at most `FOLD_BLOCK_K`). `kind` names the launch for the PDL
    switches (`mid:o_proj`, ...)."""
    return _launch(x, weight, bias, block_n, block_k, split_k, num_warps, num_stages, swiglu, None, kind)[0]


def mid_gemm_norm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                  bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, block_n: int = 32,
                  block_k: int = 128, split_k: int = 1, num_warps: int = 4, num_stages: int = 3,
                  kind: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's residual add and RMSNorm inside the projection after it, one launch: `h = x (+
    residual)`, `out = rms_norm(h, norm_weight, eps) @ weight.T + bias`; returns `(out, h)` (`h` is `x` itself
    without a residual). The roundings of mstar_kernels/rmsnorm.py then `mid_gemm` (the mean of squares summed in
    another order: an ulp here and there), as mstar_kernels/gemv.py `norm_gemv` for a few rows. `block_k` is
    capped at `FOLD_BLOCK_K`."""
    assert norm_weight.shape == (x.shape[-1],) and norm_weight.is_contiguous() and norm_weight.dtype == x.dtype
    assert residual is None or (residual.shape == x.shape and residual.stride(-1) == 1
                                and residual.dtype == x.dtype)
    return _launch(x, weight, bias, block_n, block_k, split_k, num_warps, num_stages, False,
                   (norm_weight, eps, residual), kind)


def _launch(x, weight, bias, block_n, block_k, split_k, num_warps, num_stages, swiglu, norm, kind):
    n, k = weight.shape
    assert readable(x, weight, bias), "x [M <= 256, K] and weight [N, K] in one dtype (bf16, fp16, fp32), unit stride"
    assert x.shape[1] == (2 * k if swiglu else k), "x's width must be K (2K with swiglu)"
    rows = x.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    norm_weight, eps, residual = norm if norm is not None else (weight, 0.0, None)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    res = residual if residual is not None else x
    block_m = block_m_for(rows)
    block_k, num_stages = chunking(norm is not None or swiglu, block_m, block_n, block_k, num_stages)
    chunks = triton.cdiv(k, block_k)
    per_split = triton.cdiv(chunks, max(1, split_k))
    split_k = triton.cdiv(chunks, per_split)
    grid_n, grid_m = triton.cdiv(n, block_n), triton.cdiv(rows, block_m)
    if split_k > 1:
        assert grid_n * grid_m <= COUNTERS, "too many tiles for the split-K counters"
        part = torch.empty((split_k, grid_m * block_m, n), dtype=torch.float32, device=x.device)
        count = counters(x.device)
    else:
        part = count = out
    _mid_gemm_kernel[(grid_n, split_k, grid_m)](
        x, weight, bias if bias is not None else weight, out, part, count, res, norm_weight, res_out, rows, n, k,
        per_split * block_k, x.stride(0), weight.stride(0), out.stride(0), res.stride(0), res_out.stride(0), eps,
        HAS_BIAS=bias is not None, SWIGLU=swiglu, NORM=norm is not None, HAS_RES=residual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NORM_BLOCK_K=FOLD_BLOCK_K,
        SPLIT_K=split_k, STAGES=num_stages, num_warps=num_warps, num_stages=num_stages,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **pdl_launch(x, rows, grid_n * split_k * grid_m, kind=kind),
    )
    return out, res_out

