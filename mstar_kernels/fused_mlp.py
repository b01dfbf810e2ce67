"""A decoder layer's MLP half at a few rows as one persistent launch: residual add + RMSNorm, the gate/up
projection, SwiGLU and the down projection, with a grid-wide barrier between the two projections.

    h = x + residual;  a = rms_norm(h) @ W_gate_up.T  (phase 1);  out = (silu(gate) * up) @ W_down.T  (phase 2)

Why. A one-row decode step is a chain of ~270 short kernels, and the GPU spends most of the step in their latency
chain rather than in weight bytes (docs/benchmarks.md). Here the grid is one program per SM, and each owns one
contiguous slice of gate/up columns and one of down columns, taken a block of columns (by the whole K) at a time,
with the load of the block two ahead issued before this block's sums (a persistent program must keep its own
loads in flight: no other program on its SM hides their latency). In phase 1 each program takes the row's mean
of squares itself, as mstar_kernels/gemv.py `norm_gemv` does. Each program then loads the first two blocks of its
down-projection weights, arrives at the barrier (an atomic counter, release/acquire at GPU scope) and waits
there for the others' gate/up columns: the down weights are in flight while the slowest program finishes phase
1, and the chain has one link where it had three (norm, gate_up, down). Launched with PDL (mstar_kernels/_pdl.py),
phase 1's first two blocks also load before the wait for the kernel that writes `x`.

Measured slower than the three PDL-chained launches it replaces (H200, one-row steps: Qwen3-0.6B 0.851 -> 0.918
ms, Llama-3.2-3B 2.252 -> 2.866 ms; docs/benchmarks.md), so the layers use it only when asked
(`MSTAR_FUSED_MLP_ROWS`). Its barrier is what a whole-step persistent kernel would need.

The barrier needs every program resident at once: the grid is at most the SM count, and one program per SM
always fits. A counter pair per caller (`sync`, two int32 zeros) is handed back at zero by the last program to
leave, so a captured graph replays it. The interpreter (`TRITON_INTERPRET=1`) runs programs one after another, so
a barrier cannot run there: with `split` (the default off CUDA) the two phases launch as two kernels, the same code
without the barrier (the CPU tests run so; a GPU test checks that both ways give the same bits).

Numerics are those of `norm_gemv` then `gemv(swiglu=True)`: the residual sum and the norm rounded as
mstar_kernels/rmsnorm.py rounds, gate/up rounded to the activation dtype, SwiGLU as mstar_kernels/silu_mul.py,
fp32 sums.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mstar_kernels._pdl import gdc_enter, pdl_launch
from mstar_kernels._rounding import round_to
from mstar_kernels.gemv import MAX_ROWS, _residual_sum, _x_chunk


@triton.jit
def _grid_barrier(sync_ptr, target):
    """Every program arrives, then waits until the counter reaches `target`: the number of programs for a launch's
    only barrier, (i + 1) x that for the i-th of several (the counter only grows until `_grid_leave`). Writes
    before it are visible after it."""
    tl.debug_barrier()  # this program's threads have all issued their stores
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _grid_leave(sync_ptr, num_programs):
    """The last program past every barrier puts the counters back to zero for the next launch."""
    tl.debug_barrier()
    left = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == num_programs - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + 1, 0, sem="release", scope="gpu")


@triton.jit
def _rows_times(v, w):
    """`v` `[BLOCK_M, K]` (fp32) times the weight rows `w` `[BLOCK_N, K]` -> `[BLOCK_M, BLOCK_N]`, fp32 sums."""
    return tl.sum(v[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _block_loads(w_ptr, stride_w, n0, j, last, k, k_mask):
    """Weight rows [n0, n0 + BLOCK_N) (those below `last`) by the whole K; rows at or past `last` load nothing."""
    return tl.load(w_ptr + (n0 + j).to(tl.int64)[:, None] * stride_w + k[None, :],
                   mask=(n0 + j < last)[:, None] & k_mask[None, :], other=0.0)


@triton.jit
def _project_blocks(v, w_ptr, stride_w, out_ptr, stride_o, m, m_mask, first, last, j, k, k_mask, w0, w1,
                    BLOCK_N: tl.constexpr):
    """out[:, first:last] = v @ W[first:last].T, a block of BLOCK_N rows of W at a time; `w0`, `w1` are the first
    two blocks, already loaded. Each iteration issues the load of the block two ahead before its own sums, so two
    blocks are always in flight."""
    for n0 in range(first, last, BLOCK_N):
        w2 = _block_loads(w_ptr, stride_w, n0 + 2 * BLOCK_N, j, last, k, k_mask)
        n = n0 + j
        tl.store(out_ptr + m[:, None] * stride_o + n[None, :], _rows_times(v, w0).to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & (n < last)[None, :])
        w0 = w1
        w1 = w2


@triton.jit
def _fused_mlp_kernel(x_ptr, res_ptr, g_ptr, w1_ptr, w2_ptr, res_out_ptr, act_ptr, out_ptr, sync_ptr, M, H, inter,
                      cols1, cols2, stride_xm, stride_rm, stride_ro, stride_w1, stride_w2, stride_am, stride_om, eps,
                      HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr,
                      BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr, PHASE1: tl.constexpr, PHASE2: tl.constexpr,
                      USE_GDC: tl.constexpr):
    """Program p owns gate/up columns [p * cols1, (p + 1) * cols1) and down columns [p * cols2, ...), taken in
    blocks of BLOCK_N columns by the whole K (the input row sits in registers)."""
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    if PHASE1:
        k = tl.arange(0, BLOCK_K1)
        k_mask = k < H
        j = tl.arange(0, BLOCK_N1)
        first = pid * cols1
        last = tl.minimum(first + cols1, 2 * inter)
        # weights are nobody's output: the first two blocks and the norm weight load before the wait for the
        # kernel that writes x
        w0 = _block_loads(w1_ptr, stride_w1, first, j, last, k, k_mask)
        w1 = _block_loads(w1_ptr, stride_w1, first + BLOCK_N1, j, last, k, k_mask)
        g = tl.load(g_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        gdc_enter(USE_GDC)
        x_mask = m_mask[:, None] & k_mask[None, :]
        h = _residual_sum(x_ptr, res_ptr, m, k, x_mask, stride_xm, stride_rm, HAS_RES)
        if HAS_RES:  # program 0 writes the residual stream
            tl.store(res_out_ptr + m[:, None] * stride_ro + k[None, :], h.to(x_ptr.dtype.element_ty),
                     mask=x_mask & (m < tl.where(pid == 0, M, 0))[:, None])
        inv = tl.rsqrt(tl.sum(h * h, axis=1) / H + eps)
        dtype = x_ptr.dtype.element_ty
        xn = round_to(round_to(h * inv[:, None], dtype) * g[None, :], dtype)
        _project_blocks(xn, w1_ptr, stride_w1, act_ptr, stride_am, m, m_mask, first, last, j, k, k_mask, w0, w1,
                        BLOCK_N1)
    else:
        gdc_enter(USE_GDC)
    if PHASE2:
        k = tl.arange(0, BLOCK_K2)
        k_mask = k < inter
        j = tl.arange(0, BLOCK_N2)
        first = pid * cols2
        last = tl.minimum(first + cols2, H)
        v0 = _block_loads(w2_ptr, stride_w2, first, j, last, k, k_mask)
        v1 = _block_loads(w2_ptr, stride_w2, first + BLOCK_N2, j, last, k, k_mask)
        if PHASE1:  # the down weights above are in flight while the slowest program finishes its gate/up columns
            _grid_barrier(sync_ptr, tl.num_programs(0))
        a = _x_chunk(act_ptr, act_ptr, act_ptr, act_ptr, m, k, m_mask[:, None] & k_mask[None, :], inter, stride_am,
                     stride_am, stride_am, tl.zeros([BLOCK_M], dtype=tl.float32), 0, True, False, False)
        _project_blocks(a, w2_ptr, stride_w2, out_ptr, stride_om, m, m_mask, first, last, j, k, k_mask, v0, v1,
                        BLOCK_N2)
        if PHASE1:
            _grid_leave(sync_ptr, tl.num_programs(0))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def new_sync(device: torch.device | str) -> torch.Tensor:
    """A barrier's counter pair (zeros; the kernel leaves them at zero). One per caller that may run
    concurrently with another; a layer owns one."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def fused_mlp(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              gate_up_weight: torch.Tensor, down_weight: torch.Tensor, sync: torch.Tensor,
              split: bool | None = None, programs: int | None = None, num_warps: int = 8,
              tile: int = 16384, block_n: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(down(silu(gate) * up), h)` with `h = x (+ residual)` and `gate | up = rms_norm(h) @ gate_up_weight.T`,
    for `x` `[M <= 8, H]`, `gate_up_weight` `[2I, H]` (gate rows first), `down_weight` `[H, I]`. `h` is a new
    tensor (the residual stream for the next block), or `x` itself without a residual. `split`: the two phases as
    two launches instead of one with the grid barrier (default: on the CPU, the interpreter). `programs`: the
    grid (default and at most the SM count); `tile`: weights per block (columns x K, K whole), which sets the
    columns per block; `block_n`: (gate/up, down) columns per block instead."""
    assert x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(1) == 1, "x must be [M <= 8, H], unit stride"
    num_rows, hidden = x.shape
    inter = down_weight.shape[1]
    assert gate_up_weight.shape == (2 * inter, hidden) and down_weight.shape == (hidden, inter)
    assert gate_up_weight.stride(1) == 1 and down_weight.stride(1) == 1
    assert norm_weight.shape == (hidden,) and norm_weight.is_contiguous() and norm_weight.dtype == x.dtype
    assert residual is None or (residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype)
    assert sync.dtype == torch.int32 and sync.numel() >= 2 and sync.device == x.device
    split = not x.is_cuda if split is None else split
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    act = torch.empty((num_rows, 2 * inter), dtype=x.dtype, device=x.device)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return out, res_out
    limit = _num_sms(x.device) if x.is_cuda else 4
    programs = min(programs or limit, limit)
    block_m = triton.next_power_of_2(num_rows)
    cols1, cols2 = triton.cdiv(2 * inter, programs), triton.cdiv(hidden, programs)
    block_k1, block_k2 = triton.next_power_of_2(hidden), triton.next_power_of_2(inter)

    def columns(cols, width):
        return max(1, min(triton.next_power_of_2(cols), tile // (width * block_m)))

    block_n1, block_n2 = block_n or (columns(cols1, block_k1), columns(cols2, block_k2))
    res = residual if residual is not None else x
    for phase in ((1,), (2,)) if split else ((1, 2),):
        _fused_mlp_kernel[(programs,)](
            x, res, norm_weight, gate_up_weight, down_weight, res_out, act, out, sync, num_rows, hidden, inter,
            cols1, cols2, x.stride(0), res.stride(0), res_out.stride(0), gate_up_weight.stride(0),
            down_weight.stride(0), act.stride(0), out.stride(0), eps,
            HAS_RES=residual is not None, BLOCK_M=block_m, BLOCK_N1=block_n1, BLOCK_K1=block_k1, BLOCK_N2=block_n2,
            BLOCK_K2=block_k2, PHASE1=1 in phase, PHASE2=2 in phase, num_warps=num_warps,
            **pdl_launch(x, num_rows, programs),
        )
    return out, res_out


def fused_mlp_ref(x, residual, norm_weight, eps, gate_up_weight, down_weight):
    """The eager ops in the reference layers' roundings: `(out, h)`."""
    h = x if residual is None else x + residual
    h32 = h.float()
    normed = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * norm_weight
    gate, up = (normed.float() @ gate_up_weight.float().T).to(x.dtype).chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate.float()).to(x.dtype).float() * up.float()
    return (act.to(x.dtype).float() @ down_weight.float().T).to(x.dtype), h
