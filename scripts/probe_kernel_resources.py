#!/usr/bin/env python3
"""Registers, spills and shared memory of the decode split-attention kernel as Triton compiles it for a Hopper GPU
(sm_90), and how many of its programs an SM then holds at once. Runs on a machine without a GPU: Triton compiles
ahead of time for a named target with the ptxas and cuobjdump it ships.

    python scripts/probe_kernel_resources.py                    # Qwen3-0.6B / Llama-3.2-3B heads (GQA 2 and 3)
    python scripts/probe_kernel_resources.py --group 4 --warps 4 8 --block 32 64

Pointers and integer arguments are compiled as the JIT specialises them at run time (divisible by 16: the pool's
strides are multiples of the head size), so the loads vectorise as they do when served. `PREFETCH` is the form
launched under PDL (the split's first block of context held in registers across the PDL wait).
"""

from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# sm_90 (H100 / H200): per SM
REGISTERS, MAX_WARPS, MAX_CTAS, SHARED, SHARED_RESERVED = 65536, 64, 32, 233472, 1024
REGISTER_UNIT = 256  # registers are allocated per warp in units of 256 (8 a thread)

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


def compile_split(group: int, head_dim: int, block: int, page_size: int, warps: int, stages: int, prefetch: bool):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mstar_kernels.paged_decode_attention import _decode_split_kernel

    const = dict(PAGE_SIZE=page_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
                 HEAD_DIM=head_dim, BLOCK=block, NUM_SPLITS=1, DOT_PRECISION="tf32", FP16_DOTS=False, MIXED=False,
                 PREFETCH=prefetch, USE_GDC=1 if prefetch else 0)
    signature = dict(SIGNATURE) | {name: "constexpr" for name in const}
    names = list(signature)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
             if signature[name].startswith("*") or signature[name] == "i32"}
    source = ASTSource(fn=_decode_split_kernel, signature=signature,
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group", type=int, nargs="+", default=[2, 3], help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, nargs="+", default=[64], help="context tokens per iteration")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--warps", type=int, nargs="+", default=[4])
    parser.add_argument("--stages", type=int, default=2)
    args = parser.parse_args()
    print("| group | block | warps | PREFETCH | registers | stack (spills) | shared | programs per SM (by registers /"
          " shared / warps) |")
    print("|---|---|---|---|---|---|---|---|")
    for group, block, warps, prefetch in itertools.product(args.group, args.block, args.warps, (False, True)):
        kernel = compile_split(group, args.head_dim, block, args.page_size, warps, args.stages, prefetch)
        used = resources(kernel)
        fit = ctas_per_sm(used["registers"], warps, used["shared"])
        print(f"| {group} | {block} | {warps} | {prefetch} | {used['registers']} | {used['stack']} B | "
              f"{used['shared']:,} B | **{fit['ctas']}** ({fit['registers']} / {fit['shared']} / {fit['warps']}) |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
