r"""Serving benchmark (`mstar bench`, or `scripts/bench.py` in a checkout): closed-loop and Poisson workloads
against Triton and the OpenAI proxy, with the HF `generate` baseline and the weight-streaming floor measured in
the same run.

  # start a server for a checkpoint, run the sweep, write one model's JSON
  mstar bench serve --family qwen3 --checkpoint /tmp/qwen3-0.6b --name qwen3-0.6b --out runs/qwen3.json \
      --concurrency 1 8 64 --rates 4 16 --proxy-concurrency 1 16 --hf-baseline --floor
  # against a server that is already up
  mstar bench url --grpc 127.0.0.1:8001 --model qwen3_llm --concurrency 1 8 --out runs/x.json
  # merge model JSONs into results.json, results.md and one PNG per model
  mstar bench report runs/qwen3.json runs/llama.json --out runs/report
  # write the same workloads as perf_analyzer input-data files
  mstar bench perf-analyzer-data --out perf_analyzer_configs/qwen3
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import random
import re
import shlex
import subprocess
import sys
import time
import zlib
from pathlib import Path

from mstar_common import wire
from mstar_common.bench import gpu_memory
from mstar_common.bench.drivers import OpenAIDriver, TritonDriver, open_url, triton_grpc_client
from mstar_common.bench.metrics import Slo, summarize
from mstar_common.bench.report import comparisons, json_text, markdown, write_report
from mstar_common.bench.workload import Workload, perf_analyzer_data, requests_from_file
from mstar_common.config import DeploymentError, Resources

logger = logging.getLogger("bench")


def deployment(args) -> dict:
    captured = args.device == "gpu" and not args.no_graphs
    return {
        "name": args.name, "family": args.family, "checkpoint": str(args.checkpoint),
        "components": {"llm": {
            "placement": {"device": args.device, **({"gpus": [0]} if args.device == "gpu" else {}),
                          "instances": args.instances},
            "cuda_graphs": captured,
            "attention_backend": args.attention_backend, "fused_ops": not args.no_fused_ops,
            "capture_sampling": not args.no_capture_sampling,
            # the captured graphs' sizes: none without graphs
            **({"decode_buckets": args.decode_buckets} if args.decode_buckets and captured else {}),
            **({"prefill_token_buckets": args.token_buckets} if args.token_buckets and captured else {}),
        }},
        "resources": {"kv_cache": {"num_pages": args.num_pages, "page_size": args.page_size, "dtype": args.kv_dtype,
                                   "prefix_caching": args.prefix_caching},
                      "max_model_len": args.max_model_len, "max_batch_tokens": args.max_batch_tokens},
        "max_concurrent_requests": args.max_concurrent,
        "admission": {"queue_timeout_s": None, "request_timeout_s": None},
        # the workload's knobs alone: a knob it leaves unset (repetition_penalty, min_p) would otherwise take the
        # checkpoint's generation_config.json value, which neither the report nor --check-eager's engine applies
        "model_kwargs": {"dtype": args.dtype, "default_max_tokens": args.output_len, "generation_config": "ignore"},
        "server": {"shm_default_byte_size": 64 * 2**20, "stub_timeout_seconds": 900,
                   "proxy_workers": args.proxy_workers},
    }


BENCH_FOLDERS_KEPT = 10  # the newest scratch folders of stopped benchmark servers kept, for their logs


class Server:
    """tritonserver (+ the proxy) for one deployment on free ports, in a temporary directory."""

    def __init__(self, raw: dict, with_proxy: bool) -> None:
        from mstar_common import run_folders
        from mstar_common.config import deployment_from_dict
        from mstar_common.launcher import Ports
        from mstar_common.repository import entry_model

        self.dep = deployment_from_dict(raw, source="bench-deployment")
        self.entry = entry_model(self.dep)
        self.with_proxy = with_proxy
        self.ports = Ports.free()
        self.root = run_folders.make("mstar-bench-", BENCH_FOLDERS_KEPT)
        self.triton = self.proxy = None

    def __enter__(self) -> Server:
        from mstar_common.launcher import LogEcho, start_proxy, start_triton, wait_ready
        from mstar_common.repository import write_repository

        repo = write_repository(self.dep, self.root / "model_repository", "bench-deployment")
        started = time.perf_counter()
        progress = LogEcho(self.root / "tritonserver.log", prefix="[bench] ")
        self.triton = start_triton(repo, self.dep, self.ports, self.root / "tritonserver.log")
        try:
            wait_ready(self.ports.triton_ready_url, self.triton, 1200, "tritonserver", progress=progress)
            self.startup_s = time.perf_counter() - started
            if self.with_proxy:
                self.proxy = start_proxy(self.dep, self.entry, self.ports, self.root / "proxy.log")
                wait_ready(self.ports.proxy_health_url, self.proxy, 120, "proxy")
        except Exception:
            for log in (self.root / "tritonserver.log", self.root / "proxy.log"):
                if log.is_file():
                    tail = log.read_text(errors="replace").splitlines()[-40:]
                    print(f"----- {log.name} (last {len(tail)} lines) -----", *tail, sep="\n", file=sys.stderr)
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        from mstar_common.launcher import stop_process

        stop_process(self.proxy)
        stop_process(self.triton)
        for log in (self.root / "tritonserver.log", self.root / "proxy.log"):
            if log.is_file() and os.environ.get("MSTAR_BENCH_LOG_DIR"):
                name = re.sub(r"[^A-Za-z0-9_.-]", "_", self.dep.name)  # an org/name id is one file, not a folder
                target = Path(os.environ["MSTAR_BENCH_LOG_DIR"]) / f"{log.stem}-{name}.log"
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(log.read_bytes()[-2_000_000:])



ENGINE_METRICS = ("mstar_prefix_cache_queried_tokens_total", "mstar_prefix_cache_hit_tokens_total",
                  "mstar_kv_pages_cached")


def _metrics_text(url: str, what: str) -> str | None:
    """Triton's metrics page, or None (reported) if the endpoint cannot be read: a finished sweep is never lost
    to it."""
    try:
        with open_url(url, timeout=10) as response:
            return response.read().decode()
    except OSError as exc:
        print(f"[bench] metrics endpoint unreadable ({exc}); no {what} recorded", flush=True)
        return None


def _series_total(text: str, name: str) -> float:
    """A series summed over its label sets (0 if absent)."""
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def engine_metrics(url: str) -> dict[str, float]:
    """The engine's prefix-cache counters from Triton's metrics page (`url`), summed over instances (0 if absent;
    {} if the page cannot be read)."""
    text = _metrics_text(url, "engine counters")
    return {} if text is None else {name: _series_total(text, name) for name in ENGINE_METRICS}


# the components' latency histograms (backends/metrics.py): request arrival at the component -> first output sent,
# and the gap between a stream's outputs per token
SERVER_LATENCY = {"ttft": "mstar_time_to_first_token_seconds", "itl": "mstar_inter_token_latency_seconds"}
EXPORT_WAIT_S = 2.0  # the components export their samples every 0.1 s: how long a level's may take to show


def latency_totals(text: str) -> dict[str, tuple[float, float]]:
    """(seconds, samples) of each `SERVER_LATENCY` histogram on a metrics page, summed over its label sets."""
    return {key: (_series_total(text, f"{name}_sum"), _series_total(text, f"{name}_count"))
            for key, name in SERVER_LATENCY.items()}


def server_latency(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict:
    """Each histogram's mean (ms) and sample count over what was observed between two `latency_totals`."""
    out = {}
    for key in SERVER_LATENCY:
        seconds, count = (a - b for a, b in zip(after[key], before[key], strict=True))
        out[f"{key}_ms_mean"] = seconds / count * 1e3 if count > 0 else None
        out[f"{key}_samples"] = int(count)
    return out


# the engines' step counters (backends/metrics.py), summed over components and instances
SERVER_STEPS = {"steps": "mstar_engine_steps_total", "graph_steps": "mstar_graph_steps_total",
                "rows": "mstar_engine_rows_stepped_total", "tokens": "mstar_engine_tokens_stepped_total",
                "padding": "mstar_graph_padding_tokens_total"}


def step_totals(text: str) -> dict[str, float]:
    """Each `SERVER_STEPS` counter on a metrics page, summed over its label sets (0 if absent)."""
    return {key: _series_total(text, name) for key, name in SERVER_STEPS.items()}


def server_steps(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """The steps the engines ran between two `step_totals`: how many, the share replayed from captured graphs,
    rows and packed tokens a step, and the share of the token slots the steps computed that was a graph's padding
    up to its bucket. None where no engine stepped."""
    delta = {key: after[key] - before[key] for key in SERVER_STEPS}
    steps = delta["steps"]
    if steps <= 0:
        return None
    computed = delta["tokens"] + delta["padding"]
    return {"steps": int(steps), "tokens": int(delta["tokens"]), "padding_tokens": int(delta["padding"]),
            "graph_share": round(delta["graph_steps"] / steps, 4),
            "rows_per_step": round(delta["rows"] / steps, 2), "tokens_per_step": round(delta["tokens"] / steps, 2),
            "padding_share": round(delta["padding"] / computed, 4) if computed > 0 else None}


# each component instance's count of finished metric samples (backends/metrics.py): a read's figures hold everything
# recorded before an earlier read once every instance's count is 2 past that read's
SAMPLES_SERIES = "mstar_metrics_samples_total"


def sample_counts(text: str) -> dict[str, float]:
    """Each instance's `SAMPLES_SERIES` count on a metrics page, by its label set (empty on a server without it)."""
    return {labels: float(v) for labels, v in re.findall(rf"^{SAMPLES_SERIES}{{([^}}]*)}} (\S+)$", text, re.M)}


def sampled_since(earlier: dict[str, float], later: dict[str, float]) -> bool:
    """Whether every instance of the `earlier` read has since finished a sample it began after that read: its count
    2 past (the next one may have been under way at the read; one not sampling blocks it)."""
    return all(later.get(labels, 0.0) >= count + 2 for labels, count in earlier.items())


def page_after_a_sample(read, timeout_s: float) -> str:
    """The metrics page `read()` returns, read once every component instance has finished a metrics sample begun
    after this call (so it holds everything recorded before it), or the last one read after `timeout_s`."""
    first, deadline = sample_counts(read()), time.monotonic() + timeout_s
    while not sampled_since(first, sample_counts(text := read())) and time.monotonic() < deadline:
        time.sleep(0.02)
    return text


class ServerLatency:
    """Brackets a level with two reads of the components' latency histograms, so the run records what the
    server itself saw (component arrival -> first token sent, and its inter-token gaps) beside what the client
    saw; the difference in TTFT is the path through Triton (and the proxy) and the network."""

    def __init__(self, url: str | None):
        self.url = url
        self._before = None

    def _totals(self) -> tuple[dict, dict, dict] | None:
        """(latency totals, step totals, sample counts) read now; None without a readable metrics page."""
        text = _metrics_text(self.url, "server-side latency") if self.url is not None else None
        return None if text is None else (latency_totals(text), step_totals(text), sample_counts(text))

    def start(self) -> None:
        """Read the histograms once the samples of what ran before (the warm-up) have been exported: every
        instance has finished a metrics sample begun after this call (`sampled_since`), and two reads an export
        period apart agree. Reads that merely agreed let a sample the sampler had not yet taken (a period stretched
        past the reads' gap on a loaded box) land in the level."""
        first = self._before = self._totals()
        deadline = time.monotonic() + EXPORT_WAIT_S
        while self._before is not None and time.monotonic() < deadline:
            time.sleep(0.15)
            again = self._totals()
            settled = again is not None and again[:2] == self._before[:2] and sampled_since(first[2], again[2])
            self._before = again
            if settled:
                break

    def stop(self, first_tokens: int) -> dict | None:
        """The level's server-side figures, once the components have exported `first_tokens` TTFT samples, every
        instance has finished a metrics sample begun after this call, and the step counters and latency totals read
        the same twice an export period apart (the ITL samples of a level's last steps were still being exported),
        or after `EXPORT_WAIT_S`: the latency means, and under `steps` what the engines' steps were
        (`server_steps`); None without a metrics endpoint."""
        if self._before is None:
            return None
        deadline = time.monotonic() + EXPORT_WAIT_S
        first = previous = None
        while True:
            after = self._totals()
            if after is None:
                return None
            first = first or after
            latency = server_latency(self._before[0], after[0])
            # the latency totals too: the components export a period's samples after its counters (ITL's lagged)
            settled = previous is not None and after[:2] == previous[:2] and sampled_since(first[2], after[2])
            if (latency["ttft_samples"] >= first_tokens and settled) or time.monotonic() > deadline:
                steps = server_steps(self._before[1], after[1])
                return latency if steps is None else {**latency, "steps": steps}
            previous = after
            time.sleep(0.15)


TAG_WORDS = (" the", " a", " of", " and", " to", " in", " is", " it")  # one token each, here and in real BPEs
TAG_LEN = 8  # words that open each proxy prompt: 8**8 different starts


def prompt_text_for(checkpoint: Path | None):
    """Text prompts for the proxy arm, as long in tokens as the request's ids and as different from each other:
    `TAG_LEN` words picked by the ids' checksum, then " the" to the length. A prompt's first page thus differs
    wherever its ids differ, so a server with the prefix cache on computes every prompt, as the Triton arm's
    random ids make it. The tokens the tokenizer frames a text with (a Llama's BOS) are counted, as the component
    encodes `text_input`; with a checkpoint each prompt's length is checked."""
    tokenizer, num_framing = None, 0
    if checkpoint is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
        num_framing = len(tokenizer.encode("", add_special_tokens=True))

    def text(input_ids: list[int]) -> str:
        num_words = len(input_ids) - num_framing
        rng = random.Random(zlib.crc32(",".join(map(str, input_ids)).encode()))
        tag = "".join(rng.choice(TAG_WORDS) for _ in range(min(TAG_LEN, num_words)))
        prompt = tag + " the" * (num_words - min(TAG_LEN, num_words))
        if tokenizer is not None:
            assert len(tokenizer.encode(prompt, add_special_tokens=True)) == len(input_ids)
        return prompt

    return text


def sweep(args, grpc_url: str, entry: str, proxy_url: str | None, checkpoint: Path | None,
          metrics: str | None = None, on_run=None, prefix_cache: bool | None = None) -> list[dict]:
    """Every level of the run, each with its client-side summary and, where Triton's `metrics` page (URL) is
    given, the server-side latency the components recorded over it (`server`). `on_run(runs)` is called after
    each level with the levels so far (the serve command writes its results file there, so a run cut short by a
    time limit keeps the levels it measured). `prefix_cache`: whether the server's prefix cache is on (None: not
    known); with it on (or not known), a level that resends a prompt of an --input-data file that wrapped round
    records how many (`repeated_prompts`) and says so, since those prefills are cache hits."""
    workload = workload_from_args(args)
    given = args.input_requests  # main() read --input-data
    described = _describe(args.input_data, given) if given else describe_workload(workload)
    runs = []
    issued = 0
    # the file's prompts each target has sent so far (warm-ups included): the proxy sends a prompt as text, which
    # tokenizes otherwise than the ids Triton was sent, so only its own earlier prompts are cache hits for it
    sent: dict[str, set[tuple[int, ...]]] = {}
    repeats = 0  # of the last batch, prompts its target sent before

    def requests(count: int, target: str) -> list[dict]:  # new prompts for every level (none repeats in a run)
        nonlocal issued, repeats
        issued += count
        if given is not None:  # the file's requests in order, from where the last level stopped, wrapping round
            batch = [dict(given[(issued - count + i) % len(given)]) for i in range(count)]
            prompts, seen = [tuple(req["input_ids"]) for req in batch], sent.setdefault(target, set())
            repeats = sum(1 for i, p in enumerate(prompts) if p in seen or p in prompts[:i])
            seen.update(prompts)
            return batch
        return workload.requests(count, first=issued - count)

    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms) if args.slo_ttft_ms or args.slo_tpot_ms else None

    server = ServerLatency(metrics)

    def record(target: str, records, **load) -> None:
        summary = summarize(records, slo)
        run = {"target": target, **load, "workload": described, "summary": summary}
        if target == "triton":
            run["outputs"] = args.triton_outputs  # what its client asked for (--triton-outputs)
        if repeats and prefix_cache is not False:
            run["repeated_prompts"] = repeats
            print(f"[bench] warning: {target} {load}: {repeats} of {len(records)} prompts were sent before in this "
                  f"run (--input-data holds {len(given)} requests and wrapped round), and the server's prefix cache "
                  f"is {'on' if prefix_cache else 'perhaps on (its deployment could not be read)'}: their "
                  f"prefills were served from it, so TTFT and tok/s are not full prefills. Serve with "
                  f"resources.kv_cache.prefix_caching: false, or write more prompts (`mstar bench "
                  f"perf-analyzer-data --num-prompts`)", flush=True)
        latency = server.stop(sum(r.ttft is not None for r in records))
        if latency is not None:
            run["server"] = latency
        runs.append(run)
        if on_run is not None:
            on_run(runs)
        s = summary
        failed = [r.error for r in records if r.error]
        if failed and len(failed) == len(records):
            run["all_failed"] = True  # cmd_url / cmd_serve exit 1
            print(f"[bench] {target:6s} {load}: every request failed; the first error: {failed[0]}", flush=True)
        print(f"[bench] {target:6s} {load}: {s['num_requests']} req, {s['output_tok_per_s']:,.0f} tok/s, "
              f"TTFT p50 {_ms(s['ttft_ms']['p50'])} ms, ITL p50/p99 {_ms(s['itl_ms']['p50'])}/"
              f"{_ms(s['itl_ms']['p99'])} ms, errors {s['num_errors']}"
              + (f", SLO met {s['slo']['met']}/{s['num_requests']} (goodput {s['slo']['goodput_req_per_s']:.2f} req/s)"
                 if slo else "")
              + (f"; server TTFT mean {_ms(latency['ttft_ms_mean'])} ms (client {_ms(s['ttft_ms']['mean'])})"
                 if latency is not None else ""), flush=True)

    def measured(driver, batch: list[dict], **load):
        server.start()
        return driver.run(batch, **load)

    def levels(target: str, driver, concurrencies: list[int], rates: list[float]) -> None:
        if args.warmup:  # warm-up, not recorded (the proxy's: its channel)
            driver.run(requests(args.warmup, target), concurrency=args.warmup)
        for conc in concurrencies:
            count = max(args.min_requests, args.requests_per_level * conc)
            record(target, measured(driver, requests(count, target), concurrency=conc), concurrency=conc)
        for rate in rates:
            count = max(args.min_requests, int(rate * args.poisson_seconds))
            record(target, measured(driver, requests(count, target), rate=rate), rate=rate)

    outputs = [wire.TOKEN_IDS] if args.triton_outputs == "token_ids" else None
    levels("triton", TritonDriver(grpc_url, entry, outputs=outputs, processes=args.triton_client_processes),
           args.concurrency, args.rates)
    if proxy_url is not None:
        openai = OpenAIDriver(proxy_url, args.name, prompt_text_for(checkpoint), processes=args.client_processes)
        levels("openai", openai, args.proxy_concurrency, args.proxy_rates)
    return runs


def workload_from_args(args) -> Workload:
    """The generated workload the length, sampling and prefix flags describe."""
    return Workload("fixed", args.prompt_len, args.output_len, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k,
                    shared_prefix_len=args.shared_prefix_len, prompt_len_max=args.prompt_len_max,
                    output_len_max=args.output_len_max, ignore_eos=not args.no_ignore_eos)


def describe_workload(workload: Workload) -> dict:
    """A generated workload's record (the results file's `workload`, which the report's Workload line reads)."""
    return {key: getattr(workload, key) for key in ("prompt_len", "prompt_len_max", "output_len", "output_len_max",
                                                    "ignore_eos", "temperature", "top_p", "top_k",
                                                    "shared_prefix_len")}


def _describe(path: str, requests: list[dict]) -> dict:
    """A file workload's record: its path, the range of its lengths, and the values its entries give
    `ignore_eos` and `temperature` (None for an entry that leaves one to the server's default)."""
    prompts = [len(r["input_ids"]) for r in requests]
    outputs = [r["max_tokens"] for r in requests]
    return {"input_data": str(path), "requests": len(requests), "prompt_len": [min(prompts), max(prompts)],
            "output_len": [min(outputs), max(outputs)],
            **{knob: sorted({r.get(knob) for r in requests}, key=repr) for knob in ("ignore_eos", "temperature")},
            "stops": any(r.get(wire.STOP) or r.get(wire.STOP_TOKEN_IDS) for r in requests)}


def hf_lengths(args) -> tuple[int, int]:
    """The prompt and output lengths `--hf-baseline` runs HF generate at: an --input-data file's, where all its
    requests have one prompt length and one max_tokens (else --prompt-len and --output-len, and the report
    compares no level with HF); --hf-output-len over either."""
    prompt, output = args.prompt_len, args.output_len
    if given := getattr(args, "input_requests", None):
        prompts, outputs = {len(r["input_ids"]) for r in given}, {r["max_tokens"] for r in given}
        if len(prompts) == 1 and len(outputs) == 1:
            (prompt,), (output,) = prompts, outputs
    return prompt, args.hf_output_len or output


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def cmd_serve(args) -> int:
    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.families.registry import get_family

    try:
        # a missing checkpoint is named here, not by a server that exits; builtin:<name> is built as `mstar serve`
        # builds it, and the tokenizer, the floor and the HF baseline then read the same directory
        if problem := baseline_problem(args):
            raise DeploymentError(problem)
        args.checkpoint = resolve_checkpoint(str(args.checkpoint), get_family(args.family).builtin_checkpoints)
        return _serve(args)
    except (DeploymentError, FileNotFoundError, RuntimeError) as exc:  # bad flags or checkpoint, a dead server
        print(f"mstar bench: error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, RuntimeError) else 2


def _saver(model: dict, out: str):
    """`sweep`'s `on_run`: the results file rewritten with the levels so far (the commands write it once more at
    the end, with what follows the sweep)."""

    def save(runs: list[dict]) -> None:
        model["runs"] = runs
        Path(out).write_text(json_text(model, indent=1))

    return save


def _serve(args) -> int:
    model: dict = {"name": args.name, "family": args.family, "checkpoint": str(args.checkpoint),
                   "kv_dtype": args.kv_dtype, "attention_backend": args.attention_backend,
                   "prefix_caching": args.prefix_caching, "instances": args.instances, "code": code_revision(),
                   "switches": served_switches(os.environ), "meta": meta(None)}
    with_proxy = bool(args.proxy_concurrency or args.proxy_rates)
    memory = {"before_start": gpu_memory.used_mib()}
    with Server(deployment(args), with_proxy) as server:
        print(f"[bench] {args.name}: tritonserver ready in {server.startup_s:.0f} s", flush=True)
        model["startup_s"] = server.startup_s
        memory["after_start"] = gpu_memory.used_mib()
        model["gpu_memory_mib"] = memory
        model["deployment"] = server.dep.to_dict()  # as served, defaults filled in: the run is self-describing
        sampler = gpu_memory.PeakSampler().start()
        try:
            model["runs"] = sweep(args, server.ports.grpc_url, server.entry,
                                  server.ports.proxy_url if with_proxy else None, args.checkpoint,
                                  server.ports.metrics_url, on_run=_saver(model, args.out),
                                  prefix_cache=args.prefix_caching)
        finally:
            memory["peak"] = sampler.stop()
        line = gpu_memory.report_line(memory)
        if line:
            print(f"[bench] {args.name}: {line}", flush=True)
        model["engine_metrics"] = engine_metrics(server.ports.metrics_url)
        queried = model["engine_metrics"].get("mstar_prefix_cache_queried_tokens_total", 0)
        if args.prefix_caching and queried:
            hit = model["engine_metrics"]["mstar_prefix_cache_hit_tokens_total"]
            print(f"[bench] {args.name}: prefix cache hit {hit:,.0f} of {queried:,.0f} prompt tokens "
                  f"({hit / queried:.1%})", flush=True)
        served = served_tokens(server.ports.grpc_url, server.entry, args) if args.check_eager else None
    if served is not None:
        eager = eager_tokens(args)
        same = sum(a == b for a, b in zip(served, eager, strict=True))
        served_as = "graphs, overlap, fused kernels" if args.device == "gpu" and not args.no_graphs else "the server"
        model["checks"] = {f"served greedy tokens ({served_as}) == in-process eager engine":
                           f"{same}/{len(served)} requests identical ({args.check_len} tokens each, c=1)"}
    Path(args.out).write_text(json_text(model, indent=1))  # the sweep and the check, kept if a baseline fails
    add_baselines(model, args)
    for line in comparisons(model):
        print(f"[bench] {args.name}: {line}", flush=True)
    Path(args.out).write_text(json_text(model, indent=1))
    return _exit_status(model.get("runs", []))


def _check_requests(args) -> list[dict]:
    workload = Workload("check", args.prompt_len, args.check_len, seed=1)
    return workload.requests(args.check_eager)


def served_tokens(grpc_url: str, entry: str, args) -> list[list[int]]:
    """Greedy tokens through Triton, one request at a time (decode bucket 1: no padding)."""
    import queue

    from mstar_common.bench.drivers import _triton_inputs

    out = []
    for request in _check_requests(args):
        responses: queue.Queue = queue.Queue()
        client = triton_grpc_client(grpc_url)
        try:
            client.start_stream(callback=lambda result, error, q=responses: q.put((result, error)))
            client.async_stream_infer(entry, _triton_inputs(request), request_id="check",
                                      enable_empty_final_response=True)
            tokens: list[int] = []
            while True:
                result, error = responses.get(timeout=120)
                if error is not None:
                    raise RuntimeError(f"check request failed: {error}")
                ids = result.as_numpy("token_ids")
                tokens += ids.tolist() if ids is not None else []
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
        finally:
            # a stream left open on a failed check held the server's shutdown for its 25 s of live models
            client.stop_stream()
            client.close()
        out.append(tokens)
    return out


def eager_tokens(args) -> list[list[int]]:
    """The same requests through an in-process engine: eager steps, no overlap, same backend and kernels."""
    import torch

    from mstar_common.config import ComponentConfig
    from mstar_common.engine.ar_engine import AREngine
    from mstar_common.engine.cuda_graph import configure_fast_path
    from mstar_common.engine.types import EngineConfig, SamplingParams
    from mstar_common.families.registry import get_family

    device = "cuda" if args.device == "gpu" else "cpu"
    model, config = get_family(args.family).load_model(args.checkpoint, args.dtype, device)
    # the server's attention backend, fused ops and skinny-GEMM plan (the same cached per-GPU decisions)
    configure_fast_path(model, ComponentConfig(attention_backend=args.attention_backend,
                                               fused_ops=not args.no_fused_ops, cuda_graphs=False),
                        device, 1, args.max_batch_tokens)
    # a pool that holds one request of the longest the server takes (main() checked the requests fit it)
    num_pages = -(-args.max_model_len // args.page_size) + 1
    engine = AREngine(model, EngineConfig(num_kv_pages=num_pages, page_size=args.page_size, max_num_seqs=1,
                                          max_batch_tokens=args.max_batch_tokens, max_model_len=args.max_model_len,
                                          dtype=args.dtype, kv_dtype=args.kv_dtype, device=device),
                      eos_token_ids=[], vocab_size=int(config["vocab_size"]), overlap=False)
    out = []
    for i, request in enumerate(_check_requests(args)):
        got: list[int] = []
        params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True)
        engine.add_request(str(i), request["input_ids"], params, lambda rid, toks, fin, err, got=got: got.extend(toks))
        while engine.step():
            pass
        out.append(got)
    del engine, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


HF_DTYPES = ("bfloat16", "float16", "float32")


def baseline_problem(args) -> str | None:
    """Why --floor / --hf-baseline cannot run as asked here (said before a server starts), or None."""
    if not (args.floor or args.hf_baseline):
        return None
    if args.floor and args.device != "gpu":
        return "--floor measures a GPU's read bandwidth: it needs --device gpu"
    if args.hf_baseline and args.dtype not in HF_DTYPES:
        return f"--hf-baseline runs HF generate in {', '.join(HF_DTYPES)}, not --dtype {args.dtype!r}"
    if args.device == "gpu":
        import torch

        if not torch.cuda.is_available():
            return ("--floor and --hf-baseline on --device gpu need a CUDA GPU, and torch sees none here "
                    "(--device cpu runs the HF baseline on the CPU)")
    return None


def add_baselines(model: dict, args) -> None:
    if args.floor:
        from mstar_common.bench.baseline import read_bandwidth, weight_bytes

        model["bandwidth"] = read_bandwidth()
        model["weight_bytes"] = weight_bytes(args.checkpoint, args.dtype)
        model["floor_ms"] = model["weight_bytes"] / (model["bandwidth"]["read_tb_per_s"] * 1e12) * 1e3
    if args.hf_baseline:
        import torch

        from mstar_common.bench.baseline import hf_generate

        model["hf_generate"] = hf_generate(args.checkpoint, *hf_lengths(args), args.hf_batch,
                                           device="cuda" if args.device == "gpu" else "cpu",
                                           repeats=args.hf_repeats, dtype=getattr(torch, args.dtype))


def cmd_baseline(args) -> int:
    """The floor and the HF baseline alone, merged into an existing model JSON (a separate process, so it can
    run under another Python environment than the server's)."""
    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.families.registry import get_family

    path = Path(args.out)
    try:
        if problem := baseline_problem(args) or (None if args.floor or args.hf_baseline else
                                                 "nothing to measure: pass --floor and/or --hf-baseline"):
            raise DeploymentError(problem)
        args.checkpoint = resolve_checkpoint(str(args.checkpoint), get_family(args.family).builtin_checkpoints)
        # a new file records where and how it was measured, as a serve run's does (a merge keeps the run's own)
        model = _results_to_add_to(path) if path.is_file() else {"name": args.name, "meta": meta(None)}
    except (DeploymentError, FileNotFoundError) as exc:
        print(f"mstar bench: error: {exc}", file=sys.stderr)
        return 2
    add_baselines(model, args)
    for line in comparisons(model):
        print(f"[bench] {model.get('name', args.name)}: {line}", flush=True)
    path.write_text(json_text(model, indent=1))
    return 0


def _results_to_add_to(path: Path) -> dict:
    """An existing results file that the baselines are merged into (DeploymentError if it is not one)."""
    try:
        model = json.loads(path.read_text())
        why = None if isinstance(model, dict) else "not a JSON object"
    except (OSError, ValueError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    if why:
        raise DeploymentError(f"--out {path}: not a results file of `mstar bench` to add to ({why})")
    return model


def served_deployment(grpc_url: str, model: str) -> dict | None:
    """The deployment a running server was generated from, as its model configs carry it (the `deployment`
    parameter of each component model; an ensemble entry has none, so the repository's other models are asked).
    None for a repository that is not ours or a server that does not answer."""
    try:
        client = triton_grpc_client(grpc_url)
        try:
            index = client.get_model_repository_index(as_json=True).get("models", [])
            names = [model] + sorted(m["name"] for m in index if m.get("state") == "READY" and m["name"] != model)
            for name in names:
                config = client.get_model_config(name, as_json=True, client_timeout=10).get("config", {})
                text = config.get("parameters", {}).get("deployment", {}).get("string_value")
                if text:
                    return json.loads(text)
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 - the figures do not depend on it; say so and go on
        print(f"[bench] the server's deployment could not be read ({type(exc).__name__}: {exc})", flush=True)
    return None


def served_prefix_cache(dep: dict | None) -> bool | None:
    """Whether a served deployment (`served_deployment`) has its prefix cache on: unset is on for the text LLMs
    that `mstar bench url` measures (docs/deployment.md); None where the deployment is not known."""
    if dep is None:
        return None
    setting = ((dep.get("resources") or {}).get("kv_cache") or {}).get("prefix_caching")
    return True if setting is None else bool(setting)


def check_targets(grpc_url: str, model: str, proxy_url: str | None, name: str) -> str | None:
    """Why the running server cannot be measured (unreachable, the entry model not ready, the proxy not healthy
    or not serving `name`), or None."""
    try:
        client = triton_grpc_client(grpc_url)
        try:
            if not client.is_server_ready(client_timeout=10):
                return f"Triton at {grpc_url} is up but not ready"
            if not client.is_model_ready(model, client_timeout=10):
                names = sorted(m["name"] for m in client.get_model_repository_index(as_json=True).get("models", []))
                return f"model {model!r} is not ready on Triton at {grpc_url} (its models: {names}); see --model"
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 - any failure to talk to it is the answer
        return f"Triton's gRPC endpoint at {grpc_url} did not answer ({type(exc).__name__}: {exc}); see --grpc"
    if proxy_url is not None:
        try:
            with open_url(f"{proxy_url.rstrip('/')}/health", timeout=10) as response:
                if response.status != 200:
                    return f"the proxy at {proxy_url} answered /health with {response.status}"
            with open_url(f"{proxy_url.rstrip('/')}/v1/models", timeout=10) as response:
                served = [card["id"] for card in json.loads(response.read())["data"]]
        except OSError as exc:
            return f"the proxy at {proxy_url} did not answer /health ({exc}); see --proxy"
        except (ValueError, KeyError, TypeError) as exc:
            return f"the proxy at {proxy_url} answered /v1/models with no model list ({exc!r}); see --proxy"
        if name not in served:
            return f"the proxy at {proxy_url} serves {served}, not {name!r}; pass the model's name as --name"
    return None


def cmd_url(args) -> int:
    problem = check_targets(args.grpc, args.model, args.proxy, args.name)
    if problem:
        print(f"mstar bench: error: {problem}", file=sys.stderr)
        return 2
    model: dict = {"name": args.name, "meta": meta(None)}  # --out's folder exists (main), so nothing measured is lost
    deployment_served = served_deployment(args.grpc, args.model)
    if deployment_served is not None:
        model["deployment"] = deployment_served
    host = args.grpc.rpartition(":")[0] or "127.0.0.1"
    metrics = f"http://{host}:{args.metrics_port}/metrics" if args.metrics_port else None
    model["runs"] = sweep(args, args.grpc, args.model, args.proxy, None, metrics, on_run=_saver(model, args.out),
                          prefix_cache=served_prefix_cache(deployment_served))
    Path(args.out).write_text(json_text(model, indent=1))
    print(f"[bench] wrote {args.out}")
    return _exit_status(model["runs"])


def cmd_replay(args) -> int:
    from mstar_common.bench.replay import replay

    if not (args.concurrency or args.rates):
        print("mstar bench: error: nothing to run: --concurrency and --rates are both empty", file=sys.stderr)
        return 2
    try:
        result = replay(args.grpc, args.model, args.replay_data, args.concurrency, args.requests_per_level,
                        args.min_requests, args.warmup, args.timeout_s, args.rates, args.poisson_seconds)
    except ValueError as exc:  # the file does not fit the served entry model
        print(f"mstar bench: error: --input-data: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the server did not answer: said, not a traceback
        print(f"mstar bench: error: {args.model} at {args.grpc}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    result["meta"] = meta(None)
    Path(args.out).write_text(json_text(result, indent=1))
    print(f"[bench] wrote {args.out}")
    failed = [level for level in result["levels"] if level["num_requests"] and not
              level["num_requests"] - level["num_errors"]]
    if failed:
        print(f"mstar bench: error: {len(failed)} level(s) had no request succeed; the first error: "
              f"{failed[0]['errors'][:1]}", file=sys.stderr)
        return 1
    return 0


def _exit_status(runs: list[dict]) -> int:
    """1 (with a line saying so) when a level had no request succeed: its figures measure nothing."""
    if failed := [run for run in runs if run.get("all_failed")]:
        print(f"mstar bench: error: {len(failed)} level(s) had no request succeed (their first errors above)",
              file=sys.stderr)
        return 1
    return 0


def cmd_report(args) -> int:
    models, sources = {}, {}
    for path in args.inputs:
        try:
            model = json.loads(Path(path).read_text())
            name = model["name"]
            markdown({"meta": {}, "models": {name: model}})  # every field the report reads is there and readable
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            print(f"mstar bench: error: {path}: not a results file of `mstar bench` ({type(exc).__name__}: {exc})",
                  file=sys.stderr)
            return 2
        if name in models:
            print(f"mstar bench: error: {sources[name]} and {path} both hold the results of {name!r}; the report "
                  f"keeps one section per name (run them with different --name, or report them apart)",
                  file=sys.stderr)
            return 2
        models[name], sources[name] = model, path
    results = {"meta": meta(args.command_line), "models": models}
    for path in write_report(results, args.out):
        print(f"[bench] wrote {path}")
    return 0


# `MSTAR_*` variables that name places or the harness's own output, not how the server runs
NOT_SWITCHES = frozenset({"MSTAR_CACHE_DIR", "MSTAR_BENCH_LOG_DIR", "MSTAR_ENGINE_PYTHON"})


def served_switches(environ) -> dict[str, str]:
    """The `MSTAR_*` switches set for the run (docs/deployment.md), which the server it starts inherits: a figure
    is only comparable with another taken at the same switches."""
    return {k: v for k, v in sorted(environ.items()) if k.startswith("MSTAR_") and v and k not in NOT_SWITCHES}


def code_revision() -> str | None:
    """The checkout's commit, with `+changes` when its tracked files differ from it; None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def meta(command: str | None) -> dict:
    info = {"date": datetime.date.today().isoformat(), "command": command or " ".join(map(shlex.quote, sys.argv))}
    try:
        import torch

        if torch.cuda.is_available():
            memory = torch.cuda.get_device_properties(0).total_memory / 2**30
            info["hardware"] = f"{torch.cuda.get_device_name(0)} ({memory:.0f} GiB)"
        else:
            info["hardware"] = f"CPU only ({os.cpu_count()} cores)"
        info["software"] = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
        import triton

        info["software"] += f", triton {triton.__version__}"
    except ImportError:
        pass
    return info


def cmd_perf_analyzer_data(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.family != "text_lm":
        from mstar_common.bench.pa_files import family_file

        name, data = family_file(args.family, args.num_prompts or 4, args.max_tokens, args.audio_seconds)
        (out / f"{name}.json").write_text(json.dumps(data))
        print(f"[bench] wrote {out / name}.json")
        return 0
    workload = workload_from_args(args)
    prompts = f"{args.prompt_len}-{args.prompt_len_max}" if args.prompt_len_max else f"{args.prompt_len}"
    outputs = f"{args.output_len}-{args.output_len_max}" if args.output_len_max else f"{args.output_len}"
    name = f"{'fixed' if workload.ignore_eos else 'eos'}_{prompts}in_{outputs}out"
    if args.shared_prefix_len:
        name += f"_{args.shared_prefix_len}shared"
    if workload.temperature > 0:  # a sampled workload never takes a greedy one's file name
        name += f"_temp{workload.temperature:g}"
        name += f"_topp{workload.top_p:g}" if workload.top_p < 1 else ""
        name += f"_topk{workload.top_k}" if workload.top_k else ""
    (out / f"{name}.json").write_text(json.dumps(perf_analyzer_data(workload.requests(args.num_prompts or 16))))
    print(f"[bench] wrote {out / name}.json")
    return 0


def _length_problem(args) -> str | None:
    """Why `serve`'s requests cannot fit the --max-model-len it starts the server with (said before it starts;
    the engine would refuse every such request), or None."""
    if args.command != "serve":
        return None
    if args.input_requests:
        longest = max(len(req["input_ids"]) + req["max_tokens"] for req in args.input_requests)
        if longest > args.max_model_len:
            return (f"--input-data: a request's prompt and max_tokens come to {longest} tokens, more than "
                    f"--max-model-len {args.max_model_len} (raise it, or shorten the requests)")
    else:
        prompt, output = args.prompt_len_max or args.prompt_len, args.output_len_max or args.output_len
        if prompt + output > args.max_model_len:
            return (f"--prompt-len{'-max' if args.prompt_len_max else ''} {prompt} plus "
                    f"--output-len{'-max' if args.output_len_max else ''} {output} is {prompt + output} tokens, "
                    f"more than --max-model-len {args.max_model_len}: raise it, or shorten the workload")
    if args.check_eager and args.prompt_len + args.check_len > args.max_model_len:
        return (f"--check-eager: --prompt-len {args.prompt_len} plus --check-len {args.check_len} is more than "
                f"--max-model-len {args.max_model_len}")
    return None


def _above_zero(what: str):
    """An argparse type: a finite number > 0 (`what` names it in the refusal)."""
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = 0.0
        if not 0 < number < math.inf:
            raise argparse.ArgumentTypeError(f"must be {what} > 0, not {value!r}")
        return number
    return parse


_positive = _above_zero("a number of ms")  # the SLO bounds
_rate = _above_zero("a number")  # Poisson rates (req/s) and seconds


def _pages(value: str) -> int | str:
    """An argparse type: `auto` or an integer >= 1 (resources.kv_cache.num_pages)."""
    return value if value == "auto" else _at_least(1)(value)


def _at_least(low: int):
    """An argparse type: an integer >= `low`."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = low - 1
        if number < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, not {value!r}")
        return number
    return parse



def _run_problem(args) -> str | None:
    """What the command line asks that cannot run (said before a server starts): proxy levels with no proxy,
    nothing to run, an --out that cannot be written."""
    command = args.command
    if command == "url" and (args.proxy_concurrency or args.proxy_rates) and not args.proxy:
        return "--proxy-concurrency and --proxy-rates need --proxy (the proxy's URL)"
    if command in ("url", "serve"):
        levels = args.concurrency or args.rates or args.proxy_concurrency or args.proxy_rates
        other = command == "serve" and (args.check_eager or args.floor or args.hf_baseline)
        if not (levels or other):
            return ("nothing to run: every level list is empty (--concurrency, --rates, --proxy-concurrency, "
                    "--proxy-rates)" + (" and there is no --check-eager, --floor or --hf-baseline"
                                        if command == "serve" else ""))
    out = Path(args.out)
    folder = command in ("report", "perf-analyzer-data")  # --out is a folder; otherwise a JSON file
    if folder and out.exists() and not out.is_dir():
        return f"--out {out}: a file is there; this command writes a folder"
    if not folder and out.is_dir():
        return f"--out {out}: a folder is there; this command writes a JSON file"
    try:
        (out if folder else out.parent).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--out {out}: cannot create {'it' if folder else 'its folder'} ({exc.strerror or exc})"
    if not os.access(out if folder else out.parent, os.W_OK):
        return f"--out {out}: not writable here"
    return None


def _processes(value: str) -> int | str:
    if value == "auto" or (value.isdigit() and int(value) >= 1):
        return value if value == "auto" else int(value)
    raise argparse.ArgumentTypeError(f"must be 'auto' or a whole number >= 1, not {value!r}")


def add_length_args(p: argparse.ArgumentParser) -> None:
    """The generated workload's lengths and decoding (`Workload`)."""
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256,
                   help="output tokens per request (exactly that many unless --no-ignore-eos)")
    p.add_argument("--prompt-len-max", type=int, default=None,
                   help="draw each prompt's length from [--prompt-len, this] (the same draws every run)")
    p.add_argument("--output-len-max", type=int, default=None,
                   help="draw each request's max_tokens from [--output-len, this]")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="let a request end at the model's EOS before its max_tokens (default: fixed lengths)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature > 0 (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling with --temperature > 0 (0: off)")
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="leading prompt tokens every request shares (a system prompt; with --prefix-caching the "
                        "served prompts then match it); the rest of each prompt is its own")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="model")
    add_length_args(p)
    p.add_argument("--input-data", default=None,
                   help="take the requests from this perf_analyzer input-data file (e.g. one under "
                        "perf_analyzer_configs/) instead of generating them: used in order and wrapped round, "
                        "so the prompt and output lengths are the file's; --prompt-len, --output-len, "
                        "--temperature, --top-p, --top-k and --shared-prefix-len then do not apply")
    p.add_argument("--slo-ttft-ms", type=_positive, default=None,
                   help="a request meets the SLO only with its first token within this many ms (with "
                        "--slo-tpot-ms: both); each level then reports the share that met it and the goodput")
    p.add_argument("--slo-tpot-ms", type=_positive, default=None,
                   help="... and its mean time per output token after the first within this many ms")
    p.add_argument("--concurrency", type=_at_least(1), nargs="*", default=[1, 8, 64])
    p.add_argument("--rates", type=_rate, nargs="*", default=[], help="Poisson arrival rates (req/s) against Triton")
    p.add_argument("--triton-outputs", default="all", choices=("all", "token_ids"),
                   help="the outputs the Triton levels' client asks for: all of the entry model's (what a client "
                        "that names none gets), or only the token ids, which is all the benchmark reads (the "
                        "component then builds one tensor per response instead of five)")
    p.add_argument("--proxy-concurrency", type=_at_least(1), nargs="*", default=[])
    p.add_argument("--proxy-rates", type=_rate, nargs="*", default=[])
    p.add_argument("--client-processes", default="auto", type=_processes,
                   help="client processes for the proxy levels (auto: one per 16 closed-loop streams, at most half "
                        "the CPUs; one process of httpx saturates a core at ~17,000 SSE events/s)")
    p.add_argument("--triton-client-processes", default=1, type=_processes,
                   help="client processes for the Triton levels (default 1: tritonclient reads each stream on a "
                        "thread of its own, and on an H100 one process measured as 4 at c=64 and 8 at c=256; auto "
                        "as --client-processes)")
    p.add_argument("--requests-per-level", type=_at_least(1), default=2,
                   help="closed loop: requests = this x concurrency")
    p.add_argument("--min-requests", type=_at_least(1), default=4)
    p.add_argument("--poisson-seconds", type=_rate, default=4.0, help="Poisson: requests = rate x this")
    p.add_argument("--warmup", type=_at_least(0), default=2)
    p.add_argument("--out", required=True)


def add_baseline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--floor", action="store_true", help="measure read bandwidth and the weight-streaming floor")
    p.add_argument("--hf-baseline", action="store_true", help="time HF generate on the same checkpoint")
    p.add_argument("--hf-batch", type=_at_least(1), nargs="*", default=[1, 64])
    p.add_argument("--hf-output-len", type=_at_least(2), default=None,
                   help="HF's output tokens per request (default: --output-len)")
    p.add_argument("--hf-repeats", type=_at_least(1), default=3,
                   help="timed HF generate runs per batch size; the fastest is the baseline")


def main(argv: list[str] | None = None, prog: str = "mstar bench") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="start a server for a checkpoint and run the sweep")
    add_workload_args(p)
    p.add_argument("--family", default="qwen3", choices=("qwen3", "llama"),
                   help="the text LM family whose entry model the sweep drives with token ids")
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--no-fused-ops", action="store_true")
    p.add_argument("--no-capture-sampling", action="store_true", help="capture greedy graphs only")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--decode-buckets", type=int, nargs="*")
    p.add_argument("--token-buckets", type=int, nargs="*")
    p.add_argument("--max-concurrent", type=int, default=64, help="requests an instance runs at once")
    p.add_argument("--instances", type=_at_least(1), default=1,
                   help="the LLM's Triton instances on GPU 0 (placement.instances); each has its own engine and pool")
    p.add_argument("--num-pages", type=_pages, default=1024,
                   help="KV pages per instance, or auto (sized from the GPU's memory; resources.kv_cache.num_pages)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8_e4m3"),
                   help="the KV pool's element type (resources.kv_cache.dtype; auto: the model's)")
    p.add_argument("--prefix-caching", action="store_true",
                   help="serve with the prefix cache on (resources.kv_cache.prefix_caching). Off by default, so "
                        "the figures are full prefills: the proxy's prompts are all alike, and "
                        "--shared-prefix-len makes the Triton prompts share a start")
    p.add_argument("--proxy-workers", type=int, default=1, help="the proxy's worker processes (server.proxy_workers)")
    p.add_argument("--max-model-len", type=_at_least(2), default=1024,
                   help="tokens a request may span, prompt and output (resources.max_model_len)")
    p.add_argument("--max-batch-tokens", type=int, default=Resources().max_batch_tokens,
                   help="packed tokens per engine step (resources.max_batch_tokens; default: the deployment's, "
                        "%(default)s); --token-buckets above it are refused")
    add_baseline_args(p)
    p.add_argument("--check-eager", type=_at_least(0), default=0,
                   help="compare N served greedy requests with eager steps")
    p.add_argument("--check-len", type=_at_least(1), default=64, help="output tokens per check request")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("baseline", help="measure the floor and HF generate, merged into --out")
    p.add_argument("--name", default="model")
    p.add_argument("--family", default="qwen3", choices=("qwen3", "llama"),
                   help="the family whose built-in checkpoints builtin:<name> names")
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--device", default="gpu", choices=["gpu", "cpu"], help="where HF generate runs")
    p.add_argument("--dtype", default="bfloat16", choices=HF_DTYPES)
    p.add_argument("--prompt-len", type=_at_least(1), default=512)
    p.add_argument("--output-len", type=_at_least(1), default=256, help="HF's output tokens per request")
    p.add_argument("--out", required=True)
    add_baseline_args(p)
    p.set_defaults(func=cmd_baseline)
    p = sub.add_parser("url", help="run the sweep against a running server")
    add_workload_args(p)
    p.add_argument("--grpc", required=True)
    p.add_argument("--model", default="qwen3_llm")
    p.add_argument("--proxy", default=None)
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Triton's metrics port on the --grpc host: each level also records the mean TTFT and ITL "
                        "the serving component saw (Triton's default is 8002)")
    p.set_defaults(func=cmd_url)
    p = sub.add_parser("replay", help="replay a perf_analyzer input-data file against any running entry model")
    p.add_argument("--grpc", default="127.0.0.1:8001")
    p.add_argument("--model", required=True, help="the entry model (orpheus_lm, whisper_walk, flux2_klein_walk, ...)")
    p.add_argument("--input-data", dest="replay_data", required=True,
                   help="a perf_analyzer input-data file (perf_analyzer_configs/<family>/*.json)")
    p.add_argument("--concurrency", type=_at_least(1), nargs="*", default=[1, 4], help="closed-loop levels")
    p.add_argument("--rates", type=_above_zero("requests a second"), nargs="*", default=[],
                   help="Poisson arrival levels, requests a second (perf_analyzer's --request-rate-range)")
    p.add_argument("--poisson-seconds", type=_above_zero("seconds"), default=10.0,
                   help="each rate level sends rate x this many requests (at least --min-requests)")
    p.add_argument("--requests-per-level", type=_at_least(1), default=2, help="requests per unit of concurrency")
    p.add_argument("--min-requests", type=_at_least(1), default=4)
    p.add_argument("--warmup", type=_at_least(0), default=1)
    p.add_argument("--timeout-s", type=_above_zero("seconds"), default=600.0, help="the longest a level may take")
    p.add_argument("--out", required=True, help="the results JSON")
    p.set_defaults(func=cmd_replay)
    p = sub.add_parser("report", help="merge model JSONs into results.json/.md and plots")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--command-line", default=None, help="the command to print beside the figures")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("perf-analyzer-data", help="write the workload as perf_analyzer --input-data JSON")
    p.add_argument("--out", required=True)
    add_length_args(p)
    p.add_argument("--num-prompts", type=_at_least(1), default=None,
                   help="requests in the file (default: 16 for text_lm, 4 for the speech, transcription and image "
                        "files)")
    p.add_argument("--family", default="text_lm", choices=("text_lm", "orpheus", "whisper", "image"),
                   help="whose entry model the file feeds; the length and sampling flags are text_lm's")
    p.add_argument("--max-tokens", type=_at_least(1), default=None,
                   help="orpheus: audio tokens a request (default 1200); whisper: text tokens a window (128)")
    p.add_argument("--audio-seconds", type=_above_zero("seconds"), default=30.0, help="whisper: each clip's length")
    p.set_defaults(func=cmd_perf_analyzer_data)
    args = parser.parse_args(argv)
    if hasattr(args, "output_len_max"):  # the lengths' rules, before a server starts or a level runs
        try:
            workload_from_args(args)
        except ValueError as exc:
            parser.error(re.sub(r"\b(prompt_len_max|output_len_max|prompt_len|output_len|shared_prefix_len|temperature|top_p|top_k)\b",
                                lambda m: "--" + m.group(1).replace("_", "-"), str(exc)))
    if problem := _run_problem(args):
        parser.error(problem)
    args.input_requests = None
    if getattr(args, "input_data", None):  # refused before a server starts or a level runs
        try:
            args.input_requests = requests_from_file(args.input_data)
        except ValueError as exc:
            parser.error(f"--input-data: {exc}")
    if problem := _length_problem(args):
        parser.error(problem)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxy request
    return args.func(args)

