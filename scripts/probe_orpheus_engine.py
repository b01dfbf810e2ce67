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
import itertools
import os
import sys
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
    parser.add_argument("--walk", default="", help="comma list of concurrencies for the in-process walk: engine + "
                        "codec pump + SNAC (no Triton), per --codec-dtype; reports real-time streams")
    parser.add_argument("--codec-dtype", default="float32", help="comma list: float32, bfloat16; a '+residual' "
                        "suffix turns on the fused residual-unit kernel (MSTAR_SNAC_RESIDUAL_KERNEL=1), '+cudnn' the "
                        "depthwise convs through cuDNN (MSTAR_SNAC_CUDNN_DEPTHWISE=1)")
    parser.add_argument("--codec-throughput", action="store_true", help="codec windows/s per --codec-dtype "
                        "even without --walk")
    parser.add_argument("--walk-profile", type=Path, help="trace 2 s of each walk run (CUDA kernels of both the "
                        "engine and the codec) into this directory and print GPU busy time per stream")
    parser.add_argument("--codec-only", action="store_true", help="only the codec runs (--codec-throughput)")
    parser.add_argument("--walk-first-chunk", default="1", help="first_chunk_frames of the walk's streams: "
                        "an integer or auto (as the deployment knob)")
    parser.add_argument("--walk-timeline", type=float, default=0.0, metavar="SECONDS",
                        help="print the engine's ms per step, running and waiting requests, and streams stalled "
                        "so far, per 100 ms over the first SECONDS of each walk run (the start-up of c streams)")
    parser.add_argument("--kv-dtype", default="auto", help="resources.kv_cache.dtype: auto | fp8_e4m3")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(240, exit=True, file=sys.__stderr__)  # a stuck run: every stack, exit

    import yaml

    from mstar_common.bench.engine_probe import RunTracker
    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.config import deployment_from_dict
    from mstar_common.engine.types import SamplingParams
    from mstar_common.families.orpheus.family import OrpheusFamily
    from mstar_common.families.orpheus.lm import DEFAULT_SAMPLING

    raw = yaml.safe_load(args.config.read_text())
    raw["checkpoint"] = args.checkpoint
    raw["model_kwargs"].pop("codec_checkpoint", None)
    if args.codec_only:
        checkpoint = resolve_checkpoint(args.checkpoint, OrpheusFamily.builtin_checkpoints)
        for dtype in args.codec_dtype.split(","):
            codec_throughput(build_codec(raw, dtype, checkpoint, args.device), dtype)
        return 0
    raw["resources"]["kv_cache"]["dtype"] = args.kv_dtype
    raw["resources"]["kv_cache"]["prefix_caching"] = False  # one prompt for every stream: keep its prefills
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
        tracker = RunTracker(c)
        tokens = 140 if c == 2 else args.tokens
        start = time.perf_counter()
        for i in range(c):
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i, **sampling)
            engine.add_request(f"{rule}{c}#{i}", prompt, params, tracker.on_output)
        if not engine._thread:
            engine.start()
        if rule == "profile" and args.walk_profile:
            trace_walk(engine, args.walk_profile / f"engine_alone_c{c}.json")
        elif rule == "profile":
            profile_window()
        tracker.wait()
        stamps = tracker.stamps
        wall = time.perf_counter() - start
        gaps = np.diff(stamps) * 1e3
        replays = engine.runner.graphs.num_replays if engine.runner.graphs else 0
        print(f"{rule:9s} c={c:4d} tokens={tokens} wall={wall:.2f}s tok/s={c * tokens / wall:,.0f} "
              f"first={(stamps[0] - start) * 1e3:.1f}ms step p50={np.percentile(gaps, 50):.2f}ms "
              f"p90={np.percentile(gaps, 90):.2f}ms graph replays so far={replays}", flush=True)
    walk = [int(c) for c in args.walk.split(",") if c]
    for dtype in (args.codec_dtype.split(",") if walk or args.codec_throughput else []):
        codec = build_codec(raw, dtype, checkpoint, args.device)
        codec_throughput(codec, dtype)
        for c in walk:
            run_walk(rt, codec, prompt, c, args.tokens, dtype, args.walk_profile, args.walk_timeline,
                     None if args.walk_first_chunk == "auto" else int(args.walk_first_chunk))
    engine.shutdown()
    faulthandler.cancel_dump_traceback_later()
    return 0


def build_codec(raw: dict, dtype: str, checkpoint, device: str):
    from mstar_common.config import deployment_from_dict
    from mstar_common.families.orpheus.family import _build_snac

    dtype, _, variant = dtype.partition("+")
    os.environ["MSTAR_SNAC_RESIDUAL_KERNEL"] = "1" if variant == "residual" else "0"
    os.environ["MSTAR_SNAC_CUDNN_DEPTHWISE"] = "1" if variant == "cudnn" else "0"
    raw = {**raw, "model_kwargs": {**raw["model_kwargs"], "codec_dtype": dtype}}
    return _build_snac(deployment_from_dict(raw, source="probe"), checkpoint, device)


def codec_throughput(codec, dtype: str) -> None:
    """Windows per second of `codec.decode` (host numpy in and out, as the pump calls it) per batch size;
    PROBE_CODEC_PROFILE=1 adds the kernel table of 10 eager decodes of the largest batch."""
    import torch

    rng = np.random.default_rng(0)
    for n in (1, 8, 32, 64, 128):
        windows = rng.integers(0, 4096, size=(n, 4, 7), dtype=np.int32)
        codec.decode(windows)
        start = time.perf_counter()
        for _ in range(20):
            codec.decode(windows)
        ms = (time.perf_counter() - start) / 20 * 1e3
        print(f"codec {dtype:8s} batch={n:4d} {ms:7.2f} ms/call {n / ms * 1e3:9,.0f} windows/s", flush=True)
    if os.environ.get("PROBE_CODEC_PROFILE"):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                codec.played_frames(torch.from_numpy(windows).to(codec.device))
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))


class RecordingSink:
    """The pump's Sink contract, recording audio arrivals like the bench client does."""

    is_closed = False

    def __init__(self, log, on_end) -> None:
        self.log, self._on_end = log, on_end

    def _record(self, outputs) -> None:
        from mstar_common import wire

        samples = int(outputs[wire.AUDIO_CHUNK].size) if outputs else 0
        if samples:
            self.log.arrivals.append((time.perf_counter() - self.log.start, samples))

    def send_chunk(self, outputs) -> None:
        self._record(outputs)

    def send_final(self, outputs=None) -> None:
        self._record(outputs)
        self._on_end()

    def send_error(self, message: str) -> None:
        self.log.error = message
        self._on_end()

    def send_server_error(self, exc) -> str:
        self.send_error(str(exc))
        return str(exc)

    def is_cancelled(self) -> bool:
        return False


def run_walk(rt, codec, prompt: list[int], c: int, tokens: int, dtype: str, profile_dir: Path | None = None,
             timeline_s: float = 0.0, first_chunk_frames: int | None = 1) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_orpheus import StreamLog, summarize

    from mstar_common.bench.engine_probe import RunTracker
    from mstar_common.engine.codec_pump import AudioStream, CodecPump
    from mstar_common.engine.types import SamplingParams
    from mstar_common.families.orpheus.codes import SpeechChunker
    from mstar_common.families.orpheus.lm import DEFAULT_SAMPLING

    pump = CodecPump(rt.engine, codec, name="probe-codec")
    pump.start()
    if not rt.engine._thread:
        rt.engine.start()
    tracker = RunTracker(c)
    start = time.perf_counter()
    logs = [StreamLog(start) for _ in range(c)]
    for i in range(c):
        rid = f"walk-{dtype}-{c}#{i}"
        pump.register(AudioStream(rid, RecordingSink(logs[i], tracker.end_one), SpeechChunker(rt.layout, "wrap"),
                                  rt.sample_rate, num_prompt_tokens=len(prompt),
                                  first_chunk_frames=first_chunk_frames))
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i, **DEFAULT_SAMPLING)
        rt.engine.add_request(rid, prompt, params, pump.on_output)
    if timeline_s > 0:
        samples = sample_engine(rt.engine, timeline_s)
    if profile_dir is not None:
        trace_walk(rt.engine, profile_dir / f"walk_{dtype}_c{c}.json")
    tracker.wait()
    result = summarize(f"walk codec {dtype}", logs, time.perf_counter() - start)
    if timeline_s > 0:
        print_timeline(samples, logs, start)
    pump.stop()
    print(f"walk codec={dtype:8s} c={c:4d} wall={result.wall_s:.2f}s first p50={result.first_audio_p50_ms:.1f}ms "
          f"real-time={result.streams_real_time}/{c} audio-s/s={result.audio_s_per_s:.1f} RTF p50={result.rtf_p50:.3f} "
          f"codec calls={pump.num_codec_calls} windows={pump.num_windows} errors={result.errors}", flush=True)


def sample_engine(engine, seconds: float, period_s: float = 0.1) -> list[tuple[float, int, int, int]]:
    """(time, engine steps so far, running, waiting) every `period_s` for `seconds`, from this thread."""
    out = []
    end = time.perf_counter() + seconds
    while True:
        now = time.perf_counter()
        out.append((now, engine.num_steps, engine.scheduler.num_running, engine.scheduler.num_waiting))
        if now >= end:
            return out
        time.sleep(period_s)


def print_timeline(samples, logs, start: float) -> None:
    """Per window: ms per engine step, running/waiting requests, and how many streams had begun a playback
    gap by then (a slow stretch of steps right before the gaps start is the start-up dip)."""
    stalls = [log.stalls() for log in logs if log.arrivals]
    first_gaps = [at for total, at in stalls if at is not None and total >= 1e-2]
    for (t0, s0, _, _), (t1, s1, running, waiting) in itertools.pairwise(samples):
        per_step = (t1 - t0) * 1e3 / (s1 - s0) if s1 > s0 else float("inf")
        stalled = sum(at <= t1 - start for at in first_gaps)
        print(f"[timeline] t={t1 - start:5.2f}s  {per_step:7.2f} ms/step  running={running:4d} waiting={waiting:4d}"
              f"  streams stalled so far={stalled}", flush=True)


def trace_walk(engine, path: Path, delay_s: float = 4.0, window_s: float = 2.0) -> None:
    """2 s of the walk under the torch profiler (CUDA activity: every thread's kernels, both streams), saved as a
    Chrome trace; prints, per CUDA stream, kernel time and count, the union of all kernels (GPU busy), and the
    engine steps in the window."""
    import gzip
    import json

    from torch.profiler import ProfilerActivity, profile

    time.sleep(delay_s)
    steps0 = engine.num_steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time.sleep(window_s)
    steps = engine.num_steps - steps0
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    with gzip.open(f"{path}.gz", "wt") as f:
        json.dump(events, f)
    path.unlink()
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not gpu:
        print("[walk-profile] no GPU events recorded", flush=True)
        return
    per_stream: dict = {}
    for e in gpu:
        key = (e["args"].get("stream"), e["cat"])
        total, count = per_stream.get(key, (0.0, 0))
        per_stream[key] = (total + e["dur"], count + 1)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    busy, end = 0.0, spans[0][0]
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    wall = spans[-1][1] - spans[0][0]
    print(f"[walk-profile] {path.name}: {steps} engine steps in {wall / 1e3:.0f} ms "
          f"({wall / 1e3 / max(steps, 1):.2f} ms per step); GPU busy {busy / 1e3:.0f} ms ({100 * busy / wall:.1f}%)",
          flush=True)
    for (stream, cat), (total, count) in sorted(per_stream.items(), key=lambda kv: -kv[1][0]):
        print(f"[walk-profile]   stream {stream} {cat}: {total / 1e3:.1f} ms in {count} ops "
              f"({total / 1e3 / max(steps, 1):.2f} ms per step)", flush=True)


def profile_window() -> None:
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
