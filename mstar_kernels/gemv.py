"""Skinny GEMM for decode steps with a handful of rows: `out = x @ weight.T + bias`, `x` `[M, K]` with M <= 8.

At one to a few rows a projection is a weight stream, and the GPU is only as fast as the number of weight
bytes in flight. cuBLAS tiles N by 64 or more for such shapes, so a 1,024- or 1,280-wide output runs on 16-20
of an H200's 132 SMs (profiled: 5-6 us for a 3-6 MB weight, ~0.6-1 TB/s). Here each program owns `BLOCK_N`
output columns (a few, so that N / BLOCK_N programs cover the SMs several times) and streams their weight rows
in `BLOCK_K` chunks, with every row of `x` multiplied against each chunk; fp32 accumulation, the bias added in
fp32, one rounding to the output dtype (as cuBLAS's epilogue). Sums run in another order than cuBLAS's, so
results differ in the last bit now and then.

`scripts/sweep_gemv.py` times it against `F.linear` at the served models' projection shapes. The layers use it
for steps of up to `MSTAR_GEMV_MAX_ROWS` rows (default 4), and only where `tune_gemv`
(`mstar_common/layers/linear.py`) timed it 5% (or 2 us) faster than cuBLAS on the GPU at hand (on the H200: the
output-narrow projections, o and down, at one row; Qwen3-0.6B's o at 12.4 -> 3.2 us).

`norm_gemv` also takes a pre-norm block's residual add + RMSNorm in its load (`MSTAR_NORM_GEMV`, by default where
`tune_gemv` timed it faster; mstar_common/layers/decoder.py): each program computes the row's mean of squares
itself (a few KB from L2) and program 0 writes the summed residual stream to a new tensor (others may still be
reading the old one).

Launched with PDL (mstar_kernels/_pdl.py: Hopper or newer, `MSTAR_PDL` not 0) a program loads its first weight chunk
before it waits for the kernel that writes `x`, so the weight stream overlaps that kernel's tail.

Inside `compile_only()` the calls compile their kernel and launch nothing (their outputs stay unwritten): the GEMV
tuning's parallel pre-compile (mstar_common/layers/linear.py `precompile_gemv_candidates`) calls them so under
Triton's `AsyncCompileMode`, which hands each compile to a thread pool.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import triton
import triton.language as tl

from mstar_common.config import env_switch
from mstar_kernels._pdl import gdc_enter, gdc_start, pdl_launch
from mstar_kernels._rounding import round_to

MAX_ROWS = 8
TILE_ELEMENTS = 8192  # x-by-weight products held per iteration (fp32, across the program's threads)
_COMPILE_ONLY = contextvars.ContextVar("mstar_gemv_compile_only", default=False)


@contextlib.contextmanager
def compile_only():
    """Within it, `gemv`/`norm_gemv` compile their kernel (Triton's `warmup`) and launch nothing (module docstring)."""
    token = _COMPILE_ONLY.set(True)
    try:
        yield
    finally:
        _COMPILE_ONLY.reset(token)


@triton.jit
def _residual_sum(x_ptr, res_ptr, m, k, mask, stride_xm, stride_rm, HAS_RES: tl.constexpr):
    """Rows `m` of `x` (+ `residual`, the sum rounded as eager torch rounds it) at columns `k`, in fp32."""
    x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + m[:, None] * stride_rm + k[None, :], mask=mask, other=0.0)
        x32 = round_to(x32 + r.to(tl.float32), x.dtype)
    return x32


@triton.jit
def _inv_rms(x_ptr, res_ptr, m, m_mask, K, stride_xm, stride_rm, eps, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(h^2) + eps) per row of h = x (+ residual): every program takes it over the whole row (a few KB
    from L2), so no launch before this one has to."""
    sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        h = _residual_sum(x_ptr, res_ptr, m, k0 + k, m_mask[:, None] & (k0 + k < K)[None, :], stride_xm, stride_rm,
                          HAS_RES)
        sq += h * h
    return tl.rsqrt(tl.sum(sq, axis=1) / K + eps)


@triton.jit
def _x_chunk(x_ptr, res_ptr, g_ptr, res_out_ptr, m, k, x_mask, K, stride_xm, stride_rm, stride_ro, inv, res_rows,
             SWIGLU: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """Rows `m` of the GEMV's input at columns `k` in fp32. With `SWIGLU` (x is [M, 2K]: gate | up)
    silu(gate) * up, rounded as mstar_kernels/silu_mul.py rounds. With `NORM`: RMSNorm of x (+ residual) with the
    weight `g` and the row scales `inv`, rounded as mstar_kernels/rmsnorm.py rounds; its first `res_rows` rows (M in
    program 0, else none) store the summed residual stream."""
    if NORM:
        h = _residual_sum(x_ptr, res_ptr, m, k, x_mask, stride_xm, stride_rm, HAS_RES)
        g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        return _normed(h, g, inv, res_out_ptr, m, k, x_mask, stride_ro, res_rows, x_ptr.dtype.element_ty, HAS_RES)
    x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
    if SWIGLU:
        up = tl.load(x_ptr + m[:, None] * stride_xm + K + k[None, :], mask=x_mask, other=0.0)
        gate = x.to(tl.float32)
        act = round_to(gate / (1.0 + tl.exp(-gate)), x.dtype)
        return round_to(act * up.to(tl.float32), x.dtype)
    return x.to(tl.float32)


@triton.jit
def _normed(h, g, inv, res_out_ptr, m, k, x_mask, stride_ro, res_rows, dtype: tl.constexpr, HAS_RES: tl.constexpr):
    """RMSNorm of the chunk `h` of x (+ residual) with the weight chunk `g` and the row scales `inv`, rounded as
    mstar_kernels/rmsnorm.py rounds; its first `res_rows` rows store the summed residual stream."""
    if HAS_RES:
        tl.store(res_out_ptr + m[:, None] * stride_ro + k[None, :], h.to(dtype), mask=x_mask & (m < res_rows)[:, None])
    return round_to(round_to(h * inv[:, None], dtype) * g[None, :], dtype)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, res_ptr, g_ptr, res_out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 stride_rm, stride_ro, eps, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, NORM: tl.constexpr,
                 HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 STAGES: tl.constexpr, ONE_CHUNK: tl.constexpr, USE_GDC: tl.constexpr):
    """`ONE_CHUNK`: BLOCK_K covers the whole of K, so a normed input is read once (under PDL: after the wait), not
    once for its row scales and again for the products."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_mask, m_mask = n < N, m < M
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k = tl.arange(0, BLOCK_K)
    res_rows = tl.where(pid == 0, M, 0)
    inv = tl.zeros([BLOCK_M], dtype=tl.float32)
    start = 0
    if USE_GDC or (NORM and ONE_CHUNK):
        # Launched with PDL: the first chunk of weights streams in while the kernel before this one (which
        # writes x) finishes; the weights are nobody's output. Same sums in the same order as the loop's.
        # A normed input's weight chunk is nobody's output either. With the whole of K in this chunk, x (+ the
        # residual) is read once after the wait: one trip to L2 on the step's chain, not three (the row scales'
        # read, the chunk's read, then the norm weight behind the residual's store).
        gdc_start(USE_GDC)
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        x_mask = m_mask[:, None] & (k < K)[None, :]
        if NORM and ONE_CHUNK:
            g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            gdc_enter(USE_GDC, True)
            h = _residual_sum(x_ptr, res_ptr, m, k, x_mask, stride_xm, stride_rm, HAS_RES)
            inv = tl.rsqrt(tl.sum(h * h, axis=1) / K + eps)
            x = _normed(h, g, inv, res_out_ptr, m, k, x_mask, stride_ro, res_rows, x_ptr.dtype.element_ty, HAS_RES)
        else:
            gdc_enter(USE_GDC, True)
            if NORM:
                inv = _inv_rms(x_ptr, res_ptr, m, m_mask, K, stride_xm, stride_rm, eps, HAS_RES, BLOCK_M, BLOCK_K)
            x = _x_chunk(x_ptr, res_ptr, g_ptr, res_out_ptr, m, k, x_mask, K, stride_xm, stride_rm, stride_ro, inv,
                         res_rows, SWIGLU, NORM, HAS_RES)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        start = BLOCK_K
    elif NORM:
        inv = _inv_rms(x_ptr, res_ptr, m, m_mask, K, stride_xm, stride_rm, eps, HAS_RES, BLOCK_M, BLOCK_K)
    for k0 in tl.range(start, K, BLOCK_K, num_stages=STAGES):
        kk = k0 + k
        k_mask = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        x = _x_chunk(x_ptr, res_ptr, g_ptr, res_out_ptr, m, kk, m_mask[:, None] & k_mask[None, :], K, stride_xm,
                     stride_rm, stride_ro, inv, res_rows, SWIGLU, NORM, HAS_RES)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _one_chunk() -> bool:
    """`MSTAR_GEMV_NORM_ONE_READ` (default 1): a launch whose chunk covers the whole of K reads its normed input
    once (`ONE_CHUNK`; under PDL after its wait, with the norm weight loaded before it); 0 keeps the general
    path's reads, for A/Bs. Read at each launch, so at capture for a graph."""
    return env_switch("MSTAR_GEMV_NORM_ONE_READ", True)


def gemv_blocks(num_rows: int, n: int, k: int, num_sms: int = 132) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): enough programs for ~4 per SM; as much of K per iteration as a tile of
    `TILE_ELEMENTS` (rows x columns x K) allows, so each program has its whole weight slice in flight at once
    (with `num_stages` 1 the loop is not software-pipelined: every iteration waits for its loads)."""
    block_n = 1
    while block_n < 16 and n // (block_n * 2) >= 4 * num_sms:
        block_n *= 2
    rows = triton.next_power_of_2(max(1, num_rows))
    block_k = max(64, min(triton.next_power_of_2(k), TILE_ELEMENTS // (block_n * rows)))
    return block_n, block_k


def gemv_warps(num_rows: int, block_n: int, block_k: int) -> int:
    return 8 if triton.next_power_of_2(max(1, num_rows)) * block_n * block_k > 4096 else 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int | None = None,
         block_k: int | None = None, num_warps: int | None = None, swiglu: bool = False,
         num_stages: int = 1, kind: str | None = None) -> torch.Tensor:
    """`x` `[M, K]` (M <= 8), `weight` `[N, K]` (an `nn.Linear`'s), `bias` `[N]` -> `[M, N]` in x's dtype.
    With `swiglu`, `x` is a packed gate/up projection `[M, 2K]` and the product reads `silu(gate) * up` (the
    SwiGLU MLP's down projection without the activation's own kernel and its `[M, K]` round trip).
    `num_stages` > 1 software-pipelines the K loop (the next chunks' loads issued before this chunk's sums).
    `kind`: the projection's name for `MSTAR_PDL_AHEAD_OF` (mstar_kernels/_pdl.py; default `gemv:NxK`)."""
    assert weight.dim() == 2 and weight.shape[1] * (2 if swiglu else 1) == x.shape[-1], \
        "x's width must be K (2K with swiglu)"
    return _launch(x, weight, bias, block_n, block_k, num_warps, num_stages, swiglu=swiglu, kind=kind)[0]


def norm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
              bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, block_n: int | None = None,
              block_k: int | None = None, num_warps: int | None = None, num_stages: int = 1,
              kind: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's RMSNorm and the projection after it as one launch: `h = x (+ residual)`,
    `out = rms_norm(h, norm_weight, eps) @ weight.T + bias`; returns `(out, h)` (h is `x` itself without a
    residual, else a new tensor: the residual stream for the next block). Same roundings as mstar_kernels/rmsnorm.py
    then `gemv` (the mean of squares summed in another order: an ulp here and there)."""
    assert norm_weight.shape == (x.shape[-1],) and norm_weight.is_contiguous() and norm_weight.dtype == x.dtype
    assert weight.dim() == 2 and weight.shape[1] == x.shape[-1], "x's width must be K"
    assert residual is None or (residual.shape == x.shape and residual.stride(-1) == 1
                                and residual.dtype == x.dtype)
    return _launch(x, weight, bias, block_n, block_k, num_warps, num_stages, norm=(norm_weight, eps, residual),
                   kind=kind)


def _launch(x, weight, bias, block_n, block_k, num_warps, num_stages, swiglu=False, norm=None, kind=None):
    assert x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(1) == 1, "x must be [M <= 8, K], unit stride"
    assert weight.stride(1) == 1
    assert bias is None or (bias.shape == (weight.shape[0],) and bias.is_contiguous())
    num_rows, (n, k) = x.shape[0], weight.shape
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    norm_weight, eps, residual = norm if norm is not None else (weight, 0.0, None)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    if num_rows == 0:
        return out, res_out
    default_n, default_k = gemv_blocks(num_rows, n, k)
    block_n, block_k = block_n or default_n, block_k or default_k
    num_warps = num_warps or gemv_warps(num_rows, block_n, block_k)
    res = residual if residual is not None else x
    grid = (triton.cdiv(n, block_n),)
    args = (x, weight, bias if bias is not None else weight, out, res, norm_weight, res_out, num_rows, n, k,
            x.stride(0), weight.stride(0), out.stride(0), res.stride(0), res_out.stride(0), eps)
    meta = dict(HAS_BIAS=bias is not None, SWIGLU=swiglu, NORM=norm is not None, HAS_RES=residual is not None,
                BLOCK_M=max(1, triton.next_power_of_2(num_rows)), BLOCK_N=block_n, BLOCK_K=block_k,
                STAGES=num_stages, ONE_CHUNK=block_k >= k and _one_chunk(), num_warps=num_warps,
                num_stages=num_stages, **pdl_launch(x, num_rows, grid[0], kind=kind or f"gemv:{n}x{k}"))
    if _COMPILE_ONLY.get():
        _gemv_kernel.warmup(*args, grid=grid, **meta)
    else:
        _gemv_kernel[grid](*args, **meta)
    return out, res_out


def gemv_with(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, setting: tuple,
              swiglu: bool = False, kind: str | None = None) -> torch.Tensor:
    """`gemv` with a tuned setting: (BLOCK_N, BLOCK_K) or (BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    block_n, block_k, *rest = setting
    num_warps, num_stages = rest if rest else (None, 1)
    return gemv(x, weight, bias, block_n, block_k, num_warps, swiglu=swiglu, num_stages=num_stages, kind=kind)


def norm_gemv_with(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                   bias: torch.Tensor | None, residual: torch.Tensor | None, setting: tuple,
                   kind: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_gemv` with a tuned setting (as `gemv_with`'s)."""
    block_n, block_k, *rest = setting
    num_warps, num_stages = rest if rest else (None, 1)
    return norm_gemv(x, norm_weight, eps, weight, bias, residual, block_n, block_k, num_warps, num_stages, kind)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 products and sums, one rounding at the end."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
