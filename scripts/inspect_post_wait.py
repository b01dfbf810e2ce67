#!/usr/bin/env python3
"""What a decode kernel does after its PDL wait, read from the PTX that Triton compiles for sm_90 (no GPU needed).

    python scripts/inspect_post_wait.py                      # the one-row Qwen3-0.6B chain's GEMV and prologue
    python scripts/inspect_post_wait.py --gemv 16,1024,8 --norm --residual --k 1024 --n 4096 [--no-one-read]
    python scripts/inspect_post_wait.py --prologue [--no-ahead]

Under PDL (mstar_kernels/_pdl.py) a kernel loads ahead of `griddepcontrol.wait` what no unfinished kernel writes;
what follows the wait lies on the decode step's chain. Per kernel it prints the registers a thread (ptxas -v) and,
after the wait: global loads and stores, shared-memory stores and loads, CTA barriers and warp shuffles. Global
loads before the first barrier or store after the wait are independent (one trip to L2); each load behind a
barrier or a store is another trip. That count found the GEMV's three dependent reads of a normed input and the
prologue's step inputs after its wait (docs/benchmarks.md, "Fewer serial reads after each PDL wait, and earlier
triggers", 2026-12-04).

The counts are static: every path of the kernel is counted, also one that a launch skips (the GEMV's K loop after
a chunk that held the whole of K), so compare variants (`--no-one-read`, `--no-ahead`) rather than
read the figures as a launch's. On this machine (Triton 3.9, 2026-12-04), Qwen3-0.6B's qkv setting: 13 global
loads after the wait in 3 trips with the one read, 16 in 4 without; the prologue: 3 global loads after its wait
ahead, 14 without.

Needs a Triton with its NVIDIA backend (3.5 or newer) and a ptxas that reads its PTX (Triton's own `ptxas` or
`ptxas-blackwell`, or `--ptxas PATH`). Not a test: a look at the code a GPU would run, under this machine's Triton.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OPS = {"ld.global": "global loads", "st.global": "global stores", "st.shared": "shared stores",
       "ld.shared": "shared loads", "bar.sync": "CTA barriers", "shfl.sync": "warp shuffles"}


def compile_ptx(fn, signature: dict[str, str], constexprs: dict[str, object], aligned: list[str],
                num_warps: int) -> str:
    """PTX of `fn` for sm_90 with `signature` (name -> Triton type), `constexprs` and 16-byte alignment (and
    divisibility by 16) on `aligned`, as Triton's launcher specialises them at run time."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    sig.update({name: "constexpr" for name in constexprs})
    names = list(sig)
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs={(names.index(name),): [["tt.divisibility", 16]] for name in aligned})
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]


def find_ptxas(given: str | None) -> str | None:
    if given:
        return given
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (bin_dir / name).exists():
            return str(bin_dir / name)
    return shutil.which("ptxas")


def registers(ptx: str, ptxas: str | None) -> str:
    """ptxas's register count for the kernel, or why there is none."""
    if ptxas is None:
        return "no ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run([ptxas, "-v", "-arch=sm_90a", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True)
    found = re.search(r"Used (\d+) registers", run.stderr)
    return found.group(1) if found else f"ptxas failed: {run.stderr.strip().splitlines()[-1:]}"


def after_wait(ptx: str) -> dict[str, int]:
    """Counts of OPS after the first `griddepcontrol.wait` (up to the kernel's last instruction), and `trips`: the
    runs of global loads separated by a barrier or a global store (a lower bound on serial trips to memory)."""
    body = ptx.split("griddepcontrol.wait", 1)
    if len(body) == 1:
        return {"no PDL wait": 1}
    lines = [line.strip() for line in body[1].splitlines() if line.strip() and not line.strip().startswith("//")]
    counts = {label: sum(1 for line in lines if op in line) for op, label in OPS.items()}
    trips, in_run = 0, False
    for line in lines:
        if "ld.global" in line:
            trips += not in_run
            in_run = True
        elif "bar.sync" in line or "st.global" in line:
            in_run = False
    counts["load trips"] = trips
    return counts


def gemv_report(args) -> tuple[str, str]:
    from mstar_kernels.gemv import _gemv_kernel

    block_n, block_k, warps = (int(v) for v in args.gemv.split(","))
    names = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "res_ptr", "g_ptr", "res_out_ptr", "M", "N", "K", "stride_xm",
             "stride_wn", "stride_om", "stride_rm", "stride_ro", "eps"]
    types = ["*bf16"] * 7 + ["i32"] * 8 + ["fp32"]
    const = {"HAS_BIAS": False, "SWIGLU": args.swiglu, "NORM": args.norm, "HAS_RES": args.residual, "BLOCK_M": 1,
             "BLOCK_N": block_n, "BLOCK_K": block_k, "STAGES": 1, "ONE_CHUNK": block_k >= args.k and args.one_read,
             "USE_GDC": 1}
    aligned = names[:7] + ["N", "K", "stride_xm", "stride_wn", "stride_om", "stride_rm", "stride_ro"]
    form = "norm" if args.norm else "swiglu" if args.swiglu else "plain"
    label = (f"gemv {args.n}x{args.k} ({block_n}, {block_k}, {warps} warps), {form}"
             f"{' + residual' if args.residual else ''}, one read {const['ONE_CHUNK']}")
    return label, compile_ptx(_gemv_kernel, dict(zip(names, types, strict=True)), const, aligned, warps)


def prologue_report(args) -> tuple[str, str]:
    from mstar_kernels.qk_norm_rope_kv import _qk_norm_rope_kv_kernel

    names = ["qkv_ptr", "cos_ptr", "sin_ptr", "qw_ptr", "kw_ptr", "slot_ptr", "q_out_ptr", "k_cache_ptr",
             "v_cache_ptr", "num_tokens", "stride_tok", "stride_cos", "stride_qo_tok", "stride_slot",
             "stride_kv_head", "eps"]
    types = ["*bf16", "*i64", "*fp32", "*bf16", "*bf16", "*i32", "*bf16", "*bf16", "*bf16"] + ["i32"] * 6 + ["fp32"]
    const = {"NUM_Q_HEADS": 16, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, "HAS_NORM": True, "FROM_POSITIONS": True,
             "INTERPRETED": False, "BLOCK_T": 1, "HEADS_PER_PROG": 1, "AHEAD": not args.no_ahead, "USE_GDC": 1}
    aligned = names[:9] + ["stride_tok", "stride_qo_tok", "stride_slot", "stride_kv_head"]
    label = f"prologue (Qwen3-0.6B heads, one token), ahead {const['AHEAD']}"
    return label, compile_ptx(_qk_norm_rope_kv_kernel, dict(zip(names, types, strict=True)), const, aligned, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gemv", help="BLOCK_N,BLOCK_K,warps of one GEMV launch (else the Qwen3-0.6B set)")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--norm", action="store_true")
    parser.add_argument("--residual", action="store_true")
    parser.add_argument("--swiglu", action="store_true")
    parser.add_argument("--no-one-read", dest="one_read", action="store_false", help="as MSTAR_GEMV_NORM_ONE_READ=0")
    parser.add_argument("--prologue", action="store_true", help="only the attention prologue")
    parser.add_argument("--no-ahead", action="store_true", help="the prologue as MSTAR_PROLOGUE_AHEAD=0")
    parser.add_argument("--ptxas", help="a ptxas that reads Triton's PTX (default: Triton's own)")
    parser.add_argument("--dump", type=Path, help="also write each kernel's PTX into this folder")
    args = parser.parse_args()
    jobs = []
    if args.prologue:
        jobs.append(prologue_report(args))
    elif args.gemv:
        jobs.append(gemv_report(args))
    else:  # the one-row Qwen3-0.6B chain's tuned settings on the H200 (docs/results/step_tune_*_2026-12-04.json)
        for setting, n, k, flags in (("16,1024,8", 4096, 1024, ("norm", "residual")), ("1,2048,4", 1024, 2048, ()),
                                     ("16,1024,8", 6144, 1024, ("norm", "residual")), ("8,4096,8", 1024, 3072,
                                                                                        ("swiglu",))):
            for name in ("norm", "residual", "swiglu"):
                setattr(args, name, name in flags)
            args.gemv, args.n, args.k = setting, n, k
            jobs.append(gemv_report(args))
        jobs.append(prologue_report(args))
    ptxas = find_ptxas(args.ptxas)
    for index, (label, ptx) in enumerate(jobs):
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"kernel{index}.ptx").write_text(ptx)
        counts = ", ".join(f"{key} {value}" for key, value in after_wait(ptx).items())
        print(f"{label}: {registers(ptx, ptxas)} registers; after the wait: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
