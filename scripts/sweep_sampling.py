#!/usr/bin/env python
"""Times the on-device sampling filters inside captured CUDA graphs: the sorted top-k/top-p form against the
sort-free kernel (kernels/top_k_top_p.py), and the whole `sample_on_device` with each, at Orpheus's audio
window (28,672 logits) for 1 to 256 rows. The result decides `MSTAR_TOP_P_KERNEL`.

Device: source .device/prepare.sh && python scripts/sweep_sampling.py [--out sampling.json]
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
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    from kernels.top_k_top_p import top_k_top_p
    from mstar_common.bench.gpu_timing import graph_time_us
    from mstar_common.engine.sampler import apply_top_k_top_p

    results = []
    for rows in (1, 16, 64, 256):
        logits = torch.randn(rows, args.vocab, device="cuda") / 0.6  # the reference's temperature
        top_k = torch.full((rows,), args.vocab, dtype=torch.int32, device="cuda")
        top_p = torch.full((rows,), 0.8, device="cuda")
        sort_us = graph_time_us(lambda: apply_top_k_top_p(logits, top_k[:, None].long(), top_p[:, None]), calls=5)
        kernel_us = graph_time_us(lambda: top_k_top_p(logits, top_k, top_p), calls=5)
        same = torch.equal(torch.isfinite(top_k_top_p(logits, top_k, top_p)),
                           torch.isfinite(apply_top_k_top_p(logits, top_k[:, None].long(), top_p[:, None])))
        row = {"rows": rows, "vocab": args.vocab, "sorted_us": round(sort_us, 1), "kernel_us": round(kernel_us, 1),
               "same_kept_sets": same}
        results.append(row)
        print(row, flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
