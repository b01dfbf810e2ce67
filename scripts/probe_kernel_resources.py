#!/usr/bin/env python3
"""Registers, spills and shared memory of a decode kernel as Triton compiles it for a Hopper GPU (sm_90), and how
many of its programs an SM then holds at once. Runs on a machine without a GPU: Triton compiles ahead of time for a
named target with the ptxas and cuobjdump it ships.

    python scripts/probe_kernel_resources.py                    # split attention, Qwen3-0.6B / Llama-3.2-3B heads
    python scripts/probe_kernel_resources.py --group 4 --warps 4 8 --block 32 64
    python scripts/probe_kernel_resources.py --kernel mid_gemm --rows 8 32 64 --split-k 4
    python scripts/probe_kernel_resources.py --kernel prefill --warps 4 8 --stages 2 3 --page-size 64

Pointers and integer arguments are compiled as the JIT specialises them at run time (divisible by 16: the pool's
strides are multiples of the head size), so the loads vectorise as they do when served.

The split attention kernel (mstar_kernels/paged_decode_attention.py) in three forms: `PREFETCH` is the form launched
under PDL where the grid fits one wave (the split's first block of context held in registers across the PDL wait);
`PREFETCH_L2` asks L2 for that block ahead of the wait and holds nothing. The tens-of-rows GEMM
(mstar_kernels/mid_gemm.py, under PDL) plain, with the pre-norm's add + RMSNorm inside (`mid_gemm_norm`) and with
the SwiGLU load; `--block` is then its columns of K per iteration (the last two forms take at most `FOLD_BLOCK_K`).
The ragged prefill attention (mstar_kernels/paged_prefill_attention.py) plain and grouped, with whether its dots
compiled to Hopper's warpgroup MMA (`wgmma`); `--block` is then its keys per iteration.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.6-3.9's default, said out loud (3.9 warns)

# sm_90 (H100 / H200): per SM
REGISTERS, MAX_WARPS, MAX_CTAS, SHARED, SHARED_RESERVED = 65536, 64, 32, 233472, 1024
REGISTER_UNIT = 256  # registers are allocated per warp in units of 256 (8 a thread)
FORMS = ("none", "registers", "L2")  # the split's first block: not read ahead, held in registers, asked of L2

SIGNATURE = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "bt_ptr": "*i32", "ctx_ptr": "*i32",
             "qsl_ptr": "*i32", "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
             "stride_qb": "i32", "stride_qh": "i32", "stride_ob": "i32", "stride_oh": "i32", "stride_slot": "i32",
             "stride_kv_head": "i32", "stride_bt": "i32", "scale_log2": "fp32"}


def ctas_per_sm(registers: int, warps: int, shared: int) -> dict[str, int]:
    """Programs of one kernel an sm_90 SM holds at once, by each limit and overall."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = (REGISTERS // per_warp) // warps
    by_shared = SHARED // (shared + SHARED_RESERVED)
    by_warps = MAX_WARPS // warps
    return {"registers": by_registers, "shared": by_shared, "warps": by_warps,
            "ctas": min(by_registers, by_shared, by_warps, MAX_CTAS)}


def compile_split(group: int, head_dim: int, block: int, page_size: int, warps: int, stages: int, prefetch: bool,
                  prefetch_l2: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mstar_kernels.paged_decode_attention import _decode_split_kernel

    const = dict(PAGE_SIZE=page_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
                 HEAD_DIM=head_dim, BLOCK=block, NUM_SPLITS=1, DOT_PRECISION="tf32", FP16_DOTS=False, MIXED=False,
                 PREFETCH=prefetch, PREFETCH_L2=prefetch_l2, L2_LINES=max(1, head_dim * 2 // 128),
                 USE_GDC=1 if prefetch or prefetch_l2 else 0)
    signature = dict(SIGNATURE) | {name: "constexpr" for name in const}
    names = list(signature)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
             if signature[name].startswith("*") or signature[name] == "i32"}
    source = ASTSource(fn=_decode_split_kernel, signature=signature,
                       constexprs={(names.index(name),): value for name, value in const.items()}, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


MID_GEMM_SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
                      "count_ptr": "*i32", "res_ptr": "*bf16", "g_ptr": "*bf16", "res_out_ptr": "*bf16", "M": "i32",
                      "N": "i32", "K": "i32", "K_SPLIT": "i32", "stride_xm": "i32", "stride_wn": "i32",
                      "stride_om": "i32", "stride_rm": "i32", "stride_ro": "i32", "eps": "fp32"}


MID_GEMM_FORMS = ("plain", "norm", "swiglu")


def compile_mid_gemm(rows: int, block_n: int, block_k: int, split_k: int, warps: int, stages: int, form: str):
    """`_mid_gemm_kernel` under PDL, as `mid_gemm` launches it for `rows` (`form` norm: `mid_gemm_norm`, with a
    residual; swiglu: `mid_gemm(swiglu=True)`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mstar_kernels.mid_gemm import FOLD_BLOCK_K, _mid_gemm_kernel, block_m_for, chunking

    norm, swiglu = form == "norm", form == "swiglu"
    block_m = block_m_for(rows)
    block_k, stages = chunking(norm or swiglu, block_m, block_n, block_k, stages)  # as the launch does
    const = dict(HAS_BIAS=False, SWIGLU=swiglu, NORM=norm, HAS_RES=norm, BLOCK_M=block_m, BLOCK_N=block_n,
                 BLOCK_K=block_k, NORM_BLOCK_K=FOLD_BLOCK_K, SPLIT_K=split_k, STAGES=stages, USE_GDC=1,
                 DOT_PRECISION="tf32")
    signature = dict(MID_GEMM_SIGNATURE) | {name: "constexpr" for name in const}
    names = list(signature)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
             if signature[name].startswith("*") or name.startswith("stride") or name in ("N", "K", "K_SPLIT")}
    source = ASTSource(fn=_mid_gemm_kernel, signature=signature,
                       constexprs={(names.index(name),): value for name, value in const.items()}, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


PREFILL_SIGNATURE = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "qsl_ptr": "*i32",
                     "ctx_ptr": "*i32", "bt_ptr": "*i32", "work_row_ptr": "*i32", "work_q_ptr": "*i32",
                     "num_items": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32",
                     "stride_slot": "i32", "stride_kv_head": "i32", "stride_bt": "i32", "scale_log2": "fp32"}


def compile_prefill(group: int, head_dim: int, block_n: int, page_size: int, warps: int, stages: int, heads: int):
    """The ragged prefill kernel as `paged_prefill_attention` launches it: `heads` 0 is the plain form (one query
    head a program), else the grouped form with that many heads a program."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mstar_kernels.paged_prefill_attention import BLOCK_M, _prefill_grouped_kernel, _prefill_kernel

    const = dict(PAGE_SIZE=page_size, GROUP=group, HEAD_DIM=head_dim, BM=BLOCK_M, BN=block_n, DOT_PRECISION="tf32")
    signature = dict(PREFILL_SIGNATURE)
    if heads:
        const = dict(PAGE_SIZE=page_size, GROUP=group, HEADS=heads) | {k: v for k, v in const.items()
                                                                      if k not in ("PAGE_SIZE", "GROUP")}
    else:
        del signature["num_items"]
    signature |= {name: "constexpr" for name in const}
    names = list(signature)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
             if signature[name].startswith("*") or name.startswith("stride")}
    source = ASTSource(fn=_prefill_grouped_kernel if heads else _prefill_kernel, signature=signature,
                       constexprs={(names.index(name),): value for name, value in const.items()}, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def resources(kernel) -> dict[str, int]:
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        text = subprocess.run([str(cuobjdump), "-res-usage", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return {"registers": int(found.group(1)), "stack": int(found.group(2)), "shared": int(kernel.metadata.shared)}


def _row(cells, used, warps) -> str:
    fit = ctas_per_sm(used["registers"], warps, used["shared"])
    return (f"| {' | '.join(map(str, cells))} | {used['registers']} | {used['stack']} B | {used['shared']:,} B | "
            f"**{fit['ctas']}** ({fit['registers']} / {fit['shared']} / {fit['warps']}) |")


def main() -> int:
    from mstar_kernels.mid_gemm import FOLD_BLOCK_K

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=["split", "mid_gemm", "prefill"], default="split")
    parser.add_argument("--group", type=int, nargs="+", default=[2, 3], help="split: query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, nargs="+", default=None,
                        help="split: context tokens per iteration (default 64); mid_gemm: K per iteration (256)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--warps", type=int, nargs="+", default=[4])
    parser.add_argument("--stages", type=int, nargs="+", default=None,
                        help="default: 2 (split, prefill), 3 (mid_gemm); split and mid_gemm take the first")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64], help="mid_gemm: rows of the step")
    parser.add_argument("--block-n", type=int, default=32, help="mid_gemm: output columns a program")
    parser.add_argument("--split-k", type=int, default=1, help="mid_gemm")
    args = parser.parse_args()
    tail = "registers | stack (spills) | shared | programs per SM (by registers / shared / warps) |"
    if args.kernel == "prefill":
        from mstar_kernels.paged_prefill_attention import grouped_heads

        print(f"| group | form | keys per iteration | warps | stages | wgmma | {tail}")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for group, block, warps, stages in itertools.product(args.group, args.block or [64], args.warps,
                                                             args.stages or [2]):
            for heads in dict.fromkeys([0, 1, grouped_heads(group)]):
                kernel = compile_prefill(group, args.head_dim, block, args.page_size, warps, stages, heads)
                form = f"grouped, {heads} head{'s' if heads > 1 else ''}" if heads else "plain"
                wgmma = "yes" if "wgmma" in kernel.asm["ptx"] else "no"
                print(_row((group, form, block, warps, stages, wgmma), resources(kernel), warps), flush=True)
        return 0
    if args.kernel == "mid_gemm":
        stages = args.stages[0] if args.stages else 3
        print(f"| rows | K per iteration asked | warps | form | {tail}")
        print("|---|---|---|---|---|---|---|---|")
        for rows, block, warps, form in itertools.product(args.rows, args.block or [256], args.warps, MID_GEMM_FORMS):
            kernel = compile_mid_gemm(rows, args.block_n, block, args.split_k, warps, stages, form)
            ran = f"{kernel.metadata.num_stages} stages" + (f", K {FOLD_BLOCK_K}" if form != "plain" else "")
            print(_row((rows, block, warps, f"{form} ({ran})"), resources(kernel), warps), flush=True)
        return 0
    stages = args.stages[0] if args.stages else 2
    print(f"| group | block | warps | first block ahead of the wait | {tail}")
    print("|---|---|---|---|---|---|---|---|")
    for group, block, warps, form in itertools.product(args.group, args.block or [64], args.warps, FORMS):
        kernel = compile_split(group, args.head_dim, block, args.page_size, warps, stages, form == "registers",
                               form == "L2")
        print(_row((group, block, warps, form), resources(kernel), warps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
