#!/usr/bin/env python
"""Times kernels/paged_decode_attention.py's launch knobs (context tokens per iteration, warps, pipeline
stages, context splits) on the decode shapes the benchmarks run, and prints each one's effective KV read
bandwidth against the GPU's (measured by a device copy in the same run).

Device: source .device/prepare.sh && python scripts/sweep_decode_attention.py [--out sweep.json]
Shapes: Orpheus/Llama-3.2-3B (24 q heads, 8 KV heads, head dim 128) at 256 and 64 rows, Qwen3-0.6B (16/8/128)
at 1 and 64 rows, Whisper large-v3 (20/20/64) at 1 row over the 1,500 encoder positions; bf16 and fp8 pools.
The first shape is swept in full; the five best settings are then timed on the others.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name, rows, q heads, kv heads, head dim, context tokens per row
SHAPES = [
    ("orpheus-256", 256, 24, 8, 128, 640),
    ("orpheus-64", 64, 24, 8, 128, 640),
    ("qwen3-1", 1, 16, 8, 128, 700),
    ("qwen3-64", 64, 16, 8, 128, 700),
    ("whisper-cross-1", 1, 20, 20, 64, 1500),
]
PAGE_SIZE = 16


def make_case(rows: int, heads: int, kv_heads: int, head_dim: int, ctx: int, kv_dtype, device: str):
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    pages_per_row = -(-ctx // PAGE_SIZE)
    num_pages = rows * pages_per_row + 1
    shape = (num_pages, PAGE_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16).to(kv_dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16).to(kv_dtype)
    # shuffled pages, as a pool that has served a while hands them out
    order = torch.randperm(num_pages - 1, generator=gen, device=device).to(torch.int32) + 1
    tables = order.view(rows, pages_per_row)
    ctx_lens = torch.full((rows,), ctx, dtype=torch.int32, device=device)
    query = torch.randn((rows, heads, head_dim), generator=gen, device=device, dtype=torch.bfloat16)
    kv_bytes = 2 * rows * ctx * kv_heads * head_dim * k_cache.element_size()
    return query, k_cache, v_cache, tables, ctx_lens, kv_bytes


def time_us(fn, iters: int = 50) -> float:
    """Inside a captured graph, as the engine runs the kernel (a bare loop would time Triton's host launcher
    for the one-row shapes)."""
    from mstar_common.bench.gpu_timing import graph_time_us

    return graph_time_us(fn, calls=10, replays=max(1, iters // 10))


def _event_time_us(fn, iters: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def copy_bandwidth() -> float:
    import torch

    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = _event_time_us(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() / (us * 1e-6) / 1e12  # read + write, TB/s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args()
    import torch

    from kernels.paged_decode_attention import BLOCK_N, decode_num_splits, paged_decode_attention

    bandwidth = copy_bandwidth()
    print(f"device copy bandwidth {bandwidth:.2f} TB/s ({torch.cuda.get_device_name()})", flush=True)
    grid = list(itertools.product((32, 64, 128), (4, 8), (1, 2, 3), (0, 2, 4)))  # splits 0: the heuristic
    results: list[dict] = []

    def run(shape, kv_dtype, setting) -> dict:
        name, rows, heads, kv_heads, head_dim, ctx = shape
        query, k_cache, v_cache, tables, ctx_lens, kv_bytes = make_case(rows, heads, kv_heads, head_dim, ctx,
                                                                         kv_dtype, "cuda")
        block, warps, stages, splits, *rest = setting
        fp16_dots = bool(rest and rest[0])
        splits = splits or decode_num_splits(rows, kv_heads)
        try:
            us = time_us(lambda: paged_decode_attention(query, k_cache, v_cache, tables, ctx_lens, 0.088,
                                                        num_splits=splits, block=block, num_warps=warps,
                                                        num_stages=stages, fp16_dots=fp16_dots))
        except Exception as exc:  # an out-of-resources launch: report it and go on
            print(f"{name} {kv_dtype} {setting}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
            return {}
        row = {"shape": name, "kv_dtype": str(kv_dtype).removeprefix("torch."), "block": block, "warps": warps,
               "stages": stages, "splits": splits, "fp16_dots": fp16_dots, "us": round(us, 2), "TB/s": round(kv_bytes / us / 1e6, 3)}
        results.append(row)
        return row

    first = SHAPES[0]
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        settings = grid + ([(*s[:4], True) for s in grid] if kv_dtype == torch.float8_e4m3fn else [])
        rows = [r for r in (run(first, kv_dtype, s) for s in settings) if r]
        rows.sort(key=lambda r: r["us"])
        default = next((r for r in rows if (r["block"], r["warps"], r["stages"]) == (BLOCK_N, 4, 2)
                        and r["splits"] == decode_num_splits(first[1], first[3])), None)
        print(f"\n{first[0]} {kv_dtype}: current default {default}", flush=True)
        for r in rows[: args.top]:
            print("  best", r, flush=True)
        best = [(r["block"], r["warps"], r["stages"], 0, r["fp16_dots"]) for r in rows[: args.top]]
        for shape in SHAPES[1:]:
            print(f"{shape[0]} {kv_dtype}:", flush=True)
            for setting in [(BLOCK_N, 4, 2, 0)] + best:
                print("  ", run(shape, kv_dtype, setting), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"copy_TBps": bandwidth, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
