#!/usr/bin/env python
"""Whisper serving benchmark: decoder ITL at c=1 and RTFx for 30 s clips at c=1/16/64, against transformers'
ASR pipeline in the same run.

On the H200 (after `source .device/prepare.sh`):
    python scripts/bench_whisper.py             # configs/whisper_large_v3_gpu.yaml, builtin:whisper-large-v3-random
CPU smoke (CI): python scripts/bench_whisper.py --smoke [--triton-url HOST:PORT --checkpoint DIR]

Large-v3 shapes with random weights (128 mel bins, 32 + 32 layers, vocab 51,866; built on first use). Random
weights almost never emit <|endoftext|>, so every window decodes `--tokens` text tokens (the walk's and the
pipeline's caps): the work a real transcript of that length costs. Inputs are 30 s synthetic clips, language
forced to English on both sides (no detection step).

  decoder ITL   the decoder component alone (tritonclient stream to `whisper_decoder` with a precomputed encoder
                output): (last token time - first token time) / (tokens - 1), p50 over `--itl-runs` requests.
  RTFx          closed batches of c uploads (WAV bytes to the entry model `whisper_walk`, gRPC streams started
                together): audio seconds / wall seconds. The baseline runs transformers'
                `pipeline("automatic-speech-recognition")` over the same c clips with batch_size=c, bf16 on
                the GPU, after the server has stopped (the GPU is not shared).
Results go to --out as JSON and to stdout.
"""

from __future__ import annotations

import argparse
import io
import os
import queue
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mstar_common.bench.pa_files import whisper_clip as clip  # noqa: E402 - the perf_analyzer file's clips too
from mstar_common.bench.report import json_text  # noqa: E402

SR = 16_000


@dataclass
class Result:
    system: str
    metric: str  # "itl" | "rtfx"
    concurrency: int
    value: float  # ms (itl p50) or x real time (rtfx)
    wall_s: float
    audio_s: float
    tokens: int  # text tokens decoded (all requests)
    errors: int


def wav(pcm: np.ndarray) -> bytes:
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, pcm, SR, format="WAV", subtype="PCM_16")
    return out.getvalue()


# ---- the served system ------------------------------------------------------------------------------------------


def _inputs(values: dict[str, tuple[np.ndarray, str]]):
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, (arr, dtype) in values.items():
        tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
        tensor.set_data_from_numpy(arr)
        inputs.append(tensor)
    return inputs


def _stream(url: str, model: str, values: dict, on_result) -> str | None:
    """One request on its own gRPC stream; `on_result(time, result)` per response; returns an error or None."""
    from mstar_common.bench.drivers import triton_grpc_client

    results: queue.Queue = queue.Queue()
    client = triton_grpc_client(url)
    client.start_stream(callback=lambda result, error: results.put((time.perf_counter(), result, error)))
    try:
        client.async_stream_infer(model, _inputs(values), enable_empty_final_response=True)
        while True:
            now, result, error = results.get(timeout=900)
            if error is not None:
                return str(error)
            on_result(now, result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return None
    finally:
        client.stop_stream()
        client.close()


def encoder_output(url: str, family: str, pcm: np.ndarray) -> np.ndarray:
    out: list[np.ndarray] = []

    def keep(_, result):
        if result.as_numpy("encoder_output") is not None:
            out.append(result.as_numpy("encoder_output"))

    error = _stream(url, f"{family}_encoder", {"audio_pcm": (pcm, "FP32")}, keep)
    if error:
        raise RuntimeError(f"encoder: {error}")
    return out[0]


def bench_itl(url: str, source: np.ndarray, prompt: list[int], tokens: int, runs: int) -> Result:
    itls, total, errors = [], 0, 0
    start = time.perf_counter()
    for _ in range(runs):
        arrivals: list[tuple[float, int]] = []

        def note(now, result, arrivals=arrivals):
            ids = result.as_numpy("token_ids")
            if ids is not None and ids.size:
                arrivals.append((now, int(ids.size)))

        values = {"encoder_output": (source, "FP32"), "input_ids": (np.asarray(prompt, np.int32), "INT32"),
                  "max_tokens": (np.array([tokens], np.int32), "INT32")}
        if _stream(url, "whisper_decoder", values, note) or len(arrivals) < 2:
            errors += 1
            continue
        count = sum(n for _, n in arrivals)
        total += count
        itls.append((arrivals[-1][0] - arrivals[0][0]) / (count - arrivals[0][1]) * 1e3)
    return Result("mstar-triton", "itl", 1, round(float(np.median(itls)) if itls else float("nan"), 3),
                  round(time.perf_counter() - start, 3), 0.0, total, errors)


def bench_rtfx(url: str, model: str, uploads: list[bytes], seconds: float, tokens: int) -> Result:
    counts = [0] * len(uploads)
    errors: list[str | None] = [None] * len(uploads)

    def run(i: int) -> None:
        def note(_, result):
            done = result.as_numpy("completion_tokens")
            if done is not None and done.size:
                counts[i] = int(done[0])

        values = {"audio": (np.array([uploads[i]], dtype=np.object_), "BYTES"),
                  "language": (np.array([b"en"], dtype=np.object_), "BYTES"),
                  "max_tokens": (np.array([tokens], np.int32), "INT32")}
        errors[i] = _stream(url, model, values, note)

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(uploads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = [i for i, e in enumerate(errors) if e is None]
    audio = seconds * len(ok)
    return Result("mstar-triton", "rtfx", len(uploads), round(audio / wall, 2), round(wall, 3), audio,
                  sum(counts[i] for i in ok), len(uploads) - len(ok))


def start_server(config: Path, checkpoint: str | None, max_concurrency: int, workdir: Path):
    from mstar_common.config import deployment_from_dict
    from mstar_common.launcher import LogEcho, Ports, start_triton, wait_ready
    from mstar_common.repository import entry_model, write_repository

    raw = yaml.safe_load(config.read_text())
    if checkpoint:
        raw["checkpoint"] = checkpoint
    dep = deployment_from_dict(raw, source=config.name)
    if dep.max_concurrent_requests < max_concurrency:
        print(f"note: {config.name} runs {dep.max_concurrent_requests} decoder windows at once; c={max_concurrency} "
              "queues the rest", file=sys.stderr)
    repo = write_repository(dep, workdir / "model_repository", config.name)
    ports = Ports.free(proxy=False)
    progress = LogEcho(workdir / "tritonserver.log", prefix="[bench_whisper] ")  # the captures' progress
    proc = start_triton(repo, dep, ports, workdir / "tritonserver.log")
    wait_ready(ports.triton_ready_url, proc, 1800, "tritonserver", progress=progress)
    return proc, ports.grpc_url, entry_model(dep)


# ---- the baseline: transformers' ASR pipeline -------------------------------------------------------------------


def bench_pipeline(checkpoint: Path, clips: list[np.ndarray], seconds: float, tokens: int, device: str) -> Result:
    import torch
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration, pipeline

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = WhisperForConditionalGeneration.from_pretrained(str(checkpoint), dtype=dtype).to(device).eval()
    asr = pipeline("automatic-speech-recognition", model=model, tokenizer=AutoTokenizer.from_pretrained(checkpoint),
                   feature_extractor=WhisperFeatureExtractor.from_pretrained(checkpoint), device=device, dtype=dtype)
    if asr.tokenizer.pad_token_id is None:  # batching pads the labels; Whisper pads with <|endoftext|>
        asr.tokenizer.pad_token_id = model.config.eos_token_id
    kwargs = {"language": "en", "task": "transcribe", "max_new_tokens": tokens}
    inputs = list(clips)  # numpy arrays at the feature extractor's 16 kHz (the pipeline pops dict inputs' keys)
    asr(inputs[:1], batch_size=1, generate_kwargs={**kwargs, "max_new_tokens": 4})  # warm-up
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = asr(inputs, batch_size=len(inputs), generate_kwargs=kwargs)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    audio = seconds * len(clips)
    num_tokens = sum(len(asr.tokenizer.encode(o["text"], add_special_tokens=False)) for o in out)
    return Result("hf-pipeline", "rtfx", len(clips), round(audio / wall, 2), round(wall, 3), audio, num_tokens, 0)


# ---- main -------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "whisper_large_v3_gpu.yaml")
    parser.add_argument("--checkpoint", default="builtin:whisper-large-v3-random",
                        help="deployment checkpoint (builtin:... or a dir); the baseline loads the same")
    parser.add_argument("--triton-url", help="use a server already running this deployment (skip starting one)")
    parser.add_argument("--model", default="whisper_walk", help="the Triton entry model (with --triton-url)")
    parser.add_argument("--seconds", type=float, default=30.0, help="clip length")
    parser.add_argument("--tokens", type=int, default=128, help="text tokens per 30 s window")
    parser.add_argument("--itl-runs", type=int, default=5)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--baseline-concurrency", default="1,16,64", help="empty: skip the baseline")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke: tiny config, 5 s clips, 12 tokens, c=1,2")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_whisper.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.seconds, args.tokens, args.itl_runs = ROOT / "configs" / "whisper.yaml", 5.0, 12, 2
        args.concurrency, args.baseline_concurrency = "1,2", "1"
        if args.checkpoint.startswith("builtin:whisper-large"):
            args.checkpoint = "builtin:whisper-tiny-random"
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    baseline = [int(c) for c in args.baseline_concurrency.split(",") if c]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.families.registry import get_family
    from mstar_common.families.whisper.family import read_tokens
    from mstar_common.launcher import stop_process

    checkpoint = resolve_checkpoint(args.checkpoint, get_family("whisper").builtin_checkpoints)
    tokens = read_tokens(checkpoint)
    prompt = [tokens.sot, tokens.lang_to_id["en"], tokens.task_to_id["transcribe"], tokens.no_timestamps]
    clips = [clip(i, args.seconds) for i in range(max(concurrencies + baseline))]
    uploads = [wav(c) for c in clips]
    results: list[Result] = []
    proc, url, model = None, args.triton_url, args.model
    with tempfile.TemporaryDirectory(prefix="bench-whisper-") as workdir:
        try:
            if concurrencies and url is None:
                proc, url, model = start_server(args.config, args.checkpoint, max(concurrencies), Path(workdir))
            if concurrencies:  # empty: the baseline only (e.g. under another Python environment)
                bench_rtfx(url, model, uploads[:2], args.seconds, min(args.tokens, 8))  # warm-up
            if concurrencies and args.itl_runs:
                source = encoder_output(url, "whisper", clips[0])
                results.append(bench_itl(url, source, prompt, args.tokens, args.itl_runs))
                print(json_text(asdict(results[-1])), flush=True)
            for c in concurrencies:
                results.append(bench_rtfx(url, model, uploads[:c], args.seconds, args.tokens))
                print(json_text(asdict(results[-1])), flush=True)
        finally:
            stop_process(proc)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for c in baseline:
        results.append(bench_pipeline(checkpoint, clips[:c], args.seconds, args.tokens, device))
        print(json_text(asdict(results[-1])), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"seconds": args.seconds, "tokens": args.tokens, "config": str(args.config), "checkpoint": args.checkpoint,
            "device": device, "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
            "date": time.strftime("%Y-%m-%d")}
    args.out.write_text(json_text({"meta": meta, "results": [asdict(r) for r in results]}, indent=2))
    _print_table(results)
    return 0


def _print_table(results: list[Result]) -> None:
    print(f"{'system':14} {'metric':>6} {'c':>4} {'value':>10} {'wall s':>8} {'tokens':>7} {'err':>4}")
    for r in results:
        unit = "ms" if r.metric == "itl" else "x"
        print(f"{r.system:14} {r.metric:>6} {r.concurrency:>4} {r.value:>8.2f}{unit:>2} {r.wall_s:>8.2f} {r.tokens:>7}"
              f" {r.errors:>4}")


if __name__ == "__main__":
    sys.exit(main())
