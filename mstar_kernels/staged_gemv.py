"""Skinny GEMM for one to four bf16 rows whose CTAs copy their weights into shared memory before the PDL wait.

mstar_kernels/staged_gemv.cu (built with nvcc on first use, for Hopper or newer). Each CTA owns `cols` output columns
and bulk-copies their weight rows (one contiguous run) into shared memory as soon as it starts, so under PDL the whole
projection streams in while the kernel before it finishes; then it builds the input rows as mstar_kernels/gemv.py does
(plain, SwiGLU of a packed gate/up, or residual add + RMSNorm; the same bf16 values) and sums in fp32. A Triton
program can keep only what it loads ahead of its wait in registers.

`scripts/probe_staged_gemv.py` on the H200 (2026-12-02): the one-row chain of 112 Qwen3-0.6B projections took
378 us with such a kernel against 495 us with mstar_kernels/gemv.py's tuned settings; Llama-3.2-3B's 1,709 against
1,851;
with a one-CTA kernel in front of each projection 595 against 642 us (Qwen3) and 2,381 against 2,240 (Llama).

In a gemv plan (mstar_common/layers/linear.py) the setting `(STAGED, cols)` names this kernel; `gemv_with` and
`norm_gemv_with` (mstar_kernels/gemv.py) send such settings here. `tune_gemv` offers it where `available()` (a CUDA
GPU of compute capability >= 9.0, nvcc) and `MSTAR_GEMV_STAGED=1`, and keeps it where it times fastest. Off by default:
in the served decode step it lost (Qwen3-0.6B one row, H200: 0.817 ms with the Triton kernel, 0.819 with the tuning
free to take this one, 0.982 with every projection on it; docs/benchmarks.md, "Weights staged in shared memory
ahead of the PDL wait"): a projection gains only where the kernel before it is another long projection. A call
with an input this kernel cannot read (a row stride not a multiple of 8 elements, a pointer not 16-byte aligned)
goes through mstar_kernels/gemv.py's default blocks instead.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from mstar_common.config import env_switch

STAGED = 0  # a gemv setting's first element (BLOCK_N) that names this kernel: (STAGED, cols)
MAX_ROWS = 4
MAX_COLS = 64  # mstar_kernels/staged_gemv.cu: 8 warps x 8 barrier groups
SMEM_LIMIT = 227 * 1024  # dynamic shared memory a CTA may take on Hopper
COLS_CANDIDATES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
_INPUT = {"plain": 0, "swiglu": 1, "norm": 2}
_SOURCE = Path(__file__).with_suffix(".cu")


def smem_bytes(rows: int, k: int, cols: int) -> int:
    """The shared memory one CTA takes: its `cols` weight rows and the `rows` input rows, bf16."""
    return (cols + rows) * k * 2


def fits(rows: int, n: int, k: int, cols: int) -> bool:
    """Whether the kernel takes a projection of an [n, k] weight at `rows` rows with `cols` columns per CTA."""
    return (1 <= rows <= MAX_ROWS and k % 8 == 0 and 1 <= cols <= MAX_COLS and n >= 1
            and smem_bytes(rows, k, cols) <= SMEM_LIMIT)


def candidates(rows: int, n: int, k: int, num_sms: int = 132) -> list[tuple[int, int]]:
    """The `(STAGED, cols)` settings worth timing: those that fit, with at least half as many CTAs as SMs (fewer
    leave SMs idle and each CTA's copy long), and never more than 8 per SM."""
    kept = []
    for cols in COLS_CANDIDATES:
        ctas = -(-n // cols)
        if fits(rows, n, k, cols) and num_sms // 2 <= ctas <= 8 * num_sms:
            kept.append((STAGED, cols))
    return kept


def auto_cols(rows: int, n: int, k: int, num_sms: int = 132) -> int | None:
    """A default columns-per-CTA: the fewest that leave at most two CTAs per SM, else the most that fit (None if
    none fits)."""
    fitting = [cols for cols in COLS_CANDIDATES if fits(rows, n, k, cols)]
    for cols in fitting:
        if -(-n // cols) <= 2 * num_sms:
            return cols
    return fitting[-1] if fitting else None


def enabled() -> bool:
    """`MSTAR_GEMV_STAGED` (an A/B switch, off by default: it lost in the served step, docs/benchmarks.md)."""
    return env_switch("MSTAR_GEMV_STAGED", False)


@functools.cache
def _library() -> ctypes.CDLL | None:
    from mstar_common.cuda_build import build_library

    try:
        lib = build_library(_SOURCE, "staged_gemv")
    except Exception as exc:  # no nvcc, a failed build: the Triton kernel serves
        logging.getLogger(__name__).warning("mstar_kernels/staged_gemv.cu not built (%s): the Triton GEMV serves", exc)
        return None
    lib.mstar_staged_gemv.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int] * 4 + [ctypes.c_longlong] * 4
                                      + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_void_p])
    lib.mstar_staged_gemv.restype = ctypes.c_int
    return lib


def available(weight: torch.Tensor) -> bool:
    """Whether this kernel can serve `weight` (bf16, on a CUDA GPU of compute capability >= 9.0, built), whether or
    not `enabled()` lets the tuning try it."""
    if not weight.is_cuda or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return False
    if torch.cuda.get_device_capability(weight.device)[0] < 9:
        return False
    return _library() is not None


def _aligned(t: torch.Tensor | None) -> bool:
    return t is None or (t.data_ptr() % 16 == 0 and (t.dim() < 2 or t.stride(0) % 8 == 0) and t.stride(-1) == 1)


def readable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None) -> bool:
    """Whether the kernel can read these tensors (bf16, 16-byte aligned rows, contiguous weight)."""
    tensors = (x, weight, residual, norm_weight)
    return (all(t is None or t.dtype == torch.bfloat16 for t in (*tensors, bias))
            and all(_aligned(t) for t in tensors) and weight.is_contiguous()
            and (bias is None or bias.is_contiguous()))


def staged_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cols: int, swiglu: bool = False,
                norm: tuple | None = None, kind: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`out = in @ weight.T + bias` with `in` built from `x` as mstar_kernels/gemv.py's `_launch` builds it (`swiglu`: x
    is [M, 2K] gate | up; `norm` = (norm_weight, eps, residual or None): RMSNorm of x + residual). Returns
    `(out, res_out)`: res_out is the summed residual stream with a residual, else x. `kind`: the projection's name
    for `MSTAR_PDL_AHEAD_OF` (as the Triton GEMV's; default `gemv:NxK`), so a staged projection named there also
    lets the next kernel start before its wait."""
    from mstar_kernels._pdl import pdl_launch

    num_rows, (n, k) = x.shape[0], weight.shape
    assert x.dim() == 2 and 1 <= num_rows <= MAX_ROWS, "x must be [M <= 4, K]"
    assert x.shape[1] == (2 * k if swiglu else k), "x's width must be K (2K with swiglu)"
    assert fits(num_rows, n, k, cols), f"staged GEMV does not take {n}x{k} at {num_rows} rows with {cols} columns"
    lib = _library()
    assert lib is not None, "mstar_kernels/staged_gemv.cu is not built"
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    norm_weight, eps, residual = norm if norm is not None else (None, 0.0, None)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    input_kind = "norm" if norm is not None else "swiglu" if swiglu else "plain"
    ctas = -(-n // cols)
    mode = pdl_launch(x, num_rows, ctas, kind=kind or f"gemv:{n}x{k}")["USE_GDC"]

    def ptr(t):
        return t.data_ptr() if t is not None else None

    code = lib.mstar_staged_gemv(
        ptr(weight), ptr(x), ptr(bias), ptr(out), ptr(residual), ptr(norm_weight),
        ptr(res_out) if residual is not None else None, num_rows, n, k, cols, x.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0, res_out.stride(0) if residual is not None else 0,
        float(eps), _INPUT[input_kind], mode, torch.cuda.current_stream(x.device).cuda_stream)
    if code != 0:
        raise RuntimeError(f"staged GEMV launch failed ({n}x{k}, {num_rows} rows, {cols} columns): code {code}")
    return out, res_out
