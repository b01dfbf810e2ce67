#!/usr/bin/env python
"""Times kernels/gemv.py against `F.linear` (cuBLAS) at the served models' decode projections, each inside a
captured CUDA graph (as the engine replays them), and prints which wins per shape and row count. The result
decides `MSTAR_GEMV_MAX_ROWS` (kernels/gemv.py).

Device: source .device/prepare.sh && python scripts/sweep_gemv.py [--out gemv.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name, N (out features), K (in features), bias
SHAPES = [
    ("qwen3-0.6b qkv", 4096, 1024, False), ("qwen3-0.6b o", 1024, 2048, False),
    ("qwen3-0.6b gate_up", 6144, 1024, False), ("qwen3-0.6b down", 1024, 3072, False),
    ("llama-3b qkv", 5120, 3072, False), ("llama-3b o", 3072, 3072, False),
    ("llama-3b gate_up", 16384, 3072, False), ("llama-3b down", 3072, 8192, False),
    ("whisper-v3 qkv", 3840, 1280, True), ("whisper-v3 q/o", 1280, 1280, True),
    ("whisper-v3 fc1", 5120, 1280, True), ("whisper-v3 fc2", 1280, 5120, True),
]
ROWS = (1, 2, 4, 8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F

    from kernels.gemv import gemv, gemv_blocks, gemv_warps
    from mstar_common.bench.gpu_timing import graph_time_us

    results = []
    print(f"{'shape':20s} rows  cublas us  gemv us (blocks)  best-of-sweep us (blocks)  weight TB/s cublas/gemv")
    for name, n, k, has_bias in SHAPES:
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        for rows in ROWS:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            cublas = graph_time_us(lambda: F.linear(x, weight, bias))
            default = gemv_blocks(rows, n, k)
            ours = graph_time_us(lambda: gemv(x, weight, bias))
            best = (ours, default, gemv_warps(rows, *default))
            for block_n in (1, 2, 4, 8):
                for block_k in (256, 1024, 4096):
                    if block_n * block_k * triton_pow2(rows) > 16384:
                        continue
                    try:
                        us = graph_time_us(lambda: gemv(x, weight, bias, block_n, block_k), replays=3)
                    except Exception as exc:  # out of resources: skip the setting
                        print(f"  skip {block_n}x{block_k}: {type(exc).__name__}")
                        continue
                    if us < best[0]:
                        best = (us, (block_n, block_k), gemv_warps(rows, block_n, block_k))
            nbytes = n * k * 2
            row = {"shape": name, "n": n, "k": k, "rows": rows, "cublas_us": round(cublas, 2),
                   "gemv_us": round(ours, 2), "gemv_blocks": default, "best_us": round(best[0], 2),
                   "best_blocks": best[1], "best_warps": best[2]}
            results.append(row)
            print(f"{name:20s} {rows:4d} {cublas:10.2f} {ours:8.2f} {str(default):9s} {best[0]:8.2f} "
                  f"{str(best[1])}/{best[2]:<3d} {nbytes / cublas / 1e6:6.2f}/{nbytes / ours / 1e6:.2f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


def triton_pow2(value: int) -> int:
    return 1 << (value - 1).bit_length()


if __name__ == "__main__":
    sys.exit(main())
