#!/usr/bin/env python3
"""The skinny GEMM's settings chosen by timing whole captured decode steps (GPU): `mstar_common.bench.fusion.
tune_step_plans`. Starts from the server's per-projection tuning, tries each candidate setting per projection shape
in the captured step, keeps what makes the step faster, and ends with an A/B of the two plans in one process.

    python scripts/tune_step_gemv.py --family qwen3 --rows 1 --out step_tune.json [--write-cache]

`--write-cache` stores the step-timed settings in this GPU's GEMV cache (under `MSTAR_CACHE_DIR`), which every
server on the machine reads at start (`tune_gemv`; `MSTAR_GEMV_STEP_PLANS=0` ignores them), but only where the
final A/B's step-tuned plan beat the tuned one by `--min-gain` (default 0.5%). They apply to every model with a
projection of that shape, dtype and bias at that row count; delete the cache file to drop them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mstar_common.bench.checkpoints import add_step_args, family_checkpoint, rows_list  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(parser, family="qwen3", rows="1")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop trying candidates after this long")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--write-cache", action="store_true",
                        help="store the step-timed settings in this GPU's GEMV cache for the server")
    parser.add_argument("--min-gain", type=float, default=0.005,
                        help="--write-cache stores a row count's settings only if its step got this much shorter")
    args = parser.parse_args()
    from mstar_common.bench.fusion import tune_step_plans

    checkpoint = family_checkpoint(args.family, args.checkpoint)
    results = [tune_step_plans(checkpoint, args.family, rows, args.context, budget_s=args.budget_s)
               for rows in rows_list(args)]
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    if args.write_cache:
        from mstar_common.layers.linear import default_gemv_cache, write_step_settings

        settings = {}
        for result in results:
            tuned, stepped = result["ab_ms"]["tuned"], result["ab_ms"]["step_tuned"]
            keep = stepped < tuned * (1 - args.min_gain) and result["step_settings"]
            print(f"[step-tune] rows {result['rows']}: {tuned:.4f} -> {stepped:.4f} ms: "
                  + (f"storing {result['step_settings']}" if keep else "nothing to store"), flush=True)
            if keep:
                settings.update(result["step_settings"])
        if settings:
            cache = default_gemv_cache()
            write_step_settings(cache, settings)
            print(f"[step-tune] wrote {len(settings)} setting(s) to {cache}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
