"""A real tritonserver + proxy with `MSTAR_ENGINE_PROCESS=1`: the component's engine runs in a child of its stub.
The default deployment (tiny Qwen3): greedy tokens through Triton equal transformers `generate`; the OpenAI client
streams a chat completion; random cancellations leave nothing held; the engine process goes with the server. The
Qwen3 server runs two output pumps (`MSTAR_PUMP_SHARDS=2`).
Orpheus (tiny Llama + tiny SNAC): the served tokens are transformers' and the served PCM is the `snac` package's
decoding of them; a cancelled stream frees its pages and codec state."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from pathlib import Path

import openai
import pytest
import torch
import yaml

from mstar_common.cli import CONFIGS, DEFAULT_DEPLOYMENT
from mstar_common.config import deployment_from_dict
from mstar_common.supervisor import is_running, process_state
from tests.integration.conftest import serve_deployment
from tests.integration.test_orpheus_server import check_cancel_frees, check_served_parity
from tests.integration.triton_stream import run_stream
from tests.scripts import load_script

pytestmark = pytest.mark.server

CAP, QUEUE = 4, 4
PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "a", "What is the capital of France?",
           "1 2 3 4 5 6 7 8 9 10", "GPU", "Serving engineers measure time to first token.", "Good night"]
MAX_TOKENS = 16

cancel_fuzz = load_script("cancel_fuzz")


def _engine_pids(log: Path) -> list[int]:
    return [int(p) for p in re.findall(r"engine process (\d+) started", log.read_text(errors="replace"))]


@contextlib.contextmanager
def _served_with_engine_process(dep, root: Path, ready_timeout_s: float = 300, **switches: str):
    setting = {"MSTAR_ENGINE_PROCESS": "1", **switches}
    previous = {name: os.environ.get(name) for name in setting}
    os.environ.update(setting)  # the stubs inherit the server's environment
    try:
        with serve_deployment(dep, root, dep.name, ready_timeout_s=ready_timeout_s) as s:
            yield s
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    log = root / "tritonserver.log"
    pids = _engine_pids(log)
    deadline = time.monotonic() + 10
    while any(is_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids and not any(is_running(p) for p in pids), f"engine processes left after the server stopped: {pids}"
    # Not killed by the stop signal the server's process group got: stopped by its stub's finalize, or, where Triton
    # 2.51 never calls it (a client's cancel that crossed a final response, rare since the proxy's client stopped
    # cancelling after finals: docs/reliability.md), killed with the group when the server outlives its stop's grace.
    assert "exited (code" not in log.read_text(errors="replace")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    raw = yaml.safe_load(DEFAULT_DEPLOYMENT.read_text())
    raw.update(max_concurrent_requests=CAP, admission={"max_queue": QUEUE})
    dep = deployment_from_dict(raw, source="engine-process-deployment")
    # two output pumps (MSTAR_PUMP_SHARDS, meant for this mode): parity, streaming and cancellations through both
    with _served_with_engine_process(dep, tmp_path_factory.mktemp("engine-process-served"),
                                     MSTAR_PUMP_SHARDS="2") as s:
        yield s


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    dep = deployment_from_dict(yaml.safe_load((CONFIGS / "orpheus.yaml").read_text()), source="orpheus.yaml")
    with _served_with_engine_process(dep, tmp_path_factory.mktemp("engine-process-orpheus"), 240) as s:
        yield s


def test_the_engine_runs_in_a_child_of_the_component_stub(served):
    pids = _engine_pids(served.log_dir / "tritonserver.log")
    assert len(pids) == 1 and is_running(pids[0]), pids
    parent = process_state(pids[0])[1]
    assert "triton_python_backend_stub" in Path(f"/proc/{parent}/cmdline").read_bytes().decode(errors="replace")
    log = (served.log_dir / "tritonserver.log").read_text(errors="replace")
    assert "ready on cpu" in log
    assert "2 output pumps share the streams" in log


def test_greedy_tokens_through_triton_equal_transformers(served):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(served.checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(served.checkpoint), dtype=torch.float32).eval()
    requests, expected = {}, {}
    for i, prompt in enumerate(PROMPTS):  # 4 running + 4 queued
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        expected[f"p{i}"] = out[0, len(ids):].tolist()
        requests[f"p{i}"] = {"input_ids": ids, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    got = run_stream(served.grpc_url, served.entry, requests)
    for key, want in expected.items():
        assert got[key].error is None, got[key].error
        assert got[key].token_ids == want, key


def test_the_openai_client_streams_a_chat_completion(served):
    client = openai.OpenAI(base_url=served.proxy_url + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(model=served.dep.name, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_random_cancellations_leave_nothing_held(served):
    result = asyncio.run(cancel_fuzz.fuzz(served.proxy_url, served.grpc_url, served.metrics_url, served.dep.name,
                                          served.entry, n=60, concurrency=CAP + QUEUE, seed=11))
    assert not result.errors, result.errors[:5]
    assert sum(result.outcomes.values()) == 60, result.outcomes
    assert not any(result.held_after.values()), result.held_after


def test_orpheus_serves_transformers_tokens_and_snacs_pcm_from_its_engine_process(tts):
    assert len(_engine_pids(tts.log_dir / "tritonserver.log")) == 1  # the LM's; the codec has no engine
    check_served_parity(tts)


def test_orpheus_cancelled_stream_frees_its_pages_and_codec_state(tts):
    # the gauges come from the engine's stats, which it sends every 0.1 s (STATS_S), and are sampled as often
    check_cancel_frees(tts, openai.OpenAI(base_url=tts.proxy_url + "/v1", api_key="none", max_retries=0))
