"""Do one-row projections stream faster when their weights wait in shared memory? (GPU, Hopper or newer.)

The one-row decode step's projections read their weights at 1.5-2.1 TB/s: each starts loading only while the kernel
in front of it finishes, and what a Triton program loads ahead of its PDL wait lands in registers, which hold a
fraction of one projection (docs/benchmarks.md, "Where the one-row step waits"). scripts/probe_staged_gemv.cu
copies each CTA's rows of the weight into shared memory with bulk asynchronous copies as soon as the CTA starts,
then waits for its input. This probe times, in captured CUDA graphs, the chain of a model's 4 x `layers` one-row
projections (qkv -> o -> gate_up -> down, each layer with its own weights, so they come from HBM) in these forms:

- `triton`: mstar_kernels/gemv.py with the given settings (`--triton-plan`), launched with PDL as the server does;
- `cuda_after`: the CUDA kernel, its copy issued after the PDL wait (no lookahead);
- `cuda_early`: the copy issued before the wait, the next kernel launched after the wait (at most two overlap);
- `cuda_ahead`: the copy issued before the wait, the next kernel launched first (a chain of kernels resident at
  once, each copy in flight, as far as shared memory holds).

Every CUDA form must give the same bits (the same sums in the same order; the probe exits 1 otherwise), and one
projection of each shape is checked against torch. Prints one line per form and writes JSON with `--json`.

`--relay` puts a one-CTA copy kernel (no shared memory) in front of each projection, as a small kernel stands in
front of most projections in a decode step; `--carveout` sets the CUDA kernels' preferred shared-memory carveout.
Results: docs/benchmarks.md, "Weights staged in shared memory ahead of the PDL wait".

    python scripts/probe_staged_gemv.py [--family qwen3|llama] [--layers 28] [--cols 16 8 16 8] [--relay]
        [--carveout 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mstar_common.cuda_build import build_library  # noqa: E402

CUDA_SOURCE = Path(__file__).with_suffix(".cu")
# (hidden, qkv outputs, attention width, intermediate): the projections qkv hidden->qkv, o q->hidden,
# gate_up hidden->2*inter, down inter->hidden
SHAPES = {"qwen3": (1024, 4096, 2048, 3072), "llama": (3072, 5120, 3072, 8192)}
# the Qwen3-0.6B one-row settings the server's tuning chose on the H200 (2026-12-02)
QWEN3_PLAN = ((16, 1024, 8, 1), (1, 2048), (16, 1024, 8, 1), (8, 4096, 8, 1))
CUDA_FORMS = {"cuda_after": (1, 0), "cuda_early": (1, 1), "cuda_ahead": (3, 1)}  # (PDL mode, copy before wait)


def cuda_library() -> ctypes.CDLL:
    """scripts/probe_staged_gemv.cu built for this GPU (cached by the source's hash and the architecture)."""
    lib = build_library(CUDA_SOURCE, "probe_staged_gemv")
    lib.mstar_staged_gemv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5 + [ctypes.c_void_p]
    lib.mstar_staged_gemv.restype = ctypes.c_int
    lib.mstar_relay.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.mstar_relay.restype = ctypes.c_int
    lib.mstar_set_carveout.argtypes = [ctypes.c_int]
    lib.mstar_set_carveout.restype = ctypes.c_int
    return lib


def with_relay(lib, chain: "Chain", project, mode: int):
    """`project` with the relay kernel (y = x, one CTA, PDL `mode`) in front of each projection, as a small kernel
    stands in front of each projection in a decode step."""
    def relayed(i, weight, x):
        y = chain.relay_bufs[i][: x.shape[0]]
        code = lib.mstar_relay(x.data_ptr(), y.data_ptr(), x.shape[0], mode,
                               ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if code != 0:
            raise RuntimeError(f"mstar_relay failed: {code}")
        return project(i, weight, y)

    return relayed


def staged_gemv(lib, weight: torch.Tensor, x: torch.Tensor, out: torch.Tensor, cols: int, mode: int,
                stage_first: int) -> None:
    """out[:N] = weight @ x[:K] (one row, bf16) with the CUDA kernel, on the current stream."""
    n, k = weight.shape
    code = lib.mstar_staged_gemv(weight.data_ptr(), x.data_ptr(), out.data_ptr(), n, k, cols, mode, stage_first,
                                 ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    if code != 0:
        raise RuntimeError(f"mstar_staged_gemv({n}x{k}, cols {cols}, mode {mode}) failed: {code}")


class Chain:
    """`layers` x (qkv, o, gate_up, down) one-row projections with their own random weights (scaled so that the
    values stay of order one), and the buffers between them."""

    def __init__(self, family: str, layers: int, seed: int = 0):
        hidden, qkv_n, q, inter = SHAPES[family]
        gen = torch.Generator(device="cuda").manual_seed(seed)

        def rand(n, k):
            return (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()

        self.shapes = ((qkv_n, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter))
        self.weights = [[rand(n, k) for n, k in self.shapes] for _ in range(layers)]
        self.h0 = torch.randn(hidden, device="cuda", generator=gen).bfloat16()  # read, never written
        self.bufs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for n, _ in self.shapes]
        self.relay_bufs = [torch.empty(k, device="cuda", dtype=torch.bfloat16) for _, k in self.shapes]

    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for layer in self.weights for w in layer)

    def run(self, project) -> torch.Tensor:
        """`project(i, weight, x) -> out` for each projection in order (x: the first K values of the one before);
        returns the final hidden vector."""
        x = self.h0
        for layer in self.weights:
            for i, weight in enumerate(layer):
                x = project(i, weight, x[: weight.shape[1]])
        return x


def _triton_project(plan):
    from mstar_kernels.gemv import gemv_with

    def project(i, weight, x):
        return gemv_with(x.unsqueeze(0), weight, None, plan[i])[0]

    return project


def _cuda_project(lib, chain: Chain, cols, mode, stage_first):
    def project(i, weight, x):
        out = chain.bufs[i]
        staged_gemv(lib, weight, x, out, cols[i], mode, stage_first)
        return out

    return project


def graph_of(chain: Chain, project) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain.run(project)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain.run(project)
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def time_us(graph: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def check_one_projection(lib, chain: Chain, cols) -> float:
    """The largest relative error of one CUDA projection of each shape against torch in fp32."""
    worst = 0.0
    x = torch.randn(max(k for _, k in chain.shapes), device="cuda").bfloat16()
    for i, weight in enumerate(chain.weights[0]):
        out = torch.empty(weight.shape[0], device="cuda", dtype=torch.bfloat16)
        staged_gemv(lib, weight, x, out, cols[i], 0, 1)
        ref = weight.float() @ x[: weight.shape[1]].float()
        worst = max(worst, float((out.float() - ref).norm() / ref.norm()))
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(SHAPES), default="qwen3")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--cols", type=int, nargs=4, default=[16, 8, 16, 8],
                        help="CUDA form: output rows per CTA for qkv, o, gate_up, down")
    parser.add_argument("--triton-plan", default=None,
                        help="mstar_kernels/gemv.py settings for the four, e.g. "
                             "'16/1024/8/1 1/2048 16/1024/8/1 8/4096/8/1' "
                             "(default: Qwen3-0.6B's tuned one-row plan; for llama 8/1024/4/3 throughout)")
    parser.add_argument("--relay", action="store_true",
                        help="a one-CTA copy kernel (no shared memory) in front of each projection, as in a step")
    parser.add_argument("--carveout", type=int, default=None,
                        help="the CUDA kernels' preferred shared-memory carveout in percent (default: the driver's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.triton_plan:
        plan = tuple(tuple(int(v) for v in item.split("/")) for item in args.triton_plan.split())
    else:
        plan = QWEN3_PLAN if args.family == "qwen3" else ((8, 1024, 4, 3),) * 4
    lib = cuda_library()
    chain = Chain(args.family, args.layers)
    error = check_one_projection(lib, chain, args.cols)
    if args.carveout is not None and lib.mstar_set_carveout(args.carveout) != 0:
        raise RuntimeError(f"--carveout {args.carveout} refused")
    forms = {"triton": _triton_project(plan)}
    for name, (mode, first) in CUDA_FORMS.items():
        forms[name] = _cuda_project(lib, chain, args.cols, mode, first)
    if args.relay:  # the relay launched as each form's projections are (the Triton form: the served rule, early)
        relay_mode = {"triton": 1, **{name: mode for name, (mode, _) in CUDA_FORMS.items()}}
        forms = {name: with_relay(lib, chain, project, relay_mode[name]) for name, project in forms.items()}
    graphs = {name: graph_of(chain, project) for name, project in forms.items()}
    outs = {}
    for name, (graph, out) in graphs.items():  # the CUDA forms share their buffers: each result right after its run
        graph.replay()
        torch.cuda.synchronize()
        outs[name] = out.clone()
    same = all(torch.equal(outs["cuda_after"], outs[name]) for name in CUDA_FORMS)
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(args.rounds):
        for name, (graph, _) in graphs.items():
            times[name].append(time_us(graph))
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    floor_us = chain.weight_bytes() / 4.3e12 * 1e6
    result = {"family": args.family, "layers": args.layers, "cols": args.cols, "triton_plan": plan,
              "relay": args.relay, "carveout": args.carveout,
              "weight_bytes": chain.weight_bytes(), "floor_us_at_4.3TBps": floor_us, "one_projection_rel_err": error,
              "cuda_forms_bit_equal": same, "chain_us": median, "rounds_us": times,
              "gpu": torch.cuda.get_device_name(0)}
    for name, us in median.items():
        print(f"[staged-gemv] {args.family} {4 * args.layers} projections {name:11s} {us:8.1f} us "
              f"({chain.weight_bytes() / us / 1e6:.2f} TB/s; floor {floor_us:.1f} us)", flush=True)
    print(f"[staged-gemv] one projection vs torch: relative error {error:.2e}; CUDA forms bit-equal: {same}",
          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if same and error < 1e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
