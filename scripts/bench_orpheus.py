#!/usr/bin/env python
"""Orpheus serving benchmark: first audio, real-time streams, audio-s/s and RTF, against HF generate + snac.

On the H200 (after `source .device/prepare.sh`):
    python scripts/bench_orpheus.py                     # configs/orpheus_3b_gpu.yaml, builtin:orpheus-3b-random
CPU smoke (CI): python scripts/bench_orpheus.py --smoke [--triton-url HOST:PORT --checkpoint DIR]

Every request speaks a fixed number of audio tokens (`--tokens`, default 1200: ignore_eos, max_tokens) with the
reference's sampling (temperature 0.6, top_p 0.8, repetition_penalty 1.3). Random weights almost never put a
token in the band its frame position needs, so the deployment runs `frame_rule: wrap` (every audio token
counts; the decode and codec work is what a real checkpoint costs). Per concurrency c (closed batch of c
streams started together) it reports first audio p50/p90, the streams that stay ahead of real time (playback
from the first chunk, total stall < 10 ms), audio-s/s across streams and RTF (stream wall time / audio
seconds). The baseline is HF `generate` (same restriction to the custom rows, same sampling) with the
reference's SNAC decoding (a 28-token window every 7 tokens, batched across the rows of each step), in the
same process after the server stops. Results go to --out as JSON and to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mstar_common.bench.pa_files import SPEECH_TEXTS  # noqa: E402
from mstar_common.bench.report import json_text  # noqa: E402

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 2048
MAX_STALL_S = 0.010
READY = "READY"  # a load process's line once its streams are connected
START_LEAD_S = 0.2  # from the last load process ready to the common send instant
TEXT = SPEECH_TEXTS[0]  # the perf_analyzer file's first request


@dataclass
class StreamLog:
    start: float  # the common send instant (perf_counter seconds)
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, samples)
    error: str | None = None
    sent: float | None = None  # seconds after `start` at which this stream's request went out

    @property
    def audio_s(self) -> float:
        return sum(n for _, n in self.arrivals) / SAMPLE_RATE

    def stall_s(self) -> float:
        """Playback from the first chunk: total time the player waits for audio."""
        return self.stalls()[0]

    def stalls(self) -> tuple[float, float | None]:
        """(total stall, seconds since the request started of the first stall over 1 ms, or None)."""
        if not self.arrivals:
            return float("inf"), None
        clock, stall, first = self.arrivals[0][0], 0.0, None
        for arrival, samples in self.arrivals:
            gap = max(0.0, arrival - clock)
            if gap > 1e-3 and first is None:
                first = clock
            stall += gap
            clock = max(clock, arrival) + samples / SAMPLE_RATE
        return stall, first


@dataclass
class Result:
    system: str
    concurrency: int
    wall_s: float
    first_audio_p50_ms: float
    first_audio_p90_ms: float
    streams_real_time: int
    audio_s: float
    audio_s_per_s: float
    rtf_p50: float
    errors: int
    stall_p50_ms: float = float("nan")  # total playback stall per stream (0 for a real-time one)
    stall_p90_ms: float = float("nan")
    first_stall_p50_s: float | None = None  # among stalled streams: when (since the request) the first gap began
    # among stalled streams: the median rank of their first audio among all streams' (0 = first to start
    # playing, 1 = last): were the stalled ones the early starters or the late ones?
    stalled_start_rank_p50: float | None = None
    # per stream, in seed order: [first audio s, total stall ms, first stall s or None, last audio s, responses,
    # request sent s after the common start or None]
    streams: list = field(default_factory=list)
    send_spread_ms: float | None = None  # latest minus earliest request send across the streams


def summarize(system: str, logs: list[StreamLog], wall: float) -> Result:
    ok = [log for log in logs if log.error is None and log.arrivals]
    first = [log.arrivals[0][0] * 1e3 for log in ok] or [float("nan")]
    audio = sum(log.audio_s for log in ok)
    rtf = [log.arrivals[-1][0] / log.audio_s for log in ok if log.audio_s] or [float("nan")]
    stalls = [log.stalls() for log in ok] or [(float("nan"), None)]
    totals_ms = [total * 1e3 for total, _ in stalls]
    first_stalls = [at for total, at in stalls if total >= MAX_STALL_S and at is not None]
    order = np.argsort([log.arrivals[0][0] for log in ok], kind="stable")
    rank = np.empty(len(ok))
    rank[order] = np.arange(len(ok)) / max(1, len(ok) - 1)
    stalled_ranks = [rank[i] for i, (total, _) in enumerate(stalls) if ok and total >= MAX_STALL_S]
    streams = []
    for log in logs:
        if log.error is not None or not log.arrivals:
            streams.append(None)
            continue
        total, at = log.stalls()
        streams.append([round(log.arrivals[0][0], 4), round(total * 1e3, 2), None if at is None else round(at, 4),
                        round(log.arrivals[-1][0], 4), len(log.arrivals),
                        None if log.sent is None else round(log.sent, 4)])
    sent = [log.sent for log in logs if log.sent is not None]
    return Result(system, len(logs), round(wall, 3), round(float(np.percentile(first, 50)), 1),
                  round(float(np.percentile(first, 90)), 1), sum(total < MAX_STALL_S for total, _ in stalls),
                  round(audio, 2), round(audio / wall, 2), round(float(np.median(rtf)), 3), len(logs) - len(ok),
                  round(float(np.percentile(totals_ms, 50)), 1), round(float(np.percentile(totals_ms, 90)), 1),
                  round(float(np.median(first_stalls)), 3) if first_stalls else None,
                  round(float(np.median(stalled_ranks)), 2) if stalled_ranks else None, streams,
                  round((max(sent) - min(sent)) * 1e3, 1) if sent else None)


# ---- the served system (tritonclient gRPC streaming, one stream per request) -------------------------------


class _Stream:
    """One tritonclient gRPC stream: `open()` connects ahead of time, `run()` sends the request at `log.start`
    and records every audio response's arrival."""

    def __init__(self, url: str, model: str, tokens: int, seed: int, timeout_s: float = 600) -> None:
        self.url, self.model, self.tokens, self.seed, self.timeout_s = url, model, tokens, seed, timeout_s
        self.results: queue.Queue = queue.Queue()
        self.client = None
        self.inputs: list = []

    def open(self) -> None:
        import tritonclient.grpc as grpcclient

        from mstar_common import wire
        from mstar_common.bench.drivers import triton_grpc_client

        values = {wire.TEXT_INPUT: (np.array([TEXT.encode()], dtype=np.object_), "BYTES"),
                  "max_tokens": (np.array([self.tokens], np.int32), "INT32"),
                  "ignore_eos": (np.array([True]), "BOOL"), "seed": (np.array([self.seed], np.int64), "INT64")}
        for name, (arr, dtype) in values.items():
            tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
            tensor.set_data_from_numpy(arr)
            self.inputs.append(tensor)
        self.client = triton_grpc_client(self.url)
        self.client.start_stream(callback=lambda result, error: self.results.put((time.perf_counter(), result, error)))

    def run(self, log: StreamLog) -> None:
        from mstar_common import wire

        try:
            if self.client is None:
                self.open()
            time.sleep(max(0.0, log.start - time.perf_counter()))
            log.sent = time.perf_counter() - log.start
            self.client.async_stream_infer(self.model, self.inputs, request_id=str(self.seed),
                                           enable_empty_final_response=True)
            while True:
                try:
                    now, result, error = self.results.get(timeout=self.timeout_s)
                except queue.Empty:
                    log.error = f"no response within {self.timeout_s:.0f} s"
                    return
                if error is not None:
                    log.error = str(error)
                    return
                audio = result.as_numpy(wire.AUDIO_CHUNK)
                if audio is not None and audio.size:
                    log.arrivals.append((now - log.start, int(audio.size)))
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return
        finally:
            if self.client is not None:
                self.client.stop_stream(cancel_requests=log.error is not None)  # a stuck stream is cancelled
                self.client.close()


def _client_streams(url: str, model: str, tokens: int, seeds: list[int], when_ready, timeout_s: float
                    ) -> dict[int, StreamLog]:
    """A thread per stream, all in this process. Every stream connects first; `when_ready()` then returns the
    common start instant (perf_counter seconds) at which all of them send their requests."""
    streams = {seed: _Stream(url, model, tokens, seed, timeout_s) for seed in seeds}
    for stream in streams.values():
        stream.open()
    start = when_ready()
    logs = {seed: StreamLog(start) for seed in seeds}
    threads = [threading.Thread(target=streams[seed].run, args=(logs[seed],)) for seed in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return logs


def _client_worker(spec: str) -> int:
    """`bench_orpheus.py --client-worker JSON`: one load process. It connects its streams, prints READY, reads the
    common start instant from stdin, and prints its streams' logs as JSON."""
    job = json.loads(spec)

    def when_ready() -> float:
        print(READY, flush=True)
        return float(sys.stdin.readline())

    logs = _client_streams(job["url"], job["model"], job["tokens"], job["seeds"], when_ready, job["timeout_s"])
    print(json.dumps({seed: [log.arrivals, log.error, log.sent] for seed, log in logs.items()}), flush=True)
    return 0


def bench_served(url: str, model: str, concurrency: int, tokens: int, timeout_s: float = 600,
                 streams_per_proc: int = 32, stagger_s: float = 0.0) -> Result:
    """`timeout_s`: the longest wait for any one response of a stream (a stuck stream is an error).

    Streams are spread over ceil(concurrency / streams_per_proc) client processes (this script, re-run as
    `--client-worker`), so the client's own Python (one GIL decoding every stream's responses) is not what
    limits 256 streams. Arrival times are `time.perf_counter` (CLOCK_MONOTONIC on Linux: one clock for all).
    Every process imports and connects its streams first and says READY; once all have, they all send their
    requests at one common instant `start`, so a slow process start-up does not stagger the streams.
    `stagger_s` > 0 staggers them on purpose: load process i sends at `start + i * stagger_s` (arrivals in
    waves of `streams_per_proc`; each stream's times count from its own process's send instant).
    """
    import subprocess

    num_procs = max(1, -(-concurrency // max(1, streams_per_proc)))
    groups = [list(range(i, concurrency, num_procs)) for i in range(num_procs)]
    if num_procs == 1:
        logs = list(_client_streams(url, model, tokens, groups[0], lambda: time.perf_counter() + START_LEAD_S,
                                    timeout_s).values())
        return summarize("mstar-triton", logs, time.perf_counter() - logs[0].start)
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--client-worker", json.dumps(
        {"url": url, "model": model, "tokens": tokens, "seeds": g, "timeout_s": timeout_s})],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for g in groups]
    ready = [_wait_ready(proc) for proc in procs]
    start = time.perf_counter() + START_LEAD_S  # every process sends its streams' requests at this instant
    for i, (proc, ok) in enumerate(zip(procs, ready, strict=True)):
        if ok:
            proc.stdin.write(f"{start + i * stagger_s!r}\n")
        proc.stdin.close()  # a process that was not ready reads an empty line and exits
    logs = [StreamLog(start, error="client process failed") for _ in range(concurrency)]
    for proc in procs:
        out = proc.stdout.read()  # after READY a process writes only its final JSON line
        proc.wait()
        if proc.returncode == 0 and out.strip():
            for seed, (arrivals, error, sent) in json.loads(out.strip().splitlines()[-1]).items():
                log = logs[int(seed)]
                log.arrivals, log.error, log.sent = [tuple(a) for a in arrivals], error, sent
    return summarize("mstar-triton", logs, time.perf_counter() - start)


def _wait_ready(proc) -> bool:
    """Block until a load process has connected its streams (its READY line); False if it exited first."""
    for line in proc.stdout:
        if line.strip() == READY:
            return True
    return False


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set: expected KEY=VALUE, got {pair!r}")
        out[key] = yaml.safe_load(value)
    return out


def start_server(config: Path, checkpoint: str | None, max_concurrency: int, workdir: Path,
                 codec_in_process: bool = False, kv_dtype: str | None = None,
                 first_chunk_frames: int | str | None = None, model_kwargs: dict | None = None,
                 prefix_caching: bool = False):
    from mstar_common.config import deployment_from_dict
    from mstar_common.launcher import LogEcho, Ports, start_triton, wait_ready
    from mstar_common.repository import entry_model, write_repository

    raw = yaml.safe_load(config.read_text())
    if checkpoint:
        raw["checkpoint"] = checkpoint
        raw["model_kwargs"].pop("codec_checkpoint", None)  # a builtin carries its SNAC in snac/
    raw["model_kwargs"]["frame_rule"] = "wrap"
    if codec_in_process:
        raw["model_kwargs"]["codec_in_process"] = True
    if kv_dtype:
        raw["resources"]["kv_cache"]["dtype"] = kv_dtype
    # every stream speaks the same text: a prefix cache would skip the prompts' prefills (off unless asked)
    raw["resources"]["kv_cache"]["prefix_caching"] = prefix_caching
    if first_chunk_frames:
        raw["model_kwargs"]["first_chunk_frames"] = first_chunk_frames
    raw["model_kwargs"].update(model_kwargs or {})
    raw["max_concurrent_requests"] = max(raw.get("max_concurrent_requests", 1), max_concurrency)
    dep = deployment_from_dict(raw, source=config.name)
    repo = write_repository(dep, workdir / "model_repository", config.name)
    ports = Ports.free(proxy=False)
    log = Path(os.environ.get("MSTAR_BENCH_LOG_DIR", workdir)) / "orpheus_tritonserver.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    progress = LogEcho(log, prefix="[bench_orpheus] ")  # the captures' progress
    proc = start_triton(repo, dep, ports, log)
    wait_ready(ports.triton_ready_url, proc, 1800, "tritonserver", progress=progress)
    return proc, ports.grpc_url, entry_model(dep), dep


# ---- the baseline: HF generate + the reference's SNAC window decoding ----------------------------------------


def bench_baseline(checkpoint: Path, concurrency: int, tokens: int, device: str) -> Result:
    import torch
    from snac import SNAC
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    from mstar_common.families.orpheus.tokens import TokenLayout

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype).to(device).eval()
    snac = SNAC.from_pretrained(str(checkpoint / "snac")).to(device).eval()
    layout = TokenLayout.from_tokenizer(tokenizer, model.config.vocab_size)
    prompt = torch.tensor([layout.prompt_ids(tokenizer, TEXT, "tara")] * concurrency, device=device)

    class Decoder(BaseStreamer):
        """The reference's tokens_decoder per row: a window of the last 28 codes every 7th code past 27."""

        def __init__(self) -> None:
            self.codes = [[] for _ in range(concurrency)]
            self.is_prompt = True

        def put(self, value):
            if self.is_prompt:
                self.is_prompt = False
                return
            ready = []
            for row, token in enumerate(value.reshape(-1).tolist()):
                index = token - layout.audio_start
                if 0 <= index < 7 * 4096:
                    self.codes[row].append(index % 4096)
                    if len(self.codes[row]) % 7 == 0 and len(self.codes[row]) > 27:
                        ready.append(row)
            if ready:
                w = torch.tensor([self.codes[r][-28:] for r in ready], device=device).reshape(-1, 4, 7)
                levels = [w[:, :, list(p)].reshape(len(ready), -1) for p in ((0,), (1, 4), (2, 3, 5, 6))]
                with torch.inference_mode():
                    snac.decode(levels)[:, 0, 2048:4096].float().cpu()
                now = time.perf_counter()
                for r in ready:
                    logs[r].arrivals.append((now - start, SAMPLES_PER_FRAME))

        def end(self):
            pass

    def restrict(_ids, scores):
        scores[:, :layout.custom_start] = float("-inf")
        return scores

    with torch.inference_mode():  # warm-up (kernels, allocator) outside the timing
        model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=layout.eot)
    start = time.perf_counter()
    logs = [StreamLog(start) for _ in range(concurrency)]
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, temperature=0.6,
                       top_p=0.8, repetition_penalty=1.3, logits_processor=[restrict], streamer=Decoder(),
                       pad_token_id=layout.eot)
    return summarize("hf-generate+snac", logs, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--client-worker"]:
        return _client_worker(argv[1])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "orpheus_3b_gpu.yaml")
    parser.add_argument("--checkpoint", default="builtin:orpheus-3b-random",
                        help="deployment checkpoint (builtin:... or a dir); the baseline loads the same")
    parser.add_argument("--triton-url", help="use a server already running this deployment (skip starting one)")
    parser.add_argument("--model", default="orpheus_lm", help="the Triton entry model (with --triton-url)")
    parser.add_argument("--tokens", type=int, default=1200)
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--baseline-concurrency", default="1,16,64", help="empty: skip the baseline")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up streams before measuring")
    parser.add_argument("--codec-in-process", action="store_true", help="SNAC inside the LM component (no BLS hop)")
    parser.add_argument("--kv-dtype", help="override resources.kv_cache.dtype (auto | fp8_e4m3)")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="serve with the prefix cache on (every stream has the same prompt; off by default)")
    parser.add_argument("--first-chunk-frames", type=lambda v: v if v == "auto" else int(v),
                        help="override model_kwargs.first_chunk_frames (frames in each stream's first response, "
                             "or auto)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a model_kwargs entry (YAML value), e.g. --set codec_dtype=bfloat16")
    parser.add_argument("--streams-per-proc", type=int, default=32, help="client streams per load process")
    parser.add_argument("--stagger-ms", type=float, default=0.0,
                        help="send each load process's streams this much after the previous process's (arrivals in "
                             "waves instead of all at once)")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke: tiny config, 70 tokens, c=1,2")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_orpheus.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.tokens, args.warmup = ROOT / "configs" / "orpheus.yaml", 70, 1
        args.concurrency, args.baseline_concurrency = "1,2", "1"
        if args.checkpoint.startswith("builtin:orpheus-3b"):
            args.checkpoint = "builtin:orpheus-tiny"
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    baseline = [int(c) for c in args.baseline_concurrency.split(",") if c]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.families.registry import get_family
    from mstar_common.launcher import stop_process

    checkpoint = resolve_checkpoint(args.checkpoint, get_family("orpheus").builtin_checkpoints)
    results: list[Result] = []
    proc, url, model = None, args.triton_url, args.model
    with tempfile.TemporaryDirectory(prefix="bench-orpheus-") as workdir:
        try:
            if not concurrencies:  # baseline only (e.g. under another Python environment)
                pass
            elif url is None:
                proc, url, model, _ = start_server(args.config, args.checkpoint, max(concurrencies), Path(workdir),
                                                   args.codec_in_process, args.kv_dtype, args.first_chunk_frames,
                                                   _overrides(args.set), args.prefix_caching)
            if concurrencies:
                warm = bench_served(url, model, args.warmup, min(args.tokens, 140), timeout_s=60)
                print("warm-up:", _brief(warm), flush=True)
                if warm.errors:
                    raise RuntimeError(f"{warm.errors} of {args.warmup} warm-up streams failed (see the server log)")
            for c in concurrencies:
                results.append(bench_served(url, model, c, args.tokens, streams_per_proc=args.streams_per_proc,
                                            stagger_s=args.stagger_ms / 1e3))
                print(_brief(results[-1]), flush=True)
        finally:
            stop_process(proc)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for c in baseline:
        results.append(bench_baseline(checkpoint, c, args.tokens, device))
        print(_brief(results[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"tokens": args.tokens, "config": str(args.config), "checkpoint": args.checkpoint, "device": device,
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "date": time.strftime("%Y-%m-%d")}
    args.out.write_text(json_text({"meta": meta, "results": [asdict(r) for r in results]}, indent=2))
    _print_table(results)
    return 0


def _brief(result: Result) -> str:
    """One JSON line without the per-stream records (those go to --out only)."""
    return json_text({k: v for k, v in asdict(result).items() if k != "streams"})


def _print_table(results: list[Result]) -> None:
    print(f"{'system':18} {'c':>4} {'first p50 ms':>12} {'real-time':>9} {'audio-s/s':>9} {'RTF p50':>8} {'err':>4}"
          f" {'stall p50/p90 ms':>16} {'1st stall s':>11} {'stalled rank':>12} {'send spread ms':>14}")
    for r in results:
        real_time = f"{r.streams_real_time}/{r.concurrency}"
        first_stall = "-" if r.first_stall_p50_s is None else f"{r.first_stall_p50_s:.2f}"
        rank = "-" if r.stalled_start_rank_p50 is None else f"{r.stalled_start_rank_p50:.2f}"
        print(f"{r.system:18} {r.concurrency:>4} {r.first_audio_p50_ms:>12.1f} {real_time:>9} {r.audio_s_per_s:>9.2f}"
              f" {r.rtf_p50:>8.3f} {r.errors:>4} {r.stall_p50_ms:>7.1f}/{r.stall_p90_ms:<8.1f} {first_stall:>11}"
              f" {rank:>12} {'-' if r.send_spread_ms is None else r.send_spread_ms:>14}")


if __name__ == "__main__":
    sys.exit(main())
