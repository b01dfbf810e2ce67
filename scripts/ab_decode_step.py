#!/usr/bin/env python3
"""A/B of decode-step kernel switches in one process (GPU): `mstar_common.bench.fusion.ab_steps`.

    python scripts/ab_decode_step.py --family qwen3 --rows 1,2,4 \
        --variant base:MSTAR_NORM_GEMV=0 --variant norm_gemv:MSTAR_NORM_GEMV=1 --out ab.json

Each `--variant NAME:KEY=VALUE[,KEY=VALUE...]` is captured with those environment switches set, on one model
and one KV cache; the replays are then timed in alternation (median of rounds), so drift between separate
processes does not pass for a difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mstar_common.bench.checkpoints import add_step_args, family_checkpoint, rows_list  # noqa: E402


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`NAME:MSTAR_KEY=VALUE,...`, each value read by the switch's own parser (`check_switches`) before any GPU
    time is spent on the variant."""
    name, _, settings = text.partition(":")
    env = dict(item.split("=", 1) for item in settings.split(",") if item)
    if not name or any(not key.startswith("MSTAR_") for key in env):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME:MSTAR_KEY=VALUE[,MSTAR_KEY=VALUE...]")
    from mstar_common.bench.fusion import scoped_environment
    from mstar_common.switches import check_switches

    try:
        with scoped_environment(env):
            check_switches()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--variant {name}: {exc}") from None
    return name, env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(parser, family="qwen3", rows="1,2,4")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--variant", type=parse_variant, action="append", required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--served-like", action="store_true",
                        help="also time each variant's steps as the engine runs them (inputs in, tokens back)")
    parser.add_argument("--log", action="store_true", help="print the engine's INFO log (the GEMV tuning's decisions)")
    args = parser.parse_args()
    if args.log:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(message)s")
    from mstar_common.bench.fusion import ab_steps

    checkpoint = family_checkpoint(args.family, args.checkpoint)
    results = ab_steps(checkpoint, args.family, rows_list(args), dict(args.variant),
                       args.context, rounds=args.rounds, served_like=args.served_like, kv_dtype=args.kv_dtype)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
