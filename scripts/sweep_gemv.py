#!/usr/bin/env python
"""Times mstar_kernels/gemv.py against `F.linear` (cuBLAS) at the served models' decode projections, each inside a
captured CUDA graph (as the engine replays them), and prints which wins per shape and row count. The result
decides `MSTAR_GEMV_MAX_ROWS` and the settings `tune_gemv` tries (mstar_common/layers/linear.py).

Weights are cold by default: each timed call reads another copy of the weight (256 MB of copies in all), as a
decode step streams every layer's weights from HBM once. Timed back to back on one weight (`--hot`), an 18 MB
projection is read from the H200's 50 MB L2 and both sides look faster than they run in a step. The SwiGLU down
projections are timed as the MLP runs them: cuBLAS after `silu_mul`, the kernel with the activation inside.

Device: source .device/prepare.sh && python scripts/sweep_gemv.py [--out gemv.json] [--shapes llama] [--rows 1]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name, N (out features), K (in features), bias, swiglu (x is [M, 2K] gate | up)
SHAPES = [
    ("qwen3-0.6b qkv", 4096, 1024, False, False), ("qwen3-0.6b o", 1024, 2048, False, False),
    ("qwen3-0.6b gate_up", 6144, 1024, False, False), ("qwen3-0.6b down", 1024, 3072, False, True),
    ("llama-3b qkv", 5120, 3072, False, False), ("llama-3b o", 3072, 3072, False, False),
    ("llama-3b gate_up", 16384, 3072, False, False), ("llama-3b down", 3072, 8192, False, True),
    ("whisper-v3 qkv", 3840, 1280, True, False), ("whisper-v3 q/o", 1280, 1280, True, False),
    ("whisper-v3 fc1", 5120, 1280, True, False), ("whisper-v3 fc2", 1280, 5120, True, False),
    # the vocabulary heads (cuBLAS streams them at ~4.3 TB/s: would the kernel keep up, to take the final norm?)
    ("qwen3-0.6b lm_head", 151936, 1024, False, False), ("llama-3b lm_head", 128256, 3072, False, False),
]
ROWS = (1, 2, 4, 8)
BLOCK_N = (1, 2, 4, 8, 16)
BLOCK_K = (512, 1024, 2048, 4096, 8192)
WARPS = (4, 8)
STAGES = (1, 3)
MAX_TILE = 16384  # rows x BLOCK_N x BLOCK_K


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shapes", default="", help="only the shapes whose name contains this")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, comma-separated")
    parser.add_argument("--hot", action="store_true", help="time every call on the same weight (L2-resident)")
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F

    from mstar_common.bench.gpu_timing import cold_copies, graph_time_us
    from mstar_kernels.gemv import gemv, gemv_blocks, gemv_warps
    from mstar_kernels.silu_mul import silu_mul

    results = []
    print(f"{'shape':20s} rows  cublas us  gemv us (blocks)  best-of-sweep us (n, k, warps, stages)  "
          "weight TB/s cublas/best", flush=True)
    for name, n, k, has_bias, swiglu in SHAPES:
        if args.shapes not in name:
            continue
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        weights = [weight] if args.hot else cold_copies(weight)
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, 2 * k if swiglu else k, device="cuda", dtype=torch.bfloat16)
            if swiglu:
                cublas = graph_time_us([lambda w=w, x=x, bias=bias: F.linear(silu_mul(x), w, bias) for w in weights])
            else:
                cublas = graph_time_us([lambda w=w, x=x, bias=bias: F.linear(x, w, bias) for w in weights])

            def kernel_us(*setting, replays=10, x=x, bias=bias, swiglu=swiglu, weights=weights):
                return graph_time_us([lambda w=w: gemv(x, w, bias, *setting[:3], swiglu=swiglu,
                                                       num_stages=setting[3]) for w in weights], replays=replays)

            default = gemv_blocks(rows, n, k)
            ours = kernel_us(*default, gemv_warps(rows, *default), 1)
            best = (ours, (*default, gemv_warps(rows, *default), 1))
            for block_n, block_k, warps, stages in itertools.product(BLOCK_N, BLOCK_K, WARPS, STAGES):
                if block_n * block_k * triton_pow2(rows) > MAX_TILE or block_k > triton_pow2(k):
                    continue
                if stages > 1 and block_k >= k:  # one iteration: nothing to pipeline
                    continue
                try:
                    us = kernel_us(block_n, block_k, warps, stages, replays=3)
                except Exception as exc:  # out of resources: skip the setting
                    print(f"  skip {(block_n, block_k, warps, stages)}: {type(exc).__name__}", flush=True)
                    continue
                if us < best[0]:
                    best = (us, (block_n, block_k, warps, stages))
            best = (kernel_us(*best[1]), best[1])  # re-timed with the full replay count
            nbytes = n * k * 2
            row = {"shape": name, "n": n, "k": k, "rows": rows, "swiglu": swiglu, "cold": not args.hot,
                   "cublas_us": round(cublas, 2), "gemv_us": round(ours, 2), "gemv_blocks": default,
                   "best_us": round(best[0], 2), "best_setting": best[1]}
            results.append(row)
            print(f"{name:20s} {rows:4d} {cublas:10.2f} {ours:8.2f} {str(default):9s} {best[0]:8.2f} "
                  f"{str(best[1]):18s} {nbytes / cublas / 1e6:6.2f}/{nbytes / best[0] / 1e6:.2f}", flush=True)
            if args.out:
                args.out.write_text(json.dumps(results, indent=1))
        del weights, weight
        torch.cuda.empty_cache()
    return 0


def triton_pow2(value: int) -> int:
    return 1 << (value - 1).bit_length()


if __name__ == "__main__":
    sys.exit(main())
