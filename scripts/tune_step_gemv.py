#!/usr/bin/env python3
"""The skinny GEMM's settings chosen by timing whole captured decode steps (GPU): `mstar_common.bench.fusion.
tune_step_plans`. Starts from the server's per-projection tuning, tries each candidate setting per projection shape
in the captured step, keeps what makes the step faster, and ends with an A/B of the two plans in one process.

    python scripts/tune_step_gemv.py --family qwen3 --rows 1 --out step_tune.json
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
    args = parser.parse_args()
    from mstar_common.bench.fusion import tune_step_plans

    checkpoint = family_checkpoint(args.family, args.checkpoint)
    results = [tune_step_plans(checkpoint, args.family, rows, args.context, budget_s=args.budget_s)
               for rows in rows_list(args)]
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
