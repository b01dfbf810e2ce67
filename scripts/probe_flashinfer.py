#!/usr/bin/env python
"""Can FlashInfer run beside our kernels on the lent GPU? A feasibility probe for a FlashInfer attention backend.

The newest FlashInfer wheels (62 MB plus tvm-ffi, cutlass-dsl, ...) do not fit the device's 64 MiB carry. Older
releases ship as a 2.5 MB source archive that compiles its CUDA kernels at first use (JIT, with nvcc and ninja),
and need only numpy, torch and ninja. This probe imports one such release, JIT-compiles its paged batch decode
kernel for Qwen3-0.6B's heads (16 query / 8 KV heads, head dim 128, bf16, pages of 64), checks its output against
ours (mstar_kernels/paged_decode_attention.py) and the torch reference, and times both inside a CUDA graph at 64 rows x
640 tokens of context. Every phase prints its wall time, so a timeout still tells how far it got.

With CUDA 13's nvcc the JIT build of FlashInfer 0.2.5 fails to link: nvcc 13 makes each translation unit's
instantiations of a `__global__` template hidden (`-static-global-template-stub=true`), and FlashInfer
instantiates its kernels in one file and launches them from another. So this probe sets
`NVCC_APPEND_FLAGS=-static-global-template-stub=false` (nvcc reads it from the environment) when torch was built
for CUDA 13 or newer (through the backend's `import_flashinfer`). H200, 2026-12-02: the batch decode kernel
compiled in 27 s and ran.

Device: pip install --no-deps --no-build-isolation flashinfer_python-0.2.5.tar.gz; python scripts/probe_flashinfer.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    from mstar_common.bench.gpu_timing import graph_time_us
    from mstar_common.engine.flashinfer_backend import import_flashinfer  # sets the nvcc flag first
    from mstar_kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref

    started = time.perf_counter()
    report: dict = {"rows": args.rows, "context": args.context}

    def phase(name: str, **values) -> None:
        report[name] = {"at_s": round(time.perf_counter() - started, 1), **values}
        print(f"[probe] {name} at {report[name]['at_s']} s: {values}", flush=True)

    flashinfer = import_flashinfer()
    phase("import", version=flashinfer.__version__)
    rows, ctx, heads, kv_heads, dim, page = args.rows, args.context, 16, 8, 128, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    pages_per_row = -(-ctx // page)
    num_pages = rows * pages_per_row + 1
    k_cache = torch.randn((num_pages, page, kv_heads, dim), generator=gen, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = (torch.randperm(num_pages - 1, generator=gen, device="cuda").to(torch.int32) + 1).view(rows, -1)
    ctx_lens = torch.full((rows,), ctx, dtype=torch.int32, device="cuda")
    query = torch.randn((rows, heads, dim), generator=gen, device="cuda", dtype=torch.bfloat16)
    scale = dim**-0.5

    indptr = torch.arange(0, (rows + 1) * pages_per_row, pages_per_row, dtype=torch.int32, device="cuda")
    indices = tables.flatten().contiguous()
    last_page_len = torch.full((rows,), ctx - (pages_per_row - 1) * page, dtype=torch.int32, device="cuda")
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
        paged_kv_last_page_len_buffer=last_page_len)
    wrapper.plan(indptr, indices, last_page_len, heads, kv_heads, dim, page, q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16, sm_scale=scale)
    theirs = wrapper.run(query, (k_cache, v_cache))
    torch.cuda.synchronize()
    phase("flashinfer_batch_decode_jit")

    ours = paged_decode_attention(query, k_cache, v_cache, tables, ctx_lens, scale)
    ref = paged_decode_attention_ref(query, k_cache, v_cache, tables, ctx_lens, scale)

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    phase("accuracy", flashinfer_vs_ref=rel(theirs, ref), ours_vs_ref=rel(ours, ref),
          ours_vs_flashinfer=rel(ours, theirs))
    fi_us = graph_time_us(lambda: wrapper.run(query, (k_cache, v_cache)))
    our_us = graph_time_us(lambda: paged_decode_attention(query, k_cache, v_cache, tables, ctx_lens, scale))
    kv_bytes = 2 * rows * ctx * kv_heads * dim * 2
    phase("timing", flashinfer_us=round(fi_us, 2), ours_us=round(our_us, 2),
          flashinfer_TBps=round(kv_bytes / fi_us / 1e6, 3), ours_TBps=round(kv_bytes / our_us / 1e6, 3))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
