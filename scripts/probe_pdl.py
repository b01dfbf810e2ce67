"""Does Programmatic Dependent Launch (PDL, Hopper and newer) shorten a chain of decode-sized Triton kernels?

A one-row decode step of a small LLM is ~280 kernels of a few microseconds each, and the GPU idles between
them even inside a CUDA graph. With PDL a kernel is launched while its predecessor still runs: its programs
start, may issue loads that do not depend on the predecessor (the next projection's weights), then wait for the
predecessor's results (`griddepcontrol.wait`, `tl.extra.cuda.gdc_wait`).

The probe times, inside captured CUDA graphs, a chain shaped like `--layers` decoder layers at one row: an
RMSNorm of the hidden row, a wide projection (`--hidden` -> `--wide`) and a narrow one back (`--wide` ->
`--hidden`), each layer with its own weights (so they stream from HBM, not L2). Modes:

- `plain`: ordinary launches.
- `pdl`: every kernel launched with PDL and waiting before its first load.
- `pdl_prefetch`: as `pdl`, and the projections load their first weight chunk before they wait.

Every mode must produce the same bits as `plain` (the probe exits 1 otherwise). Prints one JSON object.

    python scripts/probe_pdl.py [--layers 28] [--hidden 1024] [--wide 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mstar_common.bench.gpu_timing import graph_time_us  # noqa: E402


@triton.jit
def _norm_kernel(x_ptr, w_ptr, out_ptr, n, eps, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a parameter: not the predecessor's output
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps) * w
    tl.store(out_ptr + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_GDC: tl.constexpr, PREFETCH: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    rows = w_ptr + n.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k = tl.arange(0, BLOCK_K)
    if PREFETCH:  # the first chunk of weights is in flight while the predecessor finishes
        w0 = tl.load(rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    start = 0
    if PREFETCH:
        acc += tl.sum(w0 * tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :], axis=1)
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        kk = k0 + k
        k_mask = kk < K
        w = tl.load(rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


class Chain:
    def __init__(self, layers: int, hidden: int, wide: int, dtype=torch.bfloat16):
        gen = torch.Generator(device="cuda").manual_seed(0)
        randn = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).to(dtype)  # noqa: E731
        self.norms = [1.0 + 0.1 * randn(hidden) for _ in range(layers)]
        self.ups = [randn(wide, hidden) / hidden**0.5 for _ in range(layers)]
        self.downs = [randn(hidden, wide) / wide**0.5 for _ in range(layers)]
        self.x = randn(hidden)
        self.normed = torch.empty_like(self.x)
        self.mid = torch.empty(wide, device="cuda", dtype=dtype)
        self.out = torch.empty_like(self.x)
        self.hidden, self.wide = hidden, wide

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.norms, *self.ups, *self.downs))

    def run(self, mode: str) -> torch.Tensor:
        pdl = mode != "plain"
        prefetch = mode == "pdl_prefetch"
        block = triton.next_power_of_2(self.hidden)
        h = self.x
        for norm, up, down in zip(self.norms, self.ups, self.downs, strict=True):
            _norm_kernel[(1,)](h, norm, self.normed, self.hidden, 1e-6, BLOCK=block, USE_GDC=pdl,
                               num_warps=4, launch_pdl=pdl)
            _gemv_kernel[(triton.cdiv(self.wide, 4),)](self.normed, up, self.mid, self.wide, self.hidden,
                                                      BLOCK_N=4, BLOCK_K=1024, USE_GDC=pdl, PREFETCH=prefetch,
                                                      num_warps=4, launch_pdl=pdl)
            _gemv_kernel[(triton.cdiv(self.hidden, 4),)](self.mid, down, self.out, self.hidden, self.wide,
                                                        BLOCK_N=4, BLOCK_K=1024, USE_GDC=pdl, PREFETCH=prefetch,
                                                        num_warps=4, launch_pdl=pdl)
            h = self.out
        return self.out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--wide", type=int, default=4096)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("probe_pdl: needs a CUDA GPU of compute capability >= 9.0 (PDL)")
    chain = Chain(args.layers, args.hidden, args.wide)
    kernels = 3 * args.layers
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "layers": args.layers, "hidden": args.hidden, "wide": args.wide, "kernels": kernels,
              "weight_mb": round(chain.weight_bytes() / 1e6, 1), "modes": {}}
    reference = chain.run("plain").clone()
    ok = True
    for mode in ("plain", "pdl", "pdl_prefetch", "plain"):
        try:
            us = graph_time_us(lambda mode=mode: chain.run(mode), calls=1, replays=50)  # one chain per replay
            same = bool(torch.equal(chain.run(mode), reference))
        except Exception as exc:  # noqa: BLE001 - a mode the stack cannot capture is a finding, not a crash
            report["modes"][mode] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            continue
        ok &= same
        row = {"replay_us": round(us, 1), "us_per_kernel": round(us / kernels, 2),
               "tb_per_s": round(chain.weight_bytes() / us / 1e6, 2), "bits_equal_plain": same}
        report["modes"][mode if mode not in report["modes"] else "plain_again"] = row
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
