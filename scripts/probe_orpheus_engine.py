#!/usr/bin/env python
"""The Orpheus LM component's engine alone (no Triton, no codec): the deployment's own build path, the
reference's sampling, fixed-length streams. Separates the decode loop's speed from the walk's.

Device: source .device/prepare.sh && python scripts/probe_orpheus_engine.py [--concurrency 1,64,256]
Prints, per concurrency, wall time, output tokens/s and per-step milliseconds (p50 of step-to-step gaps).
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "orpheus_3b_gpu.yaml")
    parser.add_argument("--checkpoint", default="builtin:orpheus-3b-random")
    parser.add_argument("--tokens", type=int, default=1200)
    parser.add_argument("--concurrency", default="2,1,64,256")
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(240, exit=True)  # a stuck run prints every stack and exits

    import yaml

    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.config import deployment_from_dict
    from mstar_common.engine.types import SamplingParams
    from mstar_common.families.orpheus.family import OrpheusFamily
    from mstar_common.families.orpheus.lm import DEFAULT_SAMPLING

    raw = yaml.safe_load(args.config.read_text())
    raw["checkpoint"] = args.checkpoint
    raw["model_kwargs"].pop("codec_checkpoint", None)
    dep = deployment_from_dict(raw, source=args.config.name)
    checkpoint = resolve_checkpoint(args.checkpoint, OrpheusFamily.builtin_checkpoints)
    rt = OrpheusFamily().build_component("lm", dep, checkpoint, args.device)
    engine = rt.engine
    prompt = rt.layout.prompt_ids(rt.tokenizer, "Hey there, my name is Tara, and I speak.", "tara")
    for c in (int(x) for x in args.concurrency.split(",") if x):
        done = threading.Event()
        stamps: list[float] = []
        left = [c]
        lock = threading.Lock()

        def on_output(rid, tokens, finish, error, stamps=stamps, left=left, done=done, lock=lock):
            if error:
                print("error", rid, error, flush=True)
            if rid.endswith("#0"):
                stamps.append(time.perf_counter())
            if finish is not None:
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

        tokens = 140 if c == 2 else args.tokens
        start = time.perf_counter()
        for i in range(c):
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i, **DEFAULT_SAMPLING)
            engine.add_request(f"c{c}#{i}", prompt, params, on_output)
        if not engine._thread:
            engine.start()
        done.wait()
        wall = time.perf_counter() - start
        gaps = np.diff(stamps) * 1e3
        replays = engine.runner.graphs.num_replays if engine.runner.graphs else 0
        print(f"c={c:4d} tokens={tokens} wall={wall:.2f}s tok/s={c * tokens / wall:,.0f} "
              f"first={(stamps[0] - start) * 1e3:.1f}ms step p50={np.percentile(gaps, 50):.2f}ms "
              f"p90={np.percentile(gaps, 90):.2f}ms graph replays so far={replays}", flush=True)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
