"""The OpenAI proxy and the SDK against a real tritonserver serving the tiny Qwen3."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import httpx
import openai
import pytest

from mstar import MStarClient
from tests.integration.triton_stream import run_stream

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served.proxy_url + "/v1", api_key="none", max_retries=0)


def _metric(served, name: str) -> float:
    text = urllib.request.urlopen(served.metrics_url, timeout=5).read().decode()
    values = [float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)]
    assert values, f"{name} not exported"
    return sum(values)


def _wait_pages_free(served, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _metric(served, "mstar_kv_pages_used") == 0 and _metric(served, "mstar_kv_pages_reserved") == 0:
            return
        time.sleep(0.05)
    raise AssertionError("KV pages still held after the request ended")


def test_models_and_health(served, oai):
    assert [m.id for m in oai.models.list().data] == [served.dep.name]
    assert httpx.get(served.proxy_url + "/health").status_code == 200


def test_chat_non_stream_greedy_matches_stream(served, oai):
    messages = [{"role": "user", "content": "Tell me about GPUs"}]
    whole = oai.chat.completions.create(model=served.dep.name, messages=messages, max_tokens=20, temperature=0)
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens >= 1 and whole.usage.prompt_tokens > 5
    chunks = oai.chat.completions.create(
        model=served.dep.name, messages=messages, max_tokens=20, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


def test_seeded_sampling_is_reproducible_and_knobs_pass(served, oai):
    kwargs = dict(model=served.dep.name, messages=[{"role": "user", "content": "hi"}], max_tokens=16,
                  temperature=0.9, top_p=0.9, seed=1234, extra_body={"top_k": 50, "repetition_penalty": 1.1})
    first = oai.chat.completions.create(**kwargs).choices[0].message.content
    assert oai.chat.completions.create(**kwargs).choices[0].message.content == first


def test_completions_max_tokens_and_length(served, oai):
    out = oai.completions.create(model=served.dep.name, prompt="Once upon a time", max_tokens=7,
                                 temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 7


def test_bad_fields_are_400s_naming_the_field(served, oai):
    base = dict(model=served.dep.name, messages=[{"role": "user", "content": "hi"}])
    cases = [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 2}, "n"),
             ({"max_tokens": 100_000}, "max_tokens"), ({"logit_bias": {"1": 2}}, "logit_bias")]
    for extra, field in cases:
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(**base, **extra)
        assert field in str(info.value), (field, str(info.value))
    assert oai.chat.completions.create(**base, max_tokens=2).choices  # still serving


def test_the_entry_models_refusals_name_the_openai_fields(served, oai):
    """The entry model refuses a prompt by its own input names (text_input, prompt); the proxy's 400 names the
    field the OpenAI client sent, as the message's start and as `param`."""
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=served.dep.name, prompt="a" * (1 << 20), max_tokens=2)
    assert info.value.body["param"] == "prompt" and info.value.body["message"].startswith("prompt: 1048576 bytes")
    long_chat = [{"role": "user", "content": " the" * served.dep.resources.max_model_len}]
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=served.dep.name, messages=long_chat, max_tokens=2)
    assert info.value.body["param"] == "messages" and "leave no room for output" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=served.dep.name, prompt="hi", max_tokens=100_000)
    assert info.value.body["param"] == "max_tokens"


def test_stop_string_ends_the_stream_and_frees_pages(served, oai):
    whole = oai.completions.create(model=served.dep.name, prompt="abc", max_tokens=40, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text
    stop = whole[5:8]
    assert stop.strip(), "degenerate sample"
    cut = oai.completions.create(model=served.dep.name, prompt="abc", max_tokens=40, temperature=0,
                                 stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == whole[: whole.index(stop)]
    _wait_pages_free(served)


def _wait_pages_held(served, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while _metric(served, "mstar_kv_pages_used") == 0:
        assert time.monotonic() < deadline, "the request never showed up in the KV metrics"
        time.sleep(0.02)


def _cancel_count(served) -> int:
    return (served.log_dir / "tritonserver.log").read_text().count("client cancelled")


def test_client_disconnect_frees_pages(served):
    body = {"model": served.dep.name, "prompt": "x", "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": True}
    cancels = _cancel_count(served)
    with httpx.stream("POST", served.proxy_url + "/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()  # keep a reference: a collected httpx iterator closes the response
        next(lines)
        _wait_pages_held(served)
    _wait_pages_free(served)
    assert _cancel_count(served) == cancels + 1


def test_tritonclient_stream_cancel_frees_pages(served):
    import tritonclient.grpc as grpcclient

    from tests.integration.triton_stream import make_inputs

    client = grpcclient.InferenceServerClient(served.grpc_url)
    got = threading.Event()
    client.start_stream(callback=lambda result, error: got.set())
    cancels = _cancel_count(served)
    client.async_stream_infer(served.entry, make_inputs(text_input="hello", max_tokens=480, ignore_eos=True))
    assert got.wait(30)
    _wait_pages_held(served)
    client.stop_stream(cancel_requests=True)
    client.close()
    _wait_pages_free(served)
    assert _cancel_count(served) == cancels + 1


def test_sdk_chat_stream_and_whole(served):
    with MStarClient(served.proxy_url) as client:
        whole = client.chat("hello", max_tokens=12, temperature=0)
        streamed = "".join(ev.text or "" for ev in client.chat("hello", stream=True, max_tokens=12, temperature=0))
    assert whole.text == streamed and whole.finish_reason in ("stop", "length")


def test_eight_concurrent_chats_through_the_proxy(served, oai):
    prompts = [f"prompt number {i}" for i in range(8)]
    solo = {p: oai.completions.create(model=served.dep.name, prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in prompts}
    results: dict[str, str] = {}

    def call(p):
        results[p] = oai.completions.create(model=served.dep.name, prompt=p, max_tokens=12,
                                            temperature=0).choices[0].text

    threads = [threading.Thread(target=call, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == solo
    after = run_stream(served.grpc_url, served.entry, {"after": {"text_input": "ok", "max_tokens": 2}})["after"]
    assert after.error is None


def test_mstar_bench_url_measures_a_running_server(served, tmp_path):
    """`mstar bench url` against the real server: closed-loop and Poisson levels through Triton, a closed-loop
    level through the proxy, every request complete at its fixed length; `mstar bench report` tables them."""
    import json

    from mstar_common.cli import main

    out = tmp_path / "runs" / "tiny.json"
    assert main(["bench", "url", "--grpc", served.grpc_url, "--model", served.entry, "--proxy", served.proxy_url,
                 "--name", served.dep.name, "--concurrency", "1", "3", "--rates", "4", "--proxy-concurrency", "2",
                 "--prompt-len", "16", "--output-len", "6", "--poisson-seconds", "1", "--warmup", "1",
                 "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    loads = [(run["target"], run.get("concurrency"), run.get("rate")) for run in runs]
    assert loads == [("triton", 1, None), ("triton", 3, None), ("triton", None, 4.0), ("openai", 2, None)]
    for run in runs:
        summary = run["summary"]
        assert summary["num_errors"] == 0 and summary["num_requests"] >= 4, (run["target"], summary)
        assert summary["output_tokens"] == 6 * summary["num_requests"], summary  # ignore_eos: fixed lengths
        assert summary["ttft_ms"]["p50"] > 0 and summary["itl_ms"]["p50"] > 0 and summary["output_tok_per_s"] > 0
    assert main(["bench", "report", str(out), "--out", str(tmp_path / "report")]) == 0
    table = (tmp_path / "report" / "results.md").read_text()
    assert "| triton | c=3 |" in table and "| openai | c=2 |" in table
