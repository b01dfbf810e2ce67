"""How many kernels of a PDL chain run at once? (GPU, Hopper or newer.)

`mstar_kernels/_pdl.py` triggers the next kernel after each kernel's wait (`early`), so at most two kernels overlap.
`MSTAR_PDL_TRIGGER=ahead` triggers before the wait, which in principle lets a kernel launch as soon as every program
of the one before it has started, and so a chain of waiting kernels run ahead of the one that computes. This probe
shows what the GPU does: a captured CUDA graph of `--kernels` PDL launches, each of `--programs` programs, each
program stamping `%globaltimer` when it starts, when its wait returns and when it ends (after `--work-us` of spinning
past its wait). Per kernel it prints when its first program started and its last one ended, relative to the
chain's first start, and how many kernels had started before this one ended (the overlap depth).

    python scripts/probe_pdl_depth.py [--kernels 12] [--programs 132 1024] [--warps 4] [--work-us 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _now(anchor):
    return tl.inline_asm_elementwise("{ .reg .b32 t; mov.b32 t, $1; mov.u64 $0, %globaltimer; }", "=l,r", [anchor],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _stamp_kernel(out_ptr, work_ns, MODE: tl.constexpr):
    """MODE 0: no PDL; 1: wait, then trigger (`early`); 3: trigger, then wait (`ahead`)."""
    pid = tl.program_id(0)
    start = _now(pid)
    if MODE == 3:
        tl.extra.cuda.gdc_launch_dependents()
    if MODE:
        tl.extra.cuda.gdc_wait()
    waited = _now(pid)
    if MODE == 1:
        tl.extra.cuda.gdc_launch_dependents()
    t = waited
    while t < waited + work_ns:
        t = _now(pid)
    tl.store(out_ptr + pid * 3, start)
    tl.store(out_ptr + pid * 3 + 1, waited)
    tl.store(out_ptr + pid * 3 + 2, _now(pid))


def run(kernels: int, programs: int, warps: int, work_us: float, mode: str) -> dict:
    code = {"plain": 0, "early": 1, "ahead": 3}[mode]
    out = torch.zeros(kernels, programs, 3, dtype=torch.int64, device="cuda")

    def chain():
        for k in range(kernels):
            _stamp_kernel[(programs,)](out[k], int(work_us * 1000), MODE=code, num_warps=warps,
                                       launch_pdl=code > 0)

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    stamps = out.cpu()
    origin = int(stamps[:, :, 0].min())
    rows = []
    for k in range(kernels):
        first_start = int(stamps[k, :, 0].min()) - origin
        last_end = int(stamps[k, :, 2].max()) - origin
        started_before_end = int((stamps[:, :, 0].min(dim=1).values - origin < last_end).sum())
        rows.append({"kernel": k, "first_start_us": first_start / 1000, "last_start_us": (int(stamps[k, :, 0].max())
                     - origin) / 1000, "first_wait_return_us": (int(stamps[k, :, 1].min()) - origin) / 1000,
                     "last_end_us": last_end / 1000, "depth": started_before_end - k})
    return {"mode": mode, "kernels": kernels, "programs": programs, "warps": warps, "work_us": work_us,
            "chain_us": (int(stamps[:, :, 2].max()) - origin) / 1000, "per_kernel": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=12)
    parser.add_argument("--programs", type=int, nargs="+", default=[132, 1024])
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--work-us", type=float, default=5.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = []
    for programs in args.programs:
        for mode in ("plain", "early", "ahead"):
            result = run(args.kernels, programs, args.warps, args.work_us, mode)
            results.append(result)
            depths = [row["depth"] for row in result["per_kernel"]]
            starts = " ".join(f"{row['first_start_us']:.1f}" for row in result["per_kernel"])
            print(f"[pdl-depth] {programs:5d} programs {mode:6s} chain {result['chain_us']:7.1f} us, "
                  f"max depth {max(depths)}; first starts (us): {starts}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
