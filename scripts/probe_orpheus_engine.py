#!/usr/bin/env python
"""The Orpheus LM component's engine alone (no Triton, no codec): the deployment's own build path, the
reference's sampling, fixed-length streams. Separates the decode loop's speed from the walk's.

Device: source .device/prepare.sh && python scripts/probe_orpheus_engine.py [--concurrency 1,64,256]
    [--sampling reference,greedy] [--profile-concurrency 256]
Prints, per sampling rule and concurrency, wall time, output tokens/s and per-step milliseconds (p50 of
step-to-step gaps); with --profile-concurrency, a torch.profiler table of 2 s in the middle of such a run.
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
    parser.add_argument("--sampling", default="reference",
                        help="comma list: reference (temperature 0.6, top_p 0.8, penalty 1.3), greedy, "
                             "nopenalty (the reference's without the repetition penalty)")
    parser.add_argument("--profile-concurrency", type=int, default=0, help="profile 2 s of a run at this c")
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
    rules = {"reference": dict(DEFAULT_SAMPLING), "greedy": {"temperature": 0.0},
             "nopenalty": {**DEFAULT_SAMPLING, "repetition_penalty": 1.0}}
    runs = [(rule, int(c)) for rule in args.sampling.split(",") for c in args.concurrency.split(",") if c]
    if args.profile_concurrency:
        runs.append(("profile", args.profile_concurrency))
    for rule, c in runs:
        sampling = rules.get(rule, rules["reference"])
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
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i, **sampling)
            engine.add_request(f"{rule}{c}#{i}", prompt, params, on_output)
        if not engine._thread:
            engine.start()
        if rule == "profile":
            profile_window(done)
        done.wait()
        wall = time.perf_counter() - start
        gaps = np.diff(stamps) * 1e3
        replays = engine.runner.graphs.num_replays if engine.runner.graphs else 0
        print(f"{rule:9s} c={c:4d} tokens={tokens} wall={wall:.2f}s tok/s={c * tokens / wall:,.0f} "
              f"first={(stamps[0] - start) * 1e3:.1f}ms step p50={np.percentile(gaps, 50):.2f}ms "
              f"p90={np.percentile(gaps, 90):.2f}ms graph replays so far={replays}", flush=True)
    engine.shutdown()
    return 0


def profile_window(done: threading.Event) -> None:
    """torch.profiler over 2 s once the run is decoding (the engine thread's kernels and host ops)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    time.sleep(3.0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        time.sleep(2.0)
    table = prof.key_averages()
    print(table.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70), flush=True)
    print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70), flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
