"""`mstar bench replay`: an input-data file's requests against any entry model, as perf_analyzer would send them
(perf_analyzer itself is not on this project's package index): closed-loop levels of concurrency through Triton's
gRPC streaming, each request's latency to its last response and to its first, requests a second, errors.

The file is checked against the served entry model's config first (`pa_files.check_against_config`), so a file
perf_analyzer would refuse is refused here too, naming the entry and the input.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mstar_common.bench.drivers import TritonDriver, triton_grpc_client
from mstar_common.bench.metrics import RequestRecord
from mstar_common.bench.pa_files import check_against_config, infer_inputs


class EntryInputs:
    """An entry of the file -> the tensors perf_analyzer sends for it."""

    def __init__(self, config: dict) -> None:
        self.config = config

    def __call__(self, entry: dict) -> list:
        import tritonclient.grpc as grpcclient

        tensors = []
        for name, (array, datatype) in infer_inputs(entry, self.config).items():
            tensor = grpcclient.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return tensors


def one_per_response(result) -> int:
    """A response that carries outputs counts one (what it carries is the family's: audio, text, images)."""
    return 1 if result.get_response().outputs else 0


def served_config(url: str, model: str) -> dict:
    client = triton_grpc_client(url)
    try:
        return client.get_model_config(model, as_json=True)["config"]
    finally:
        client.close()


def load_checked(path: str | Path, config: dict) -> list[dict]:
    """The file's entries, checked against `config`; ValueError naming the file, the entry and the input."""
    try:
        data = json.loads(Path(path).read_text())
        entries = data["data"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a perf_analyzer input-data file ({{\"data\": [...]}}): {exc!r}") from None
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{path}: data: a non-empty list of entries (one request each)")
    try:
        check_against_config(data, config)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return entries


def summarize_level(records: list[RequestRecord], concurrency: int | None, rate: float | None = None) -> dict:
    ok = [r for r in records if r.error is None and r.end is not None]
    latency = [(r.end - r.start) * 1e3 for r in ok]
    first = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    duration = (max(r.end for r in ok) - min(r.start for r in ok)) if ok else 0.0

    def pcts(values: list[float]) -> dict:
        return {f"p{q}": float(np.percentile(values, q)) if values else None for q in (50, 90, 99)}

    return {"concurrency": concurrency, "rate": rate, "num_requests": len(records),
            "num_errors": len(records) - len(ok),
            "errors": sorted({r.error for r in records if r.error})[:3], "duration_s": duration,
            "requests_per_s": len(ok) / duration if duration else 0.0, "latency_ms": pcts(latency),
            "first_response_ms": pcts(first),
            "responses_per_request": float(np.mean([len(r.chunks) for r in ok])) if ok else 0.0}


def replay(url: str, model: str, path: str | Path, concurrency: list[int], requests_per_level: int = 2,
           min_requests: int = 4, warmup: int = 1, timeout_s: float = 600.0, rates: list[float] = (),
           poisson_seconds: float = 10.0) -> dict:
    """Every level of the replay: the file's entries in order, wrapping round, `max(min_requests,
    requests_per_level * c)` requests at concurrency c, then `max(min_requests, rate * poisson_seconds)` Poisson
    arrivals at each rate (perf_analyzer's --request-rate-range with --request-distribution poisson), after `warmup`
    unrecorded ones."""
    config = served_config(url, model)
    entries = load_checked(path, config)
    driver = TritonDriver(url, model, inputs=EntryInputs(config), counts=one_per_response)
    issued = 0

    def batch(count: int) -> list[dict]:
        nonlocal issued
        issued += count
        return [entries[(issued - count + i) % len(entries)] for i in range(count)]

    if warmup:
        driver.run(batch(warmup), concurrency=warmup, timeout_s=timeout_s)
    levels = []
    loads = [({"concurrency": c}, max(min_requests, requests_per_level * c)) for c in concurrency] + \
        [({"rate": r}, max(min_requests, int(r * poisson_seconds))) for r in rates]
    for load, count in loads:
        records = driver.run(batch(count), timeout_s=timeout_s, **load)
        levels.append(summarize_level(records, load.get("concurrency"), load.get("rate")))
        s = levels[-1]
        label = f"c={load['concurrency']}" if "concurrency" in load else f"{load['rate']:g} req/s Poisson"
        print(f"[bench] replay {model} {label}: {s['num_requests']} req, {s['requests_per_s']:.2f} req/s, latency "
              f"p50/p90 {_ms(s['latency_ms']['p50'])}/{_ms(s['latency_ms']['p90'])} ms, first response p50 "
              f"{_ms(s['first_response_ms']['p50'])} ms, errors {s['num_errors']}", flush=True)
    return {"model": model, "input_data": str(path), "entries": len(entries), "levels": levels}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
