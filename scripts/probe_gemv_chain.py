"""The persistent probe's chain of 112 one-row skinny-GEMM launches (scripts/probe_persistent_step.py: 28 layers of
qkv, o, gate/up, down with SwiGLU on load; PDL; in a CUDA graph) with other mstar_kernels/gemv.py launch settings
against its defaults: does a grid of fewer programs, each loading its whole K slice before its PDL wait, stream
the chain's weights faster?

    python scripts/probe_gemv_chain.py qwen3 [llama]

Per setting (BLOCK_N, whole or half K per iteration, 8 warps, applied to all four projections) it prints the
chain's GPU time and the change against the defaults (`gemv_blocks`). H200, 2026-12-02: see docs/benchmarks.md.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mstar_common.bench.gpu_timing import graph_time_us  # noqa: E402
from mstar_kernels.gemv import gemv, gemv_blocks  # noqa: E402

_SPEC = importlib.util.spec_from_file_location("probe_persistent_step", ROOT / "scripts" / "probe_persistent_step.py")
probe = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(probe)


def measure(shapes: str, layers: int = 28) -> None:
    hidden, q, kv, inter = probe.SHAPES[shapes]
    qkv_n = q + 2 * kv
    h0, (wqkv, wo, wgu, wd) = probe.chain_case(hidden, q, kv, inter, layers)
    shapes_nk = [(qkv_n, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]

    def chain(settings):
        def run():
            h = h0
            for layer in range(layers):
                qkv = gemv(h, wqkv[layer], None, *settings[0])
                o = gemv(qkv[:, :q], wo[layer], None, *settings[1])
                gu = gemv(o, wgu[layer], None, *settings[2])
                h = gemv(gu, wd[layer], None, *settings[3], swiglu=True)
        return run

    print(shapes, "defaults", [gemv_blocks(1, n, k) for n, k in shapes_nk], flush=True)
    base = graph_time_us(chain([(None, None, None)] * 4), calls=4, replays=5)
    print(f"{shapes} default: {base:.1f} us", flush=True)
    for block_n in (8, 16):
        for warps in (8,):
            for k_mode in ("whole", "half"):
                settings = []
                for _, k in shapes_nk:
                    whole = triton.next_power_of_2(k)
                    settings.append((block_n, whole if k_mode == "whole" else max(64, whole // 2), warps))
                label = f"{shapes} block_n {block_n} warps {warps} k {k_mode}"
                try:
                    us = graph_time_us(chain(settings), calls=4, replays=5)
                    print(f"{label}: {us:.1f} us ({us / base - 1:+.1%})", flush=True)
                except Exception as exc:  # noqa: BLE001 - a setting that does not compile is reported
                    print(f"{label}: {type(exc).__name__} {str(exc)[:120]}", flush=True)


if __name__ == "__main__":
    for family in sys.argv[1:] or ["qwen3"]:
        measure(family)
