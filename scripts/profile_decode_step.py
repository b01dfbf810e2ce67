#!/usr/bin/env python
"""One decode step of a served LM backbone, kernel by kernel: random weights at the real shape, the server's
GPU defaults (Triton attention, fused ops, the tuned skinny GEMM), each batch size captured as a CUDA graph and
replayed under the torch profiler (mstar_common/bench/fusion.py `profile_step`). Prints each kernel's GPU time
per step; the replay's wall time minus the kernels' sum is the time between kernels.

Device: source .device/prepare.sh && python scripts/profile_decode_step.py --family llama --rows 1,256 --out p.json
Sampled steps: --sampling greedy temperature top_k_top_p (each setting's captured variant, the same step otherwise;
with --prefill, the prefill step too).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mstar_common.bench.checkpoints import add_step_args, family_checkpoint, rows_list  # noqa: E402
from mstar_common.bench.fusion import SAMPLING  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(parser, family="llama", rows="1,256")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--prefill", help="also a step of ROWSxLEN fresh prompts (e.g. 8x512: a 4096-token step)")
    parser.add_argument("--sampling", nargs="+", default=["greedy"], choices=sorted(SAMPLING),
                        help="the decode rows' sampling: each setting's graph variant is profiled")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    prefill = tuple(int(x) for x in args.prefill.split("x")) if args.prefill else None
    from mstar_common.bench.fusion import profile_step

    checkpoint = family_checkpoint(args.family, args.checkpoint)
    results = profile_step(checkpoint, args.family, rows_list(args), args.context,
                           args.page_size, prefill=prefill, kv_dtype=args.kv_dtype, sampling=tuple(args.sampling))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
