"""Production behaviour on a real tritonserver + proxy with a small cap (4 running + 4 queued): metrics,
malformed native requests, overload (429 fast, admitted requests finish), server-side deadlines, random
cancellation (nothing held afterwards), a stub killed mid-stream (clean failures, then service again), the
proxy's OpenAPI schema fuzzed (no 5xx), and a graceful drain. Tests run in file order; the drain is last."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml

from mstar_common.cli import DEFAULT_DEPLOYMENT
from mstar_common.config import deployment_from_dict
from mstar_common.launcher import Ports, start_proxy, stop_process, wait_ready
from mstar_common.repository import entry_model, write_repository
from mstar_common.supervisor import TritonSupervisor, find_stubs
from tests.integration.conftest import Served, metrics_after_a_sample, print_logs
from tests.integration.triton_stream import make_inputs, run_stream
from tests.scripts import load_script

pytestmark = pytest.mark.server

CAP, QUEUE = 4, 4


cancel_fuzz = load_script("cancel_fuzz")


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    root = tmp_path_factory.mktemp("capped")
    saved_cache = os.environ.get("MSTAR_CACHE_DIR")
    os.environ.setdefault("MSTAR_CACHE_DIR", str(root / "cache"))  # the stubs inherit it (builtin checkpoints)
    raw = yaml.safe_load(DEFAULT_DEPLOYMENT.read_text())
    raw.update(max_concurrent_requests=CAP,
               admission={"max_queue": QUEUE, "queue_timeout_s": 30, "request_timeout_s": 60},
               server={"drain_timeout_s": 10})
    dep = deployment_from_dict(raw, source="capped-deployment")
    repo = write_repository(dep, root / "model_repository", "capped-deployment")
    ports = Ports.free()
    supervisor = TritonSupervisor(repo, dep, ports, root / "tritonserver.log", ready_timeout_s=240, poll_s=0.2)
    proxy = None
    # A hung stub (seen once here, docs/reliability.md) ends itself within ~20-40 s with its stacks in the log the
    # failing test's report shows; the supervisor then relaunches the server for the tests after it.
    saved_stall = os.environ.get("MSTAR_STALL_EXIT_S")
    os.environ["MSTAR_STALL_EXIT_S"] = "20"
    try:
        supervisor.start()
        supervisor.watch()
        proxy = start_proxy(dep, entry_model(dep), ports, root / "proxy.log")
        wait_ready(ports.proxy_health_url, proxy, 60, "proxy")
        served = Served(dep, ports, Path(), entry_model(dep), root)
        served.supervisor = supervisor
        yield served
    except Exception:
        print_logs(root)
        raise
    finally:
        stop_process(proxy)
        supervisor.stop(drain_s=5)
        for name, saved in (("MSTAR_STALL_EXIT_S", saved_stall), ("MSTAR_CACHE_DIR", saved_cache)):
            if saved is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = saved


def _held(served) -> dict[str, float]:
    return cancel_fuzz.read_metrics(served.metrics_url)


def _assert_released(served, timeout_s: float = 5.0) -> None:
    held, _ = cancel_fuzz.wait_until_released(served.metrics_url, timeout_s)
    assert not any(held.values()), held


def _completion(served, **extra) -> httpx.Response:
    body = {"model": served.dep.name, "prompt": "hello", "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(served.proxy_url + "/v1/completions", json=body, timeout=60)


def test_component_metrics_are_exported(capped):
    assert _completion(capped).status_code == 200
    # the request's samples are on the page once the metrics thread has finished a sample begun after it (its
    # period, 0.1 s, stretches on a loaded box: a fixed 0.3 s wait could read the histograms before them)
    text = metrics_after_a_sample(capped.metrics_url)
    for series in ("mstar_requests_running{", "mstar_requests_waiting{", "mstar_kv_pages_used{",
                   "mstar_state_slots_used{", "mstar_engine_steps_total{", "mstar_graph_steps_total{",
                   "mstar_engine_rows_stepped_total{", "mstar_engine_tokens_stepped_total{",
                   "mstar_graph_padding_tokens_total{",
                   "mstar_requests_overloaded_total{", "mstar_engine_steps_per_second{",
                   "mstar_time_to_first_token_seconds_count{", "mstar_inter_token_latency_seconds_bucket{",
                   "nv_inference_request_success{"):
        assert series in text, series
    assert 'instance="qwen3_llm_0_0"' in text
    # the latency histograms are bucket counters in a histogram's shape (backends/metrics.py): cumulative
    # buckets whose +Inf one is the count, 3 ITL samples (4 tokens) at least, and one TTFT sample a request

    def value(prefix: str, *parts: str) -> float:
        [line] = [x for x in text.splitlines() if x.startswith(prefix) and 'model="qwen3_llm"' in x
                  and all(p in x for p in parts)]
        return float(line.rsplit(" ", 1)[1])

    itl = "mstar_inter_token_latency_seconds"
    count = value(f"{itl}_count{{")
    assert count >= 3 and value(f"{itl}_bucket{{", 'le="+Inf"') == count
    assert value(f"{itl}_bucket{{", 'le="0.001"') <= value(f"{itl}_bucket{{", 'le="1.0"') <= count
    assert value(f"{itl}_sum{{") > 0
    assert value("mstar_time_to_first_token_seconds_bucket{", 'le="+Inf"') == value(
        "mstar_time_to_first_token_seconds_count{") >= 1


def _raw_input(name: str, datatype: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _native_error(served, inputs: list) -> str | None:
    """Send one raw request on a stream; the error it got (None if it succeeded)."""
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(served.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer(served.entry, inputs, enable_empty_final_response=True)
        while True:
            result, error = got.get(timeout=30)
            if error is not None:
                return str(error)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return None
    finally:
        client.stop_stream()
        client.close()


def test_malformed_native_requests_are_refused_and_the_server_keeps_serving(capped):
    text = _raw_input("text_input", "BYTES", np.array([b"hi"], dtype=np.object_))
    cases = {
        "wrong dtype": [text, _raw_input("max_tokens", "FP32", np.array([4.0], dtype=np.float32))],
        "wrong shape": [text, _raw_input("max_tokens", "INT32", np.array([4, 5], dtype=np.int32))],
        "missing prompt": [_raw_input("max_tokens", "INT32", np.array([4], dtype=np.int32))],
        "two prompts": [text, _raw_input("input_ids", "INT32", np.array([1, 2], dtype=np.int32))],
        "unknown input": [text, _raw_input("bogus", "INT32", np.array([1], dtype=np.int32))],
        "huge max_tokens": [text, _raw_input("max_tokens", "INT32", np.array([2**31 - 1], dtype=np.int32))],
        "huge seed": [text, _raw_input("seed", "INT64", np.array([-1], dtype=np.int64))],
        "nan temperature": [text, _raw_input("temperature", "FP32", np.array([np.nan], dtype=np.float32))],
        "negative ids": [_raw_input("input_ids", "INT32", np.array([-5, 2], dtype=np.int32))],
        "200k ids": [_raw_input("input_ids", "INT32", np.ones(200_000, dtype=np.int32))],
        "4 MB of text": [_raw_input("text_input", "BYTES", np.array([b"a" * (4 << 20)], dtype=np.object_))],
        "invalid UTF-8": [_raw_input("text_input", "BYTES", np.array([b"\xff\xfe"], dtype=np.object_))],
        "bad messages JSON": [_raw_input("messages", "BYTES", np.array([b"[{"], dtype=np.object_))],
        "empty ids": [_raw_input("input_ids", "INT32", np.zeros(0, dtype=np.int32))],
    }
    for case, inputs in cases.items():
        start = time.monotonic()
        error = _native_error(capped, inputs)
        assert error is not None, case
        assert "internal error" not in error and "not healthy" not in error, (case, error)
        assert time.monotonic() - start < 5, case
    assert _native_error(capped, [text, _raw_input("max_tokens", "INT32", np.array([3], dtype=np.int32))]) is None
    _assert_released(capped)


async def _overload(served, n: int) -> list[tuple[int, float, str, str]]:
    body = {"model": served.dep.name, "prompt": "load", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n + 4)) as client:
        # Open the connections first: the bound is on the server's answer, not on TCP setup.
        await asyncio.gather(*(client.get(served.proxy_url + "/v1/models") for _ in range(n)))

        async def one(i: int) -> tuple[int, float, str, str]:
            rid = f"overload-{i}-{time.monotonic_ns()}"
            start = time.monotonic()
            r = await client.post(served.proxy_url + "/v1/completions", json=body, headers={"x-request-id": rid})
            return r.status_code, time.monotonic() - start, r.headers.get("retry-after", ""), rid

        return await asyncio.gather(*(one(i) for i in range(n)))


def _proxy_ms(served, request_id: str) -> float:
    """The proxy's own time for a request, from its access log line."""
    match = re.search(rf"\[{request_id}\] \S+ \S+ -> \d+ in ([0-9.]+) ms", (served.log_dir / "proxy.log").read_text())
    assert match, request_id
    return float(match.group(1))


def _burst(served) -> tuple[list[float], list[int], bool]:
    """One burst of 4 x CAP: the admitted ones complete, the rest get 429 + Retry-After. Returns the 429s' times
    at the proxy (its access log) and at the client, sorted, and whether the machine is loaded."""
    results = asyncio.run(_overload(served, 4 * CAP))
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(ok) + len(refused) == 4 * CAP, results
    assert len(ok) >= CAP + QUEUE and refused, results  # the queue absorbed what it could; the rest was refused
    assert all(r[2] == "1" for r in refused)
    server_ms = sorted(_proxy_ms(served, r[3]) for r in refused)
    client_ms = sorted(round(1e3 * r[1]) for r in refused)
    print(f"429 after (ms) at the proxy: {server_ms}, at the client: {client_ms}; load {os.getloadavg()[0]:.1f}")
    # On a machine shared with other heavy work (load above 1.5 per core) every process here, the test's own
    # HTTP client included, gets a fraction of a core, so the bounds below are relaxed there, not skipped.
    return server_ms, client_ms, os.getloadavg()[0] > 1.5 * (os.cpu_count() or 1)


def test_overload_at_4x_the_cap_gets_fast_429s_while_admitted_requests_finish(capped):
    # 100 ms at the proxy is the bound: a 429 must not wait for a slot (an admitted 120-token request takes far
    # longer). The client's figure adds this process's own event loop, which opens all 4 x CAP requests at once,
    # so it only catches a 429 held somewhere between (102 ms was seen on a 2-core machine at load 1.3 with the
    # proxy's own at most 37 ms). docs/reliability.md has the measurements.
    server_ms, client_ms, is_loaded = _burst(capped)
    if server_ms[-1] >= (500 if is_loaded else 100):
        # Once in a fresh-clone CI run (2026-12-03) all eight 429s left together after 178-179 ms, below the load
        # threshold: the whole process stalled once (a one-off pause, not a queue: the 429s were within 1 ms of
        # each other and 8-27 ms in three runs right after). A second burst tells a stall from a 429 that waits.
        server_ms, client_ms, is_loaded = _burst(capped)
    assert server_ms[-1] < (500 if is_loaded else 100), server_ms
    assert client_ms[-1] < (1500 if is_loaded else 300), client_ms
    _assert_released(capped)


def test_a_request_deadline_is_enforced_server_side(capped):
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(capped.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        start = time.monotonic()
        client.async_stream_infer(capped.entry, make_inputs(text_input="x", max_tokens=480, ignore_eos=True),
                                  timeout=300_000, enable_empty_final_response=True)  # microseconds
        while True:
            _, error = got.get(timeout=30)
            if error is not None:
                break
        assert "deadline_exceeded" in str(error) and "0.3 s" in str(error)
        assert time.monotonic() - start < 2.0
    finally:
        client.stop_stream()
        client.close()
    _assert_released(capped)


def test_random_cancellations_leave_nothing_held(capped):
    result = asyncio.run(cancel_fuzz.fuzz(capped.proxy_url, capped.grpc_url, capped.metrics_url, capped.dep.name,
                                          capped.entry, n=120, concurrency=CAP + QUEUE, seed=7))
    assert not result.errors, result.errors[:5]
    assert sum(result.outcomes.values()) == 120 and len(result.outcomes) >= 3, result.outcomes
    assert not any(result.held_after.values()), result.held_after


def test_openapi_schema_fuzz_finds_no_5xx(capped):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_url(capped.proxy_url + "/openapi.json")
    failures: list[str] = []
    calls: list[int] = []

    @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case):
        if isinstance(case.body, dict):  # bound the CPU time of valid generations; validation is unchanged
            for key in ("max_tokens", "max_completion_tokens"):
                if type(case.body.get(key)) is int and 8 < case.body[key] <= 512:
                    case.body[key] = 8
        response = case.call(timeout=60)
        calls.append(response.status_code)
        if response.status_code >= 500:
            failures.append(f"{case.method} {case.path} {case.body!r:.200} -> {response.status_code}")

    for operation in schema.get_all_operations():
        for mode in schemathesis.GenerationMode:  # valid and invalid inputs
            try:
                given(operation.ok().as_strategy(generation_mode=mode))(check)()
            except Unsatisfiable:  # e.g. no invalid input exists for a route without parameters
                pass
    assert not failures, failures[:5]
    assert len(calls) > 20 and any(code == 200 for code in calls), calls
    _assert_released(capped)


def _stub_pids(served) -> list[int]:
    return sorted(find_stubs(served.supervisor.proc.pid))


def test_a_stub_killed_mid_stream_fails_in_flight_requests_cleanly_and_service_resumes(capped):
    long = {"model": capped.dep.name, "prompt": "x", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    outcomes: dict[str, object] = {}

    def whole():
        outcomes["whole"] = httpx.post(capped.proxy_url + "/v1/completions", json=long, timeout=60)

    def streamed():
        with httpx.stream("POST", capped.proxy_url + "/v1/completions", json={**long, "stream": True},
                          timeout=60) as r:
            outcomes["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    def native():
        outcomes["native"] = run_stream(capped.grpc_url, capped.entry,
                                        {"n": {"text_input": "x", "max_tokens": 480, "ignore_eos": True}}, 60)["n"]

    threads = [threading.Thread(target=f) for f in (whole, streamed, native)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while _held(capped)["mstar_requests_running"] < 3:
        assert time.monotonic() < deadline, "the three requests never ran together"
        time.sleep(0.02)
    old_pids, restarts = _stub_pids(capped), capped.supervisor.num_restarts
    os.kill(old_pids[0], signal.SIGKILL)
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "an in-flight request hung after its stub died"

    whole_r = outcomes["whole"]
    # 500 when Triton reports the dead stub first; 503 (Triton unavailable) when the supervisor's relaunch closes
    # the connection first (seen on a loaded 2-core box). Either is a server error with its id in the log.
    assert whole_r.status_code in (500, 503), whole_r.text
    error_id = whole_r.json()["error"]["code"]
    assert error_id and error_id in (capped.log_dir / "proxy.log").read_text()
    last_event = json.loads(outcomes["stream"][-1].removeprefix("data: "))
    assert last_event["error"]["type"] == "server_error" and last_event["error"]["code"]
    assert outcomes["native"].error is not None

    deadline = time.monotonic() + 120
    while httpx.get(capped.proxy_url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "the deployment did not come back"
        time.sleep(0.2)
    assert capped.supervisor.num_restarts == restarts + 1 and _stub_pids(capped) != old_pids
    assert _completion(capped).status_code == 200
    _assert_released(capped)


def test_graceful_shutdown_drains_in_flight_requests(capped):
    body = {"model": capped.dep.name, "prompt": "x", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    outcome: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: outcome.setdefault(
        "r", httpx.post(capped.proxy_url + "/v1/completions", json=body, timeout=60)))
    thread.start()
    deadline = time.monotonic() + 60  # generous: a loaded 2-core CI box can take seconds to admit it
    while _held(capped)["mstar_requests_running"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    capped.supervisor.stop(drain_s=20)  # SIGTERM: Triton refuses new work and lets this one finish
    thread.join(60)
    r = outcome["r"]
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    assert r.json()["usage"]["completion_tokens"] == 200
    assert _completion(capped).status_code == 503  # nothing serves now: not ready, with Retry-After
