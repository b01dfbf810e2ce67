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


def test_completions_take_a_prompt_as_token_ids(served, oai):
    """A token-id prompt (as vLLM takes it: the ids, or a list holding them) decodes as its text does; a batch, an
    empty list, an id past int32 or past the vocabulary is a 400 naming `prompt`."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(served.checkpoint)("Once upon a time").input_ids
    kwargs = dict(model=served.dep.name, max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    text = oai.completions.create(prompt="Once upon a time", **kwargs)
    for prompt in (ids, [ids]):
        out = oai.completions.create(prompt=prompt, **kwargs)
        assert out.choices[0].text == text.choices[0].text and out.usage.prompt_tokens == len(ids)
    for prompt, rule in (([ids, ids], "batched prompts are not served"), ([], "must not be empty"),
                         ([1, 2**31], "token ids must be in [0, 2147483647]"), ([1, 10**6], "ids must be in [0, ")):
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(prompt=prompt, **kwargs)
        assert info.value.body["param"] == "prompt" and rule in info.value.body["message"], info.value.body


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
    with pytest.raises(openai.BadRequestError) as info:  # a template variable its template never reads
        oai.chat.completions.create(model=served.dep.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    extra_body={"chat_template_kwargs": {"enable_thinkng": False}})
    assert info.value.body["param"] == "chat_template_kwargs.enable_thinkng"


def test_template_control_and_text_that_is_not_unicode_are_400s_at_both_doors(served, oai):
    """A client chat template (arbitrary Jinja run in the component) is refused by the proxy and, for a Triton
    client, by the entry model; a lone surrogate escape is a 400 naming its field; the server keeps serving."""
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}hi"
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=served.dep.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    extra_body={"chat_template_kwargs": {"chat_template": slow}})
    assert info.value.body["param"] == "chat_template_kwargs.chat_template"
    started = time.monotonic()
    got = run_stream(served.grpc_url, served.entry, {"a": {
        "messages": '[{"role": "user", "content": "hi"}]', "chat_template_kwargs": f'{{"chat_template": "{slow}"}}'}})
    assert got["a"].error and "chat_template_kwargs.chat_template: not accepted" in got["a"].error
    assert time.monotonic() - started < 10
    raw = f'{{"model": "{served.dep.name}", "messages": [{{"role": "user", "content": "\\ud800"}}]}}'
    reply = httpx.post(served.proxy_url + "/v1/chat/completions", content=raw.encode(),
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages[0].content"
    assert oai.chat.completions.create(model=served.dep.name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2).choices


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
    level through the proxy, every request complete at its fixed length, each level with the server's own TTFT
    (one sample a request, read from the metrics port); `mstar bench report` tables them."""
    import json

    from mstar_common.cli import main

    out = tmp_path / "runs" / "tiny.json"
    assert main(["bench", "url", "--grpc", served.grpc_url, "--model", served.entry, "--proxy", served.proxy_url,
                 "--name", served.dep.name, "--concurrency", "1", "3", "--rates", "4", "--proxy-concurrency", "2",
                 "--prompt-len", "16", "--output-len", "6", "--poisson-seconds", "1", "--warmup", "1",
                 "--slo-ttft-ms", "60000", "--metrics-port", str(served.ports.metrics), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["deployment"] == json.loads(json.dumps(served.dep.to_dict()))  # read back from the model config
    runs = result["runs"]
    loads = [(run["target"], run.get("concurrency"), run.get("rate")) for run in runs]
    assert loads == [("triton", 1, None), ("triton", 3, None), ("triton", None, 4.0), ("openai", 2, None)]
    for run in runs:
        summary = run["summary"]
        assert summary["num_errors"] == 0 and summary["num_requests"] >= 4, (run["target"], summary)
        assert summary["output_tokens"] == 6 * summary["num_requests"], summary  # ignore_eos: fixed lengths
        assert summary["ttft_ms"]["p50"] > 0 and summary["itl_ms"]["p50"] > 0 and summary["output_tok_per_s"] > 0
        assert summary["slo"]["met"] == summary["num_requests"], summary["slo"]  # a minute to the first token
        assert run["server"]["ttft_samples"] == summary["num_requests"], run["server"]
        assert 0 < run["server"]["ttft_ms_mean"] < summary["ttft_ms"]["mean"], (run["server"], summary["ttft_ms"])
    assert main(["bench", "report", str(out), "--out", str(tmp_path / "report")]) == 0
    table = (tmp_path / "report" / "results.md").read_text()
    assert "| triton | c=3 |" in table and "| openai | c=2 |" in table
    assert "openai c=2: 4/4 requests met TTFT <= 60000 ms (100%)" in table
    assert "- server side, means (arrival at the component -> first token sent; gaps between its sends): triton c=1: " \
        "TTFT " in table
    assert f"Serving: `max_batch_tokens` {served.dep.resources.max_batch_tokens:,};" in table


def test_a_multi_worker_proxy_serves_streams_and_stops(served, tmp_path):
    """`server.proxy_workers: 3` in front of the same tritonserver: three worker processes under one parent share
    the port, concurrent streams all complete with the greedy text of the one-process proxy, /v1/models answers
    alike from every worker, and SIGTERM to the group stops the parent and its workers."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from mstar_common.launcher import Ports, free_port, start_proxy, stop_process, wait_ready

    dep = dataclasses.replace(served.dep, server=dataclasses.replace(served.dep.server, proxy_workers=3))
    ports = Ports(http=served.ports.http, grpc=served.ports.grpc, metrics=served.ports.metrics, proxy=free_port())
    proxy = start_proxy(dep, served.entry, ports, tmp_path / "proxy.log")
    try:
        wait_ready(ports.proxy_health_url, proxy, 60, "proxy")
        children = Path(f"/proc/{proxy.pid}/task/{proxy.pid}/children")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(_workers(children)) < 3:
            time.sleep(0.2)
        workers = _workers(children)
        assert len(workers) == 3, f"worker processes under the proxy: {workers}"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports.proxy}/v1", api_key="none", max_retries=0)
        kwargs = dict(model=dep.name, prompt="Count with me", max_tokens=12, temperature=0,
                      extra_body={"ignore_eos": True})
        expected = openai.OpenAI(base_url=served.proxy_url + "/v1", api_key="none").completions.create(**kwargs)

        def stream(_):
            chunks = client.completions.create(stream=True, **kwargs)
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with ThreadPoolExecutor(12) as pool:
            texts = list(pool.map(stream, range(24)))
        assert texts == [expected.choices[0].text] * 24
        assert len({card.created for _ in range(12) for card in client.models.list().data}) == 1
    finally:
        stop_process(proxy)
    assert proxy.poll() is not None
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers), "a worker outlived its proxy"


def _workers(children_file) -> list[int]:
    """The Python processes under the proxy's parent process, uvicorn's workers (its own helper too: the
    multiprocessing resource tracker is not a worker, so only children that run the app are counted)."""
    pids = [int(pid) for pid in children_file.read_text().split()] if children_file.exists() else []
    return [pid for pid in pids if b"resource_tracker" not in _cmdline(pid)]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_mstar_bench_url_replays_an_input_data_file(served, tmp_path):
    """`--input-data`: the requests of a perf_analyzer file, in order and wrapped round across the warm-ups and
    levels, each decoding its own `max_tokens` (the file's lengths, not --prompt-len/--output-len)."""
    import json

    from mstar_common.cli import main

    lengths = [(8, 3), (20, 5), (13, 4)]  # (prompt tokens, max_tokens)
    data = {"data": [{"input_ids": {"content": list(range(10, 10 + n)), "shape": [n]}, "max_tokens": [m],
                      "ignore_eos": [True], "temperature": [0.0]} for n, m in lengths]}
    (tmp_path / "mixed.json").write_text(json.dumps(data))
    out = tmp_path / "mixed_run.json"
    assert main(["bench", "url", "--grpc", served.grpc_url, "--model", served.entry, "--proxy", served.proxy_url,
                 "--name", served.dep.name, "--input-data", str(tmp_path / "mixed.json"), "--concurrency", "2",
                 "--proxy-concurrency", "1", "--warmup", "1", "--min-requests", "4", "--out", str(out)]) == 0
    triton, proxy = json.loads(out.read_text())["runs"]
    # request indices: warm-up 0; triton level 1-4 (files 1, 2, 0, 1); proxy warm-up 5; proxy level 6-9 (0, 1, 2, 0)
    assert triton["summary"]["output_tokens"] == 5 + 4 + 3 + 5 and triton["summary"]["num_errors"] == 0
    assert proxy["summary"]["output_tokens"] == 3 + 5 + 4 + 3 and proxy["summary"]["num_errors"] == 0
    assert triton["workload"] == {"input_data": str(tmp_path / "mixed.json"), "requests": 3, "prompt_len": [8, 20],
                                  "output_len": [3, 5], "ignore_eos": [True], "temperature": [0.0], "stops": False}
    # the demo's prefix cache is on (unset), so the prompts a target sent before in the run are counted: Triton's
    # file 0 (its warm-up's) and its level's second file 1; the proxy's file 2 (its warm-up's) and its second 0
    # (the proxy's text prompts are not Triton's ids, so what only Triton sent does not count for it)
    assert (triton["repeated_prompts"], proxy["repeated_prompts"]) == (2, 2)


def test_mstar_bench_url_sends_sampled_requests_through_triton_and_the_proxy(served, tmp_path):
    """--temperature/--top-p/--top-k reach both targets as their sampling fields: every request decodes its
    tokens without an error (a field the entry or the proxy refused would count as one), and the report says so."""
    import json

    from mstar_common.cli import main

    out = tmp_path / "sampled.json"
    assert main(["bench", "url", "--grpc", served.grpc_url, "--model", served.entry, "--proxy", served.proxy_url,
                 "--name", served.dep.name, "--prompt-len", "6", "--output-len", "4", "--temperature", "0.8",
                 "--top-p", "0.9", "--top-k", "20", "--concurrency", "2", "--proxy-concurrency", "2", "--warmup", "1",
                 "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [run["target"] for run in runs] == ["triton", "openai"]
    for run in runs:
        assert run["summary"]["num_errors"] == 0 and run["summary"]["output_tokens"] == 4 * 4, run["summary"]
        assert (run["workload"]["temperature"], run["workload"]["top_p"], run["workload"]["top_k"]) == (0.8, 0.9, 20)
    assert main(["bench", "report", str(out), "--out", str(tmp_path / "report")]) == 0
    assert "sampled (temperature 0.8, top_p 0.9, top_k 20)" in (tmp_path / "report" / "results.md").read_text()


def test_mstar_bench_url_names_what_it_cannot_reach(served, tmp_path, capsys):
    from mstar_common.cli import main
    from mstar_common.launcher import free_port

    base = ["bench", "url", "--grpc", served.grpc_url, "--concurrency", "1", "--prompt-len", "4", "--output-len", "2",
            "--out", str(tmp_path / "never.json")]
    assert main([*base, "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert "model 'nope' is not ready on Triton" in err and served.entry in err and "--model" in err
    assert main([*base, "--model", served.entry, "--proxy", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "did not answer /health" in capsys.readouterr().err
    assert main([*base, "--model", served.entry, "--proxy", served.proxy_url]) == 2  # --name left at "model"
    assert f"serves ['{served.dep.name}'], not 'model'; pass the model's name as --name" in capsys.readouterr().err
    assert not (tmp_path / "never.json").exists()
