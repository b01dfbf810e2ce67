"""Qwen3 through a real tritonserver: greedy tokens equal transformers `generate`, alone and 8 at once."""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request

import pytest
import torch

from tests.integration.triton_stream import run_stream

pytestmark = pytest.mark.server

PROMPTS = [
    "Hello there",
    "The quick brown fox jumps over the lazy dog",
    "a",
    "Serving engineers measure time to first token and inter-token latency.",
    "1 2 3 4 5 6 7 8 9 10",
    "What is the capital of France?",
    "GPU",
    "Continuous batching mixes prefill chunks with decodes in one step.",
]
MAX_TOKENS = 24


def transformers_greedy(checkpoint):
    """(tokenizer, {prompt: (prompt ids, transformers' greedy MAX_TOKENS)}) for PROMPTS on `checkpoint`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    expected = {}
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        expected[prompt] = (ids, out[0, len(ids):].tolist())
    return tokenizer, expected


@pytest.fixture(scope="module")
def reference(served):
    return transformers_greedy(served.checkpoint)


def _request(ids):
    return {"input_ids": ids, "max_tokens": MAX_TOKENS, "temperature": 0.0}


def test_greedy_tokens_equal_transformers_one_at_a_time(served, reference):
    _, expected = reference
    for i, prompt in enumerate(PROMPTS[:4]):
        ids, want = expected[prompt]
        got = run_stream(served.grpc_url, served.entry, {f"solo-{i}": _request(ids)})[f"solo-{i}"]
        assert got.error is None
        assert got.token_ids == want, prompt


def test_greedy_tokens_equal_transformers_eight_at_once(served, reference):
    _, expected = reference
    requests = {f"batch-{i}": _request(expected[p][0]) for i, p in enumerate(PROMPTS)}
    got = run_stream(served.grpc_url, served.entry, requests)
    for i, prompt in enumerate(PROMPTS):
        assert got[f"batch-{i}"].error is None
        assert got[f"batch-{i}"].token_ids == expected[prompt][1], prompt
        want_reason = "stop" if len(expected[prompt][1]) < MAX_TOKENS else "length"
        assert got[f"batch-{i}"].finish_reason == want_reason


def test_a_batch_of_other_lengths_and_a_long_output_match_transformers(served, reference):
    """Prompts of 1 to ~200 tokens with max_tokens from 1 to 300 in one batch (rows joining and leaving the steps
    while others decode): each equals transformers' greedy tokens and ends after exactly max_tokens."""
    from transformers import AutoModelForCausalLM

    tokenizer, _ = reference
    model = AutoModelForCausalLM.from_pretrained(str(served.checkpoint), dtype=torch.float32).eval()
    cases = {"one": ("a", 300), "short": (PROMPTS[1], 1), "mid": (PROMPTS[3] * 2, 37), "long": (" ".join(PROMPTS), 90)}
    requests, want = {}, {}
    for name, (prompt, max_tokens) in cases.items():
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None)
        want[name] = out[0, len(ids):].tolist()
        requests[name] = {**_request(ids), "max_tokens": max_tokens, "ignore_eos": True}
    got = run_stream(served.grpc_url, served.entry, requests, timeout=300)
    for name, (_, max_tokens) in cases.items():
        assert got[name].error is None and got[name].finish_reason == "length", name
        assert len(got[name].token_ids) == max_tokens and got[name].token_ids == want[name], name


def test_a_seeded_request_draws_the_same_tokens_alone_and_among_other_batch_mates(served, reference):
    """A seed fixes a request's tokens whatever runs beside it (other seeds, knobs, greedy rows, no seed); other
    seeds draw other tokens."""
    _, expected = reference
    ids = expected[PROMPTS[1]][0]

    def sampled(seed, **knobs):
        return {"input_ids": ids, "max_tokens": 20, "temperature": 1.0, "seed": seed, "ignore_eos": True, **knobs}

    knobs = {"top_k": 20, "top_p": 0.9, "min_p": 0.02, "repetition_penalty": 1.2}
    alone = run_stream(served.grpc_url, served.entry, {"s": sampled(7, **knobs)})["s"].token_ids
    mates = {"s": sampled(7, **knobs), "greedy": _request(expected[PROMPTS[3]][0]), "other": sampled(8),
             "topk": sampled(9, top_k=2, temperature=0.5)}
    unseeded = sampled(0)
    del unseeded["seed"]
    mates["unseeded"] = {**unseeded, "input_ids": expected[PROMPTS[0]][0]}
    got = run_stream(served.grpc_url, served.entry, mates)
    assert all(c.error is None for c in got.values())
    assert got["s"].token_ids == alone and len(alone) == 20
    others = run_stream(served.grpc_url, served.entry, {f"o{seed}": sampled(seed, **knobs) for seed in range(4)})
    assert len({tuple(c.token_ids) for c in others.values()} | {tuple(alone)}) == 5


def test_prompts_sharing_a_long_start_match_transformers_through_the_prefix_cache(served, reference):
    """The deployment's prefix cache is on (the default): prompts that start with the same 70+ tokens, sent one
    after another, take the earlier prompts' pages and prefill only their ends. Greedy tokens still equal
    transformers', which computes every prompt whole."""
    from transformers import AutoModelForCausalLM

    tokenizer, _ = reference
    model = AutoModelForCausalLM.from_pretrained(str(served.checkpoint), dtype=torch.float32).eval()
    system = tokenizer.encode(" ".join(PROMPTS), add_special_tokens=False)
    assert len(system) >= 64  # four pages of 16 or more, shared by every prompt below
    before = _prefix_hit_tokens(served)  # the session's server: earlier tests' repeated prompts hit the cache too
    for i, prompt in enumerate(PROMPTS[:3] + PROMPTS[:1]):  # the last repeats the first exactly
        ids = system + tokenizer.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids):]
        got = run_stream(served.grpc_url, served.entry, {f"shared-{i}": _request(ids)})[f"shared-{i}"]
        assert got.error is None
        assert got.token_ids == want.tolist(), prompt
    expected = 3 * (len(system) // 16) * 16  # the three prompts after the first matched the shared pages
    deadline = time.monotonic() + 30  # the counter is sampled (every 0.1 s), not read at the request
    while (hits := _prefix_hit_tokens(served) - before) < expected:
        assert time.monotonic() < deadline, f"{hits:.0f} prompt tokens hit the prefix cache, expected {expected}"
        time.sleep(0.05)


def _prefix_hit_tokens(served) -> float:
    text = urllib.request.urlopen(served.metrics_url, timeout=5).read().decode()
    return sum(float(v) for v in re.findall(r"^mstar_prefix_cache_hit_tokens_total\{[^}]*\} (\S+)$", text, re.M))


def test_text_input_streams_decoded_text(served, reference):
    tokenizer, expected = reference
    prompt = PROMPTS[1]
    got = run_stream(served.grpc_url, served.entry, {"t": {"text_input": prompt, "max_tokens": MAX_TOKENS,
                                                            "temperature": 0.0}})["t"]
    assert got.token_ids == expected[prompt][1]
    assert got.text == tokenizer.decode(got.token_ids, skip_special_tokens=True)


def test_a_client_that_names_its_outputs_gets_only_those(served, reference):
    """Triton's requested outputs: a client that asks for the token ids alone gets them in every response and none
    of the other outputs (the component builds only what was asked: fewer tensors through the backend's shared
    memory per response); a client that names none gets them all."""
    from mstar_common import wire

    _, expected = reference
    ids, want = expected[PROMPTS[3]]
    every = run_stream(served.grpc_url, served.entry, {"all": _request(ids)})["all"]
    only = run_stream(served.grpc_url, served.entry, {"ids": _request(ids)}, outputs=[wire.TOKEN_IDS])["ids"]
    assert only.token_ids == want and only.output_names == {wire.TOKEN_IDS}
    assert every.token_ids == want and wire.TEXT_OUTPUT in every.output_names


def test_invalid_request_is_refused_and_server_keeps_serving(served, reference):
    _, expected = reference
    got = run_stream(served.grpc_url, served.entry, {"bad": {"input_ids": [1, 2], "temperature": -1.0}})["bad"]
    assert got.error is not None and "invalid_request" in got.error and "temperature" in got.error
    got = run_stream(served.grpc_url, served.entry, {"bad2": {"input_ids": [1], "max_tokens": 10_000}})["bad2"]
    assert "max_tokens" in got.error and "max_model_len" in got.error
    ids, want = expected[PROMPTS[0]]
    assert run_stream(served.grpc_url, served.entry, {"ok": _request(ids)})["ok"].token_ids == want


def test_request_parameters_are_refused_not_dropped(served, reference):
    """Every knob is an input tensor: a gRPC request parameter, or a field of Triton's HTTP generate body that
    names no input (a misspelt knob), is refused naming it instead of being ignored."""
    import json

    import tritonclient.grpc as grpcclient

    from tests.integration.triton_stream import make_inputs

    results = []
    client = grpcclient.InferenceServerClient(served.grpc_url)
    client.start_stream(callback=lambda result, error: results.append(error))
    client.async_stream_infer(served.entry, make_inputs(text_input="hi", max_tokens=2),
                              parameters={"temperature": -5}, enable_empty_final_response=True)
    deadline = time.monotonic() + 30
    while not results and time.monotonic() < deadline:
        time.sleep(0.05)
    client.stop_stream()
    client.close()
    assert results and results[0] is not None and "parameters.temperature: unknown request parameter" in str(results[0])
    url = f"http://127.0.0.1:{served.ports.http}/v2/models/{served.entry}/generate_stream"
    body = json.dumps({"text_input": "hi", "max_tokens": 2, "tempreature": 0.5}).encode()
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30).read()
    assert "parameters.tempreature: unknown request parameter" in info.value.read().decode()
    _, expected = reference
    ids, want = expected[PROMPTS[0]]
    assert run_stream(served.grpc_url, served.entry, {"ok": _request(ids)})["ok"].token_ids == want


def test_tritons_own_fields_of_an_http_generate_body_pass_and_its_timeout_is_the_deadline(served, reference):
    """`id`, `priority` and `timeout` of Triton's HTTP generate body reach the model as request parameters: they were
    refused as unknown, so an HTTP client could set neither its request's id nor its deadline."""
    import json

    url = f"http://127.0.0.1:{served.ports.http}/v2/models/{served.entry}/generate_stream"

    def post(**body) -> str:
        request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.read().decode()
        except urllib.error.HTTPError as error:
            return error.read().decode()

    ok = post(id="http-1", priority=0, timeout=60_000_000, text_input="hi", max_tokens=2, temperature=0.0)
    assert '"finish_reason":"length"' in ok.replace(" ", ""), ok
    expired = post(timeout=1, text_input="hi", max_tokens=64, ignore_eos=True)
    assert "deadline" in expired.lower() and '"finish_reason":"length"' not in expired.replace(" ", ""), expired
