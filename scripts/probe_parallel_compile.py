#!/usr/bin/env python
"""How long Triton takes to compile the skinny GEMM's tuning candidates, one after another and on a thread pool.

    python scripts/probe_parallel_compile.py [--threads 1 2 16] [--rows 1 2 4] [--arch 90] [--limit N]

The GEMV tuning at start-up (mstar_common/layers/linear.py `tune_gemv`) compiles every candidate setting of every
projection at its first call, one after another; `MSTAR_PARALLEL_COMPILE=1` compiles them on a thread pool first.
This compiles the same kernels (mstar_kernels/gemv.py `_gemv_kernel` at Qwen3-0.6B's projection shapes, each
row count and form that the tuning times: plain, with SwiGLU for the down projection, with the norm inside for
qkv and gate_up; without PDL, which on the GPU makes the one- and two-row ones other variants of as many kernels)
for a CUDA target with no GPU needed (Triton and its bundled ptxas only), once per thread count,
each in a fresh process with an empty Triton cache, and prints the wall time of each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Qwen3-0.6B: (N, K, form) of qkv, o, gate_up, down
SHAPES = ((4096, 1024, "norm"), (1024, 2048, "plain"), (6144, 1024, "norm"), (1024, 3072, "swiglu"))
POINTERS = ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "res_ptr", "g_ptr", "res_out_ptr")
INTEGERS = ("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "stride_rm", "stride_ro")


def kernels(rows_list: list[int]) -> list[tuple[dict, dict]]:
    """(constexprs, options) of each distinct compile the tuning would make (the norm-fed shapes in both forms)."""
    from mstar_common.layers.linear import gemv_candidates
    from mstar_kernels.gemv import _one_chunk, gemv_warps

    seen, out = set(), []
    for rows in rows_list:
        for n, k, form in SHAPES:
            for setting in gemv_candidates(rows, n, k):
                block_n, block_k, *rest = setting
                num_warps, num_stages = rest if rest else (gemv_warps(rows, block_n, block_k), 1)
                for norm in ((False, True) if form == "norm" else (False,)):
                    consts = dict(HAS_BIAS=False, SWIGLU=form == "swiglu", NORM=norm, HAS_RES=norm,
                                  BLOCK_M=1 << (rows - 1).bit_length(), BLOCK_N=block_n,
                                  BLOCK_K=block_k or 1 << (k - 1).bit_length(), STAGES=num_stages,
                                  ONE_CHUNK=block_k >= k and _one_chunk(), USE_GDC=0)
                    key = json.dumps([consts, num_warps, num_stages], sort_keys=True)
                    if key not in seen:
                        seen.add(key)
                        out.append((consts, {"num_warps": num_warps, "num_stages": num_stages}))
    return out


def compile_all(rows_list: list[int], threads: int, arch: int, limit: int | None) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mstar_kernels.gemv import _gemv_kernel

    target = GPUTarget("cuda", arch, 32)
    jobs = kernels(rows_list)[:limit]

    def one(job):
        consts, options = job
        signature = {**{name: "*bf16" for name in POINTERS}, **{name: "i32" for name in INTEGERS}, "eps": "fp32",
                     **{name: "constexpr" for name in consts}}
        return triton.compile(ASTSource(_gemv_kernel, signature, constexprs=consts), target=target, options=options)

    started = time.perf_counter()
    if threads <= 1:
        for job in jobs:
            one(job)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, jobs))
    return {"threads": threads, "kernels": len(jobs), "seconds": round(time.perf_counter() - started, 2),
            "triton": triton.__version__, "arch": arch, "cpus": os.cpu_count()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4], help="the tuned row counts (default 1 2 4)")
    p.add_argument("--arch", type=int, default=90, help="the CUDA compute capability to compile for (90: H100/H200)")
    p.add_argument("--limit", type=int, help="compile only the first N kernels")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: one measurement, in this process
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(compile_all(args.rows, args.one, args.arch, args.limit)))
        return 0
    rows = []
    for threads in args.threads:  # each in a fresh process and an empty cache: nothing compiled before it
        with tempfile.TemporaryDirectory(prefix="mstar-compile-probe-") as cache:
            command = [sys.executable, __file__, "--one", str(threads), "--arch", str(args.arch), "--rows",
                       *map(str, args.rows), *(["--limit", str(args.limit)] if args.limit else [])]
            env = {**os.environ, "TRITON_CACHE_DIR": cache, "TRITON_DEFAULT_FP_FUSION": "1"}
            result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            row = json.loads(result.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{row['kernels']} GEMV kernels for sm_{row['arch']} on {threads} thread(s): {row['seconds']:.2f} s "
              f"(triton {row['triton']}, {row['cpus']} CPUs)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
