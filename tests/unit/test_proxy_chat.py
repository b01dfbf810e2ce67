"""/v1/chat/completions against a fake Triton: shapes, SSE framing, knobs on the wire, and every refusal."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from mstar_common import wire
from tests.unit.proxy_fake_triton import make_app

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def served():
    app, fake = make_app()
    with TestClient(app) as client:
        yield client, fake


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": "qwen3", "messages": MESSAGES, **body})


def sse_events(text: str) -> list:
    assert text.endswith("\n\n")
    frames = text.split("\n\n")[:-1]
    assert all(f.startswith("data: ") for f in frames), frames
    return [f[len("data: "):] if f == "data: [DONE]" else json.loads(f[len("data: "):]) for f in frames]


def test_non_stream_chat(served):
    client, fake = served
    r = chat(client, max_tokens=8)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "qwen3"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello, world", "refusal": None}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    rec = fake.requests[-1]
    assert rec.model == "qwen3_llm"
    assert json.loads(rec.tensors[wire.MESSAGES][2][0]) == MESSAGES


def test_stream_chat_framing_and_usage(served):
    client, _ = served
    r = chat(client, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    first, *content, finish, usage_chunk, _ = events
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == "Hello, world"
    assert all(c["object"] == "chat.completion.chunk" and c["choices"][0]["finish_reason"] is None for c in content)
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["choices"][0]["delta"] == {}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["total_tokens"] == 8
    assert len({e["id"] for e in events[:-1]}) == 1
    # OpenAI: with include_usage every other chunk carries "usage": null (clients test for the key)
    assert all("usage" in e and e["usage"] is None for e in [first, *content, finish])


def test_stream_without_include_usage_has_no_usage_chunk(served):
    client, _ = served
    events = sse_events(chat(client, stream=True).text)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert not any("usage" in e for e in events[:-1])


def test_knobs_reach_the_wire(served):
    client, fake = served
    r = chat(client, max_completion_tokens=9, temperature=0, top_p=0.5, seed=3, stop=["a", "b"], top_k=7,
             min_p=0.05, repetition_penalty=1.2, ignore_eos=True, enable_thinking=False, stop_token_ids=[2],
             user="u", metadata={"k": "v"}, store=False, n=1, parallel_tool_calls=False,
             response_format={"type": "text"}, presence_penalty=0, logprobs=False)
    assert r.status_code == 200, r.text
    t = fake.requests[-1].tensors
    assert t["max_tokens"][2][0] == 9 and t["temperature"][2][0] == 0.0 and t["seed"][2][0] == 3
    assert t["top_k"][2][0] == 7 and t["ignore_eos"][2][0]
    assert list(t[wire.STOP][2]) == [b"a", b"b"] and list(t[wire.STOP_TOKEN_IDS][2]) == [2]
    assert json.loads(t[wire.CHAT_TEMPLATE_KWARGS][2][0]) == {"enable_thinking": False}


def test_text_parts_and_developer_role(served):
    client, fake = served
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert client.post("/v1/chat/completions", json={"model": "qwen3", "messages": messages}).status_code == 200
    assert json.loads(fake.requests[-1].tensors[wire.MESSAGES][2][0]) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]


@pytest.mark.parametrize("field, value", [
    ("n", 2), ("logprobs", True), ("logprobs", 0), ("top_logprobs", 2), ("logit_bias", {"1": 5}),
    ("presence_penalty", 0.5),
    ("frequency_penalty", 1), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"), ("functions", [{"name": "f"}]), ("response_format", {"type": "json_object"}),
    ("store", True), ("audio", {"voice": "x"}), ("modalities", ["text", "audio"]), ("service_tier", "flex"),
    ("service_tier", "garbage"),
])
def test_unsupported_fields_are_400_naming_the_field(served, field, value):
    client, fake = served
    r = chat(client, **{field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field and field in error["message"]
    assert fake.requests == []


@pytest.mark.parametrize("body, field", [
    ({"temperature": "0.5"}, "temperature"), ({"max_tokens": 1.5}, "max_tokens"), ({"seed": True}, "seed"),
    ({"stream": "yes"}, "stream"), ({"stop": 5}, "stop"), ({"top_k": None, "messages": "hi"}, "messages"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),  # was sent as an empty turn
])
def test_wrong_types_are_400_naming_the_field(served, body, field):
    client, _ = served
    r = chat(client, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(field)


@pytest.mark.parametrize("body, field, rule", [
    ({"top_p": 0}, "top_p", "(0, 1]"), ({"temperature": -1}, "temperature", ">= 0"),
    ({"max_tokens": 0}, "max_tokens", "[1,"), ({"seed": 2**63}, "seed", "]"), ({"top_k": 2**31}, "top_k", "]"),
    ({"top_k": -2}, "top_k", "[-1,"),
    ({"min_p": 1.0}, "min_p", "[0, 1)"), ({"repetition_penalty": 0}, "repetition_penalty", ">= 0.001"),
])
def test_out_of_range_knobs_use_the_server_rules(served, body, field, rule):
    client, _ = served
    r = chat(client, **body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == field and rule in r.json()["error"]["message"]


def test_unknown_field_and_bad_json(served):
    client, _ = served
    r = chat(client, frobnicate=1)
    assert r.status_code == 400 and r.json()["error"]["message"] == "unknown field 'frobnicate'"
    r = client.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert r.status_code == 400 and r.json()["error"]["message"] == "'model' is required"


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:,"}},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])
def test_media_parts_to_a_text_model_are_400(served, part):
    client, fake = served
    r = client.post("/v1/chat/completions", json={"model": "qwen3", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "see"}, part]}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[0].content[1]" and "text-only" in r.json()["error"]["message"]
    assert fake.requests == []


def test_tool_messages_empty_messages_and_thinking_conflict(served):
    client, _ = served
    r = client.post("/v1/chat/completions", json={"model": "qwen3", "messages": [
        {"role": "tool", "content": "x", "tool_call_id": "1"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
    r = client.post("/v1/chat/completions", json={"model": "qwen3", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = chat(client, enable_thinking=True, chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "enable_thinking"
    r = chat(client, max_tokens=3, max_completion_tokens=4)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


def test_unknown_model_is_404(served):
    client, fake = served
    r = client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MESSAGES})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and "gpt-9" in r.json()["error"]["message"]
    assert fake.requests == []


def test_an_assistant_reply_sent_back_as_the_sdk_dumps_it_is_accepted(served):
    """`message.model_dump()` of a reply carries refusal/audio/annotations as nulls: they were 400s as unknown
    fields. A refusal (a string, or refusal parts) is the assistant's text; a real audio reply is refused."""
    client, fake = served
    reply = {"role": "assistant", "content": "Hi there", "refusal": None, "audio": None, "annotations": None,
             "function_call": None, "tool_calls": None}
    refused = {"role": "assistant", "content": None, "refusal": "I can't"}
    parts = {"role": "assistant", "content": [{"type": "refusal", "refusal": "No"}]}
    r = chat(client, messages=[*MESSAGES, reply, refused, parts, {"role": "user", "content": "again"}],
             service_tier="auto")
    assert r.status_code == 200, r.text
    sent = json.loads(fake.requests[-1].tensors[wire.MESSAGES][2][0])
    assert [m["content"] for m in sent] == ["Hi", "Hi there", "I can't", "No", "again"]
    for message, field in (({**reply, "audio": {"id": "a1"}}, "messages[1].audio"),
                           ({**reply, "refusal": "x"}, "messages[1].refusal"),
                           ({"role": "user", "content": [{"type": "refusal", "refusal": "x"}]},
                            "messages[1].content[0]")):
        r = chat(client, messages=[*MESSAGES, message])
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
