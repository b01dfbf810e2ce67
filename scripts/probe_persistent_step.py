"""Would a whole-step persistent decode kernel beat the chain of PDL launches at one row? The probe for it.

A one-row decode step is a latency chain of ~250 short kernels (docs/benchmarks.md). A persistent kernel would
replace each kernel boundary by a grid barrier and stream every layer's weights from one launch. The persistent
MLP half (mstar_kernels/fused_mlp.py) lost to the chain, with one barrier per layer, and why was not measured. This
probe measures the two things such a kernel rests on:

- `barrier`: the cost of one grid barrier (an atomic counter, release add, acquire polls at GPU scope) for one and
  two programs per SM, polling with an atomic (as mstar_kernels/fused_mlp.py) or with an `ld.acquire` load.
- `chain`: `--layers` layers of the four one-row projections of a decoder layer (qkv, o, gate/up, down with SwiGLU
  on load), each layer with its own weights: as one persistent launch with a barrier after each projection
  (`persistent`), and as the chain of the skinny-GEMV launches with PDL that the served step runs (`launches`),
  both in a CUDA graph. The persistent launch holds its weight tiles in registers and loads a projection's
  first two tiles before the barrier that precedes it; or, with `--tma-stages N`, it streams them through
  tensor descriptors (TMA on Hopper) in an N-deep pipeline in shared memory, which fills after each barrier
  (both measured on 2026-12-02: both lost). With `--cuda` it runs the same chain as CUDA C++ kernels instead
  (scripts/probe_persistent_step.cu, built here with nvcc; one CTA per SM, 16-byte weight loads): the register
  (`--unroll`), ring (`--ring`) and unit (`--units`, `--early`) forms that file describes; `--trace` reads the GPU
  clock at five points of every projection of one launch. (Measured on 2026-12-02: faster than the launches on
  the Llama shapes, slower on Qwen3's; docs/benchmarks.md.) Every form is checked against
  torch over the first two layers (bf16 tolerance; the probe exits 1 otherwise);
  tests/kernels/test_probe_persistent.py checks the forms against the launches, NaN-filled buffers between the
  projections, up to two programs per SM.

Prints one JSON object (`--json` writes it too).

    python scripts/probe_persistent_step.py [--shapes qwen3|llama] [--layers 28] [--json out.json]
    python scripts/probe_persistent_step.py --cuda [--warps 16 32] [--unroll 4 8 | --ring 8 | --units 4 [--early 1]]
        [--trace]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mstar_common.bench.gpu_timing import graph_time_us  # noqa: E402
from mstar_common.cuda_build import build_library  # noqa: E402
from mstar_kernels._rounding import round_to  # noqa: E402
from mstar_kernels.fused_mlp import _grid_barrier, _grid_leave  # noqa: E402

CHECK_LAYERS = 2
CUDA_SOURCE = Path(__file__).with_suffix(".cu")
SHAPES = {  # hidden, q width (heads x head_dim), kv width, intermediate
    "qwen3": (1024, 2048, 1024, 3072),
    "llama": (3072, 3072, 1024, 8192),
    "tiny": (256, 256, 256, 256),  # ~0.5 MB per layer: what each approach costs per projection besides weights
}


@triton.jit
def _barrier(sync_ptr, target, POLL: tl.constexpr):
    """mstar_kernels/fused_mlp.py's grid barrier (POLL 0: atomic polls), or the same with `ld.acquire` polls
    (POLL 1)."""
    if POLL == 0:
        _grid_barrier(sync_ptr, target)
    else:
        tl.debug_barrier()
        tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
        seen = _acquire_load(sync_ptr)
        while seen < target:
            seen = _acquire_load(sync_ptr)
        tl.debug_barrier()


@triton.jit
def _acquire_load(sync_ptr):
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [sync_ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _barrier_kernel(sync_ptr, iters, POLL: tl.constexpr):
    num = tl.num_programs(0)
    for i in range(iters):
        _barrier(sync_ptr, (i + 1) * num, POLL)
    _grid_leave(sync_ptr, num)


@triton.jit
def _unit_w(w_ptr, t, units, pid, num, N, K, KC, j, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile of this program's unit `t` (column block pid + (t // KC) x num, K chunk t % KC)."""
    rows = (pid + (t // KC) * num) * BLOCK_N + j
    cols = (t % KC) * BLOCK_K + k
    mask = (rows < N) & (j * 0 + t < units)
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask[:, None], other=0.0)


@triton.jit
def _unit_x(x_ptr, t, KC, K, k, SWIGLU: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = (t % KC) * BLOCK_K + k
    x = tl.load(x_ptr + cols, cache_modifier=".cg")
    if SWIGLU:
        up = tl.load(x_ptr + K + cols, cache_modifier=".cg")
        gate = x.to(tl.float32)
        act = round_to(gate / (1.0 + tl.exp(-gate)), x.dtype)
        return round_to(act * up.to(tl.float32), x.dtype)
    return x.to(tl.float32)


@triton.jit
def _units(N, K, pid, num, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    blocks = tl.cdiv(N, BLOCK_N)
    KC = K // BLOCK_K
    return tl.maximum(tl.cdiv(blocks - pid, num), 0) * KC, KC


@triton.jit
def _gemv_stage(x_ptr, w_ptr, out_ptr, N, K, pid, num, w0, w1, SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """out = x @ W.T for this program's column blocks; `w0`, `w1`: its first two weight tiles, already loaded."""
    units, KC = _units(N, K, pid, num, BLOCK_N, BLOCK_K)
    j = tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    x0 = _unit_x(x_ptr, 0, KC, K, k, SWIGLU, BLOCK_K)
    x1 = _unit_x(x_ptr, 1, KC, K, k, SWIGLU, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for t in range(0, units):
        w2 = _unit_w(w_ptr, t + 2, units, pid, num, N, K, KC, j, k, BLOCK_N, BLOCK_K)
        x2 = _unit_x(x_ptr, t + 2, KC, K, k, SWIGLU, BLOCK_K)
        acc += tl.sum(w0.to(tl.float32) * x0[None, :], axis=1)
        last = (j * 0 + t) % KC == KC - 1
        rows = (pid + (t // KC) * num) * BLOCK_N + j
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=(rows < N) & last)
        acc = tl.where(last, 0.0, acc)
        w0, w1, x0, x1 = w1, w2, x1, x2


@triton.jit
def _first_tiles(w_ptr, N, K, pid, num, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    units, KC = _units(N, K, pid, num, BLOCK_N, BLOCK_K)
    j = tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    return (_unit_w(w_ptr, 0, units, pid, num, N, K, KC, j, k, BLOCK_N, BLOCK_K),
            _unit_w(w_ptr, 1, units, pid, num, N, K, KC, j, k, BLOCK_N, BLOCK_K))


@triton.jit
def _chain_kernel(h_ptr, qkv_ptr, o_ptr, gu_ptr, wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, sync_ptr, layers, H, QKV, Q,
                  INTER, POLL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num = tl.num_programs(0)
    nb = 0
    a0, a1 = _first_tiles(wqkv_ptr, QKV, H, pid, num, BLOCK_N, BLOCK_K)
    for layer32 in range(layers):
        layer = layer32 + tl.zeros([], dtype=tl.int64)
        wqkv = wqkv_ptr + layer * QKV * H
        wo = wo_ptr + layer * H * Q
        wgu = wgu_ptr + layer * 2 * INTER * H
        wd = wd_ptr + layer * H * INTER
        _gemv_stage(h_ptr, wqkv, qkv_ptr, QKV, H, pid, num, a0, a1, False, BLOCK_N, BLOCK_K)
        b0, b1 = _first_tiles(wo, H, Q, pid, num, BLOCK_N, BLOCK_K)
        nb += 1
        _barrier(sync_ptr, nb * num, POLL)
        _gemv_stage(qkv_ptr, wo, o_ptr, H, Q, pid, num, b0, b1, False, BLOCK_N, BLOCK_K)
        c0, c1 = _first_tiles(wgu, 2 * INTER, H, pid, num, BLOCK_N, BLOCK_K)
        nb += 1
        _barrier(sync_ptr, nb * num, POLL)
        _gemv_stage(o_ptr, wgu, gu_ptr, 2 * INTER, H, pid, num, c0, c1, False, BLOCK_N, BLOCK_K)
        d0, d1 = _first_tiles(wd, H, INTER, pid, num, BLOCK_N, BLOCK_K)
        nb += 1
        _barrier(sync_ptr, nb * num, POLL)
        _gemv_stage(gu_ptr, wd, h_ptr, H, INTER, pid, num, d0, d1, True, BLOCK_N, BLOCK_K)
        nxt = wqkv_ptr + (layer + 1) * QKV * H
        # the next layer's first qkv tiles (none after the last layer) load before the barrier
        a0, a1 = _first_tiles(nxt, tl.where(layer + 1 < layers, QKV, 0), H, pid, num, BLOCK_N, BLOCK_K)
        nb += 1
        _barrier(sync_ptr, nb * num, POLL)
    _grid_leave(sync_ptr, num)


@triton.jit
def _tma_stage(x_ptr, w_desc, out_ptr, row0, N, K, pid, num, SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """out = x @ W.T for this program's column blocks, the weight tiles loaded through the tensor descriptor
    `w_desc` (rows `row0 + n` of the stacked layers; TMA on Hopper) in a software pipeline `STAGES` deep, so the
    tiles in flight sit in shared memory instead of registers."""
    units, KC = _units(N, K, pid, num, BLOCK_N, BLOCK_K)
    j = tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for t in tl.range(0, units, num_stages=STAGES):
        block = pid + (t // KC) * num
        w = w_desc.load([row0 + block * BLOCK_N, (t % KC) * BLOCK_K])
        x = _unit_x(x_ptr, t, KC, K, k, SWIGLU, BLOCK_K)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        last = (j * 0 + t) % KC == KC - 1
        rows = block * BLOCK_N + j
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=(rows < N) & last)
        acc = tl.where(last, 0.0, acc)


@triton.jit
def _chain_kernel_tma(h_ptr, qkv_ptr, o_ptr, gu_ptr, wqkv_desc, wo_desc, wgu_desc, wd_desc, sync_ptr, layers, H,
                      QKV, Q, INTER, POLL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      STAGES: tl.constexpr):
    """`_chain_kernel` with the weights streamed through tensor descriptors (`_tma_stage`); no tile is loaded
    ahead of a barrier (each stage's pipeline fills after it)."""
    pid = tl.program_id(0)
    num = tl.num_programs(0)
    nb = 0
    for layer in range(layers):
        _tma_stage(h_ptr, wqkv_desc, qkv_ptr, layer * QKV, QKV, H, pid, num, False, BLOCK_N, BLOCK_K, STAGES)
        nb += 1
        _barrier(sync_ptr, nb * num, POLL)
        _tma_stage(qkv_ptr, wo_desc, o_ptr, layer * H, H, Q, pid, num, False, BLOCK_N, BLOCK_K, STAGES)
        nb += 1
        _barrier(sync_ptr, nb * num, POLL)
        _tma_stage(o_ptr, wgu_desc, gu_ptr, layer * 2 * INTER, 2 * INTER, H, pid, num, False, BLOCK_N, BLOCK_K,
                   STAGES)
        nb += 1
        _barrier(sync_ptr, nb * num, POLL)
        _tma_stage(gu_ptr, wd_desc, h_ptr, layer * H, H, INTER, pid, num, True, BLOCK_N, BLOCK_K, STAGES)
        nb += 1
        _barrier(sync_ptr, nb * num, POLL)
    _grid_leave(sync_ptr, num)


def cuda_library() -> ctypes.CDLL:
    """scripts/probe_persistent_step.cu built for this GPU (cached by the source's hash and the architecture)."""
    lib = build_library(CUDA_SOURCE, "probe_persistent_cuda")
    lib.mstar_chain_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                       ctypes.c_void_p]
    lib.mstar_chain_trace.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.mstar_barrier_launch.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    return lib


def _check_launch(code: int, what: str) -> None:
    if code == -1:
        raise ValueError(f"{what}: the CUDA kernel does not take this shape or setting (K a multiple of 256, "
                         "at most 8192; at most 256 rows per CTA; threads a multiple of 32, at most 1024, 512 "
                         "with unroll 8; a ring of 4, 8, 12 or 16 slots that fits in shared memory; units of at "
                         "most 4, 8 or 16 vectors per lane, with at most 1024, 512 or 256 threads; 1-4 early units "
                         "with 4 vectors, 1-2 with 8, within shared memory)")
    if code == -2:
        raise ValueError(f"{what}: more CTAs than the GPU holds at once (a grid barrier would never open)")
    if code != 0:
        raise RuntimeError(f"{what}: CUDA error {code}")


def launch_chain(grid, h, qkv, o, gu, wqkv, wo, wgu, wd, sync, layers: int, q: int, mode: dict) -> None:
    """One launch of the persistent chain over `layers` layers of the stacked weights ([L, N, K] each): the
    register form, with `mode["stages"]` the tensor-descriptor (TMA) form, or with `mode["cuda"]` the CUDA C++
    form (`mode["warps"]` warps per CTA; `mode["unroll"]` vectors per thread per chunk held in registers,
    `mode["ring"]` slots per thread of the shared-memory ring that the weights stream through, or `mode["units"]`
    vectors per lane of the (row, K segment) units that each warp takes whole; with `mode["early"]` = M, each
    warp's first M units of a projection are copied into shared memory two projections ahead)."""
    hidden, qkv_n, inter = h.shape[-1], qkv.shape[-1], gu.shape[-1] // 2
    if mode.get("cuda"):
        lib = cuda_library()
        ptrs = (ctypes.c_void_p * 9)(*(t.data_ptr() for t in (h, qkv, o, gu, wqkv, wo, wgu, wd, sync)))
        dims = (ctypes.c_int * 5)(layers, hidden, qkv_n, q, inter)
        code = lib.mstar_chain_launch(ptrs, dims, grid[0], mode["warps"] * 32, mode.get("unroll", 0),
                                      mode.get("ring", 0), mode.get("units", 0), int(mode.get("early", 0)),
                                      torch.cuda.current_stream().cuda_stream)
        _check_launch(code, "mstar_chain_launch")
        return
    common = dict(POLL=mode["poll"], BLOCK_N=mode["block_n"], BLOCK_K=mode["block_k"], num_warps=mode["warps"])
    if not mode.get("stages"):
        _chain_kernel[grid](h, qkv, o, gu, wqkv, wo, wgu, wd, sync, layers, hidden, qkv_n, q, inter, **common)
        return
    from triton.tools.tensor_descriptor import TensorDescriptor

    block = [mode["block_n"], mode["block_k"]]
    descs = [TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), block) for w in (wqkv, wo, wgu, wd)]
    _chain_kernel_tma[grid](h, qkv, o, gu, *descs, sync, layers, hidden, qkv_n, q, inter, STAGES=mode["stages"],
                            **common)


def chain_case(hidden: int, q: int, kv: int, inter: int, layers: int, seed: int = 0, device: str = "cuda"):
    """Random stacked weights for the chain's projections ([layers, N, K] bf16, scaled by 1/sqrt(K): qkv, o,
    gate/up, down) and a one-row input: (h0, (wqkv, wo, wgu, wd))."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def weights(n, k):
        return (torch.randn(layers, n, k, device=device, generator=gen) / k ** 0.5).to(torch.bfloat16)

    ws = weights(q + 2 * kv, hidden), weights(hidden, q), weights(2 * inter, hidden), weights(hidden, inter)
    return torch.randn(1, hidden, device=device, generator=gen).to(torch.bfloat16), ws


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def barrier_us(per_sm: int, poll: int, iters: int = 2000) -> float:
    sync = torch.zeros(2, dtype=torch.int32, device="cuda")
    grid = (_num_sms() * per_sm,)

    def run():
        _barrier_kernel[grid](sync, iters, POLL=poll, num_warps=4)

    us = graph_time_us(run)
    assert int(sync.sum()) == 0, "the barrier left its counters non-zero"
    return us / iters


TRACE_POINTS = ("input", "first_unit", "other_units", "write", "barrier")


def trace_cuda_chain(shapes: str, layers: int, warps: int, early: int = 1) -> dict:
    """One launch of the early-copy unit form (4 vectors per lane, `early` units per warp copied ahead, one CTA
    per SM) with each CTA's clock read at five points of every projection: where its time goes, per projection
    kind, in us (medians over CTAs and layers; `barrier` runs from the outputs' write to the next projection's
    start)."""
    lib = cuda_library()
    hidden, q, kv, inter = SHAPES[shapes]
    qkv_n = q + 2 * kv
    h, ws = chain_case(hidden, q, kv, inter, layers)
    bufs = [torch.empty(1, n, dtype=torch.bfloat16, device="cuda") for n in (qkv_n, hidden, 2 * inter)]
    sync = torch.zeros(2, dtype=torch.int32, device="cuda")
    blocks = _num_sms()
    trace = torch.zeros(blocks, layers * 4, 5, dtype=torch.int64, device="cuda")
    ptrs = (ctypes.c_void_p * 9)(*(t.data_ptr() for t in (h, *bufs, *ws, sync)))
    dims = (ctypes.c_int * 5)(layers, hidden, qkv_n, q, inter)
    for _ in range(3):  # the last of three launches is read
        _check_launch(lib.mstar_chain_trace(ptrs, dims, blocks, warps * 32, early, trace.data_ptr(),
                                            torch.cuda.current_stream().cuda_stream), "mstar_chain_trace")
    torch.cuda.synchronize()
    t = trace.double() / 1e3  # us
    spans = torch.empty(blocks, layers * 4, 5, dtype=torch.float64)
    spans[:, :, :4] = (t[:, :, 1:] - t[:, :, :4]).cpu()
    spans[:, :-1, 4] = (t[:, 1:, 0] - t[:, :-1, 4]).cpu()
    spans[:, -1, 4] = float("nan")
    result = {"shapes": shapes, "warps": warps, "early": early,
              "launch_us": float((t[:, -1, 4].max() - t[:, 0, 0].min()).item())}
    for kind, name in enumerate(("qkv", "o", "gate_up", "down")):
        kind_spans = spans[:, kind::4, :]
        result[name] = {point: round(float(kind_spans[:, :, i].nanmedian()), 3) for i, point in enumerate(TRACE_POINTS)}
    starts = t[:, :, 0]
    result["start_skew_us_median"] = float((starts.max(0).values - starts.min(0).values).median().item())
    return result


def barrier_us_cuda(per_sm: int, iters: int = 2000) -> float:
    """The CUDA form's grid barrier (one thread per CTA arrives with a release add and polls with
    `ld.acquire`)."""
    lib = cuda_library()
    sync = torch.zeros(2, dtype=torch.int32, device="cuda")
    blocks = _num_sms() * per_sm

    def run():
        _check_launch(lib.mstar_barrier_launch(sync.data_ptr(), iters, blocks, 128,
                                               torch.cuda.current_stream().cuda_stream), "mstar_barrier_launch")

    us = graph_time_us(run)
    assert int(sync.sum()) == 0, "the barrier left its counters non-zero"
    return us / iters


def _reference(h0, wqkv, wo, wgu, wd, q: int) -> torch.Tensor:
    """The chain in torch: fp32 products, each projection's output rounded to bf16."""
    def bf16(t):
        return t.to(torch.bfloat16).float()

    x = h0.float()
    for layer in range(wqkv.shape[0]):
        qkv = bf16(x @ wqkv[layer].float().T)
        o = bf16(qkv[:, :q] @ wo[layer].float().T)
        gate, up = bf16(o @ wgu[layer].float().T).chunk(2, dim=-1)
        x = bf16(bf16(bf16(torch.nn.functional.silu(gate)) * up) @ wd[layer].float().T)
    return x


def _rel_err(got: torch.Tensor, expect: torch.Tensor) -> float:
    """The difference's norm over the reference's; inf where either holds a non-finite value. (Without norms the
    chain's values shrink along the layers while each projection's rounding stays, so the error grows with depth:
    a 2-layer chain of the mstar_kernels/gemv.py launches is ~3% from it on the CPU.)"""
    if not (torch.isfinite(got).all() and torch.isfinite(expect).all()) or expect.norm() == 0:
        return float("inf")
    return ((got - expect).norm() / expect.norm()).item()


def chain(shapes: str, layers: int, modes: list[dict]) -> dict:
    from mstar_kernels.gemv import gemv

    hidden, q, kv, inter = SHAPES[shapes]
    qkv_n = q + 2 * kv
    h0, (wqkv, wo, wgu, wd) = chain_case(hidden, q, kv, inter, layers)
    weight_bytes = sum(w.numel() * w.element_size() for w in (wqkv, wo, wgu, wd))
    result = {"shapes": shapes, "layers": layers, "weight_mb": weight_bytes / 1e6,
              "floor_us_at_4_3_tbs": weight_bytes / 4.3e12 * 1e6}

    h_ref = h0.clone()

    def launches(depth=layers):
        h = h_ref
        for layer in range(depth):
            qkv = gemv(h, wqkv[layer])
            o = gemv(qkv[:, :q], wo[layer])
            gu = gemv(o, wgu[layer])
            h = gemv(gu, wd[layer], swiglu=True)
        return h

    graph_out = {}

    def run_launches():
        graph_out["h"] = launches()

    # Checked over the first CHECK_LAYERS layers: without norms the chain's values shrink layer by layer (SwiGLU
    # squares small values), and by layer 28 they are zeros, which would check nothing.
    depth = min(CHECK_LAYERS, layers)
    expect = _reference(h0, wqkv[:depth], wo[:depth], wgu[:depth], wd[:depth], q)
    got = launches(depth).float()
    result["launches_rel_err"] = _rel_err(got, expect)
    print(f"launches: eager ok, rel err {result['launches_rel_err']:.4f}", flush=True)
    result["launches_us"] = graph_time_us(run_launches)
    print(f"launches: {result['launches_us']:.1f} us", flush=True)
    result["modes"] = []
    sync = torch.zeros(2, dtype=torch.int32, device="cuda")
    h = torch.empty_like(h0)
    qkv = torch.empty(1, qkv_n, dtype=torch.bfloat16, device="cuda")
    o = torch.empty(1, hidden, dtype=torch.bfloat16, device="cuda")
    gu = torch.empty(1, 2 * inter, dtype=torch.bfloat16, device="cuda")
    for mode in modes:
        grid = (_num_sms() * mode["per_sm"],)

        def run(grid=grid, mode=mode, depth=layers):
            h.copy_(h0)
            launch_chain(grid, h, qkv, o, gu, wqkv, wo, wgu, wd, sync, depth, q, mode)

        try:
            run(depth=depth)
            torch.cuda.synchronize()
            err = _rel_err(h.float(), expect)
            print(f"{mode}: eager ok, rel err {err:.4f}", flush=True)
            us = graph_time_us(run, calls=4, replays=5)
            result["modes"].append({**mode, "us": us, "rel_err": err})
            print(f"{mode}: {us:.1f} us", flush=True)
        except Exception as exc:  # noqa: BLE001 - a setting that does not compile is reported, not fatal
            result["modes"].append({**mode, "error": f"{type(exc).__name__}: {exc}"[:300]})
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--block-n", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--per-sm", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--poll", type=int, nargs="+", default=[1], help="0: atomic polls, 1: ld.acquire polls")
    parser.add_argument("--tma-stages", type=int, nargs="+", default=[0],
                        help="0: the register form; N > 0: the tensor-descriptor (TMA) form, N tiles in flight")
    parser.add_argument("--tma-block-k", type=int, default=256, help="K per tile of the TMA form (<= 256)")
    parser.add_argument("--cuda", action="store_true",
                        help="the CUDA C++ form (scripts/probe_persistent_step.cu) instead of the Triton forms")
    parser.add_argument("--unroll", type=int, nargs="+", default=[4, 8],
                        help="the CUDA form: 16-byte weight vectors per thread per chunk (2, 4 or 8)")
    parser.add_argument("--ring", type=int, nargs="+", default=[],
                        help="the CUDA form's ring variant: slots per thread (4, 8, 12, 16), instead of --unroll")
    parser.add_argument("--units", type=int, nargs="+", default=[],
                        help="the CUDA form's unit variant: vectors per lane per unit (4, 8, 16), instead of --unroll")
    parser.add_argument("--early", type=int, nargs="+", default=[0],
                        help="with --units 4 (8): each warp's first 1-4 (1-2) units copied two projections ahead")
    parser.add_argument("--trace", action="store_true",
                        help="the CUDA form: where one launch of the early-copy unit form spends its time")
    parser.add_argument("--no-barrier", action="store_true", help="skip the barrier timing")
    parser.add_argument("--barrier-only", action="store_true", help="time the barrier only")
    parser.add_argument("--json")
    args = parser.parse_args()
    out = {"device": torch.cuda.get_device_name(0), "barrier_us": {}}
    for per_sm, poll in itertools.product((1, 2), (0, 1)) if not (args.no_barrier or args.cuda) else ():
        out["barrier_us"][f"{per_sm}_per_sm_{'atomic' if poll == 0 else 'ld_acquire'}"] = barrier_us(per_sm, poll)
    for per_sm in (1, 2) if args.cuda and not args.no_barrier else ():
        out["barrier_us"][f"cuda_{per_sm}_per_sm"] = barrier_us_cuda(per_sm)
    print(json.dumps(out["barrier_us"]), flush=True)
    if args.barrier_only:
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        return 0
    if args.cuda:
        form, values = ("units", args.units) if args.units else ("ring", args.ring) if args.ring else ("unroll",
                                                                                                   args.unroll)
        modes = [dict(cuda=True, per_sm=s, warps=w, **{form: v}, **(dict(early=e) if e and form == "units" else {}))
                 for s, w, v, e in itertools.product(args.per_sm, args.warps, values, args.early)]
    else:
        modes = [dict(per_sm=s, poll=p, block_n=n, block_k=args.tma_block_k if st else 1024, warps=w, stages=st)
                 for s, p, n, w, st in itertools.product(args.per_sm, args.poll, args.block_n, args.warps,
                                                          args.tma_stages)]
    if args.cuda and args.trace:
        out["trace"] = [trace_cuda_chain(args.shapes, args.layers, warps, early)
                        for warps, early in itertools.product(args.warps, [e for e in args.early if e] or [1])]
        print(json.dumps(out["trace"], indent=1), flush=True)
    out["chain"] = chain(args.shapes, args.layers, modes)
    print(json.dumps(out, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    errors = [out["chain"]["launches_rel_err"]] + [m["rel_err"] for m in out["chain"]["modes"] if "rel_err" in m]
    return 1 if max(errors) > 0.1 else 0


if __name__ == "__main__":
    sys.exit(main())
