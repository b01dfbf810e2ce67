#!/usr/bin/env python
"""Times the on-device sampling filters inside captured CUDA graphs: the sorted top-k/top-p form against the
sort-free kernel (mstar_kernels/top_k_top_p.py), and the whole `sample_on_device` with each, for 1 to 256 rows.
The default width is Orpheus's audio window (28,672 logits: one program a row); `--vocab 151936` is Qwen3's whole
vocabulary (the chunked search). `--top-k` adds a top-k cut to every row (0: top-p alone); the whole sampler is
also timed with both filters off (temperature alone). The result decides `MSTAR_TOP_P_KERNEL`.

Device: source .device/prepare.sh && python scripts/sweep_sampling.py [--vocab N] [--top-k K] [--out sampling.json]
Where the kept sets differ: python scripts/sweep_sampling.py --boundary-check 256 (any device; on the CPU with
TRITON_INTERPRET=1) lists each differing token with the fp64 probability mass ranked above it, so a difference
can be told apart from a bug: it must sit at the top_p boundary, within fp32 rounding of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=28_672)
    parser.add_argument("--top-k", type=int, default=0, help="a top-k cut on every row beside top_p 0.8 (0: none)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--boundary-check", type=int, metavar="ROWS", help="only the kept-set comparison")
    args = parser.parse_args()
    if args.boundary_check:
        return boundary_check(args.boundary_check, args.vocab)
    results = []
    for rows in (1, 16, 64, 256):
        results.append(time_rows(rows, args.vocab, args.top_k))
        print(results[-1], flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


def time_rows(rows: int, vocab: int, top_k_cut: int) -> dict:
    import torch

    import mstar_kernels.sampling as sampling
    from mstar_common.bench.gpu_timing import graph_time_us
    from mstar_common.engine.sampler import apply_top_k_top_p
    from mstar_kernels.top_k_top_p import top_k_top_p

    logits = torch.randn(rows, vocab, device="cuda") / 0.6  # the reference's temperature
    top_k = torch.full((rows,), top_k_cut or vocab, dtype=torch.int32, device="cuda")
    top_p = torch.full((rows,), 0.8, device="cuda")
    sort_us = graph_time_us(lambda: apply_top_k_top_p(logits, top_k[:, None].long(), top_p[:, None]), calls=5)
    kernel_us = graph_time_us(lambda: top_k_top_p(logits, top_k, top_p), calls=5)
    same = torch.equal(torch.isfinite(top_k_top_p(logits, top_k, top_p)),
                       torch.isfinite(apply_top_k_top_p(logits, top_k[:, None].long(), top_p[:, None])))
    row = {"rows": rows, "vocab": vocab, "top_k": top_k_cut, "top_p": 0.8, "sorted_us": round(sort_us, 1),
           "kernel_us": round(kernel_us, 1), "same_kept_sets": same}
    greedy = torch.zeros(rows, dtype=torch.bool, device="cuda")
    temperature = torch.full((rows,), 0.7, device="cuda")
    min_p = torch.zeros(rows, device="cuda")
    seeds = torch.arange(rows, device="cuda")
    off_k, off_p = torch.full_like(top_k, vocab), torch.ones_like(top_p)
    for label, k, p in (("sampler", top_k, top_p), ("sampler_filters_off", off_k, off_p)):
        for sort_free in (False, True):
            sampling._SORT_FREE_FILTER = sort_free
            row[f"{label}_{'kernel' if sort_free else 'sorted'}_us"] = round(graph_time_us(
                lambda k=k, p=p: sampling.sample_on_device(logits, greedy, temperature, k, p, min_p, seeds),
                calls=5), 1)
    sampling._SORT_FREE_FILTER = True
    return row


def boundary_check(rows: int, vocab: int, top_p: float = 0.8) -> int:
    import torch

    from mstar_common.engine.sampler import apply_top_k_top_p
    from mstar_kernels.top_k_top_p import top_k_top_p

    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).to(device) / 0.6
    top_k = torch.full((rows,), vocab, dtype=torch.int32, device=device)
    top_ps = torch.full((rows,), top_p, device=device)
    ours = torch.isfinite(top_k_top_p(logits, top_k, top_ps)).cpu()
    ref = torch.isfinite(apply_top_k_top_p(logits, top_k[:, None].long(), top_ps[:, None])).cpu()
    probs = torch.softmax(logits.double().cpu(), -1)
    differing = (ours != ref).nonzero().tolist()
    print(f"{rows} rows x {vocab} logits, top_p {top_p} on {device}: {len(differing)} token(s) kept differently")
    for row, token in differing:
        mass_above = float(probs[row][probs[row] > probs[row, token]].sum())
        print(f"  row {row} token {token}: kernel keeps {bool(ours[row, token])}, fp64 mass ranked above "
              f"{mass_above:.9f} (exact rule keeps it iff < {top_p})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
