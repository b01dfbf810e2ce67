#!/usr/bin/env python
"""The Whisper decoder component's engine alone (no Triton, no walk, no encoder): the deployment's own build
path, greedy, English transcription without timestamps, fixed-length windows over a random encoder output.
Separates the decoder step's speed from the walk's per-token hops (the served ITL of bench_whisper.py).

Device: source .device/prepare.sh && python scripts/probe_whisper_decoder.py [--concurrency 1,16,64] [--profile]
(a checkpoint built beforehand: `bash scripts/gpu_family_benches.sh whisper` builds it with the image's Python).
Prints, per concurrency, tokens/s and the step-to-step gap of one row (p50/p90); with --profile, a
torch.profiler table of a c=1 window on a GPU (kernels by GPU time, CUDA runtime calls by CPU time; the
engine thread's aten ops are not recorded, the profiler records those of its own thread only).
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "whisper_large_v3_gpu.yaml")
    parser.add_argument("--checkpoint", default="builtin:whisper-large-v3-random")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,1,16,64", help="the first run warms up")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    faulthandler.dump_traceback_later(300, exit=True, file=sys.__stderr__)

    import yaml

    from mstar_common.bench.engine_probe import RunTracker
    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.config import deployment_from_dict
    from mstar_common.families.whisper import graph as g
    from mstar_common.families.whisper.decoding import build_prompt
    from mstar_common.families.whisper.family import WhisperFamily

    raw = yaml.safe_load(args.config.read_text())
    raw["checkpoint"] = args.checkpoint
    dep = deployment_from_dict(raw, source=args.config.name)
    checkpoint = resolve_checkpoint(args.checkpoint, WhisperFamily.builtin_checkpoints)
    rt = WhisperFamily().build_component("decoder", dep, checkpoint, args.device)
    engine = rt.engine
    prompt = build_prompt(rt.tokens, language="en" if rt.tokens.is_multilingual else None, task="transcribe",
                          timestamps=False, prompt_ids=[])
    source = np.random.default_rng(0).standard_normal(rt.source_shape).astype(np.float32)
    inputs = {g.ENCODER_OUTPUT: source, g.INPUT_IDS: np.asarray(prompt.prompt, np.int32),
              g.MAX_TOKENS: np.asarray([args.tokens], np.int32)}
    runs = [int(c) for c in args.concurrency.split(",") if c]
    if args.profile:
        runs.append(0)  # 0: the profiled c=1 window
    for run_index, c in enumerate(runs):
        profiled = c == 0
        c = max(c, 1)
        tracker = RunTracker(c)
        requests = [rt.parse_request(inputs) for _ in range(c)]
        for request in requests:
            request.params.ignore_eos = True  # random weights: every window decodes its full length
        start = time.perf_counter()
        profiler = _start_profiler() if profiled else None
        for i, request in enumerate(requests):
            engine.add_request(f"r{run_index}#{i}", request.prompt_ids, request.params, tracker.on_output,
                               request_state=request.request_state)
        if not engine._thread:
            engine.start()
        tracker.wait()
        wall = time.perf_counter() - start
        stamps = tracker.stamps
        gaps = np.diff(stamps) * 1e3
        print(f"c={c:3d} tokens={args.tokens} wall={wall:.3f}s tok/s={c * args.tokens / wall:,.0f} "
              f"first={(stamps[0] - start) * 1e3:.1f}ms step p50={np.percentile(gaps, 50):.3f}ms "
              f"p90={np.percentile(gaps, 90):.3f}ms{' (profiled)' if profiled else ''}", flush=True)
        if profiler is not None:
            _report(profiler)
    engine.shutdown()
    faulthandler.cancel_dump_traceback_later()
    return 0


def _start_profiler():
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    import torch

    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    profiler = profile(activities=activities)
    profiler.__enter__()
    return profiler


def _report(profiler) -> None:
    import torch

    profiler.__exit__(None, None, None)
    table = profiler.key_averages()
    if torch.cuda.is_available():
        print(table.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60), flush=True)
    print(table.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60), flush=True)


if __name__ == "__main__":
    sys.exit(main())
