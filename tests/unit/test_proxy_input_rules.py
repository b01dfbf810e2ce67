"""Input rules found by a black-box sweep of the proxy (2026-12-05): each was a 500, a silently wrapped or ignored
value, a hang of the component's intake, or a 400 that named no field. Against a fake Triton; each test fails on
the code before its fix."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from mstar_common import wire
from mstar_common.proxy.app import ServedModel
from tests.unit.proxy_fake_triton import FakeTriton, make_app
from tests.unit.test_proxy_chat import MESSAGES, chat, sse_events
from tests.unit.test_proxy_images import MODEL as IMAGE_MODEL
from tests.unit.test_proxy_images import image_script
from tests.unit.test_proxy_transcriptions import script as transcript_script

WHISPER = ServedModel("whisper", "whisper_walk", "transcription")
WAV = {"file": ("a.wav", b"RIFF....", "audio/wav")}


@pytest.fixture
def served():
    app, fake = make_app()
    with TestClient(app) as client:
        yield client, fake


def error_of(reply) -> dict:
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


# chat_template_kwargs: template variables only, never the template or the call's own arguments


@pytest.mark.parametrize("kwargs, param", [
    ({"chat_template": "{% for i in range(10**9) %}{% endfor %}"}, "chat_template_kwargs.chat_template"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"tokenize": True}, "chat_template_kwargs.tokenize"),
    ({"documents": 5}, "chat_template_kwargs.documents"),
    ({"enable_thinking": "yes"}, "chat_template_kwargs.enable_thinking"),
    ({"persona": {"nested": 1}}, "chat_template_kwargs.persona"),
    ({"persona": "x" * 1025}, "chat_template_kwargs.persona"),
    ({"_private": 1}, "chat_template_kwargs"),
    ({f"k{i}": i for i in range(17)}, "chat_template_kwargs"),
])
def test_template_kwargs_that_are_not_plain_variables_are_400(served, kwargs, param):
    client, fake = served
    error = error_of(chat(client, chat_template_kwargs=kwargs))
    assert error["param"] == param and error["message"].startswith(param)
    assert fake.requests == []
    error = error_of(client.post("/generate", json={"model": "qwen3", "text": "hi",
                                                    "model_kwargs": {"chat_template_kwargs": kwargs}}))
    assert error["param"] == f"model_kwargs.{param}"
    assert fake.requests == []


def test_plain_template_variables_still_reach_the_wire(served):
    client, fake = served
    assert chat(client, chat_template_kwargs={"enable_thinking": False, "persona": "terse", "n": 2}).status_code == 200
    sent = json.loads(fake.requests[-1].tensors[wire.CHAT_TEMPLATE_KWARGS][2][0])
    assert sent == {"enable_thinking": False, "persona": "terse", "n": 2}


def test_null_means_unset_on_generate_as_protocol_says(served):
    """A null `streaming`, `model_kwargs` or `model_kwargs.return_token_ids` was a 400 on the text and speech
    models' /generate ("Input should be a valid boolean"), where the image models' took it as unset."""
    client, fake = served
    for body in ({"streaming": None}, {"model_kwargs": None}, {"model_kwargs": {"return_token_ids": None}}):
        reply = client.post("/generate", json={"model": "qwen3", "text": "hi", **body})
        assert reply.status_code == 200, (body, reply.text)
    assert len(fake.requests) == 3


def test_a_template_variable_that_is_not_a_finite_number_is_refused(served):
    """NaN and Infinity went on to the wire as JSON no other parser reads (RFC 8259 has no such numbers)."""
    client, fake = served
    for raw in ("NaN", "-Infinity"):
        body = '{"model": "qwen3", "messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"w": %s}}'
        error = error_of(client.post("/v1/chat/completions", content=(body % raw).encode(),
                                     headers={"content-type": "application/json"}))
        assert "chat_template_kwargs.w: must be a finite number" in error["message"], error
    assert fake.requests == []


def test_the_component_applies_the_same_rule_and_turns_template_errors_into_its_refusals():
    from mstar_common.families.qwen3.tiny import build_tokenizer
    from mstar_common.families.text import chat_prompt_ids

    tokenizer = build_tokenizer()  # a real PreTrainedTokenizerFast; its template raises as real ones do
    tokenizer.chat_template = ("{%- if messages[-1]['role'] != 'user' -%}{{ raise_exception('last turn must be the "
                               "user') }}{%- endif -%}{{ messages[-1]['content'] * (100 // width) }}")
    with pytest.raises(ValueError, match=r"^chat_template_kwargs\.chat_template: not accepted"):
        wire.check_chat_template_kwargs({"chat_template": "x"})
    with pytest.raises(ValueError, match=r"^messages: the checkpoint's chat template refused this request: last"):
        chat_prompt_ids(tokenizer, [{"role": "assistant", "content": "a"}], {"width": 50})
    with pytest.raises(ValueError, match=r"^messages: the checkpoint's chat template refused this request"):
        chat_prompt_ids(tokenizer, MESSAGES, {"width": 0})
    assert tokenizer.decode(chat_prompt_ids(tokenizer, MESSAGES, {"width": 50})) == "HiHi"


def test_a_bos_adding_tokenizer_gets_one_bos_in_a_chat_and_in_a_text_prompt():
    """A Llama-3 tokenizer adds <|begin_of_text|> to whatever it encodes, and its chat template writes one too: the
    rendered chat encoded with the tokenizer's special tokens would start with two (the tiny checkpoints' ChatML
    tokenizer adds none, so no other test would see it). Ids equal transformers' apply_chat_template's."""
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from mstar_common.families.qwen3.tiny import CORPUS
    from mstar_common.families.text import TextLMRuntime, chat_prompt_ids

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    bpe.train_from_iterator(CORPUS.splitlines(), trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = bpe.token_to_id("<|begin_of_text|>")
    bpe.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[(specials[0], bos)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=specials[0], eos_token="<|eot_id|>")
    tokenizer.chat_template = (
        "{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + "
        "m['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ours = chat_prompt_ids(tokenizer, messages, {})
    theirs = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
    assert ours == theirs and ours.count(bos) == 1 and ours[0] == bos
    runtime = TextLMRuntime(engine=None, tokenizer=tokenizer, vocab_size=448, max_model_len=256,
                            default_max_tokens=None)
    text = runtime._prompt_ids({wire.TEXT_INPUT: np.array([b"Hello there"], dtype=object)})
    assert text[0] == bos and text.count(bos) == 1 and text[1:] == tokenizer.encode("Hello there",
                                                                                   add_special_tokens=False)


def test_a_developer_message_sent_to_the_component_is_rendered_as_the_system_message():
    """The `messages` tensor took `developer` and handed it to the template as it was: Qwen3's, which has branches
    for system, user, assistant and tool only, dropped the message without a word (the proxy maps it already)."""
    from mstar_common.families.qwen3.tiny import build_tokenizer
    from mstar_common.families.text import chat_prompt_ids

    tokenizer = build_tokenizer()
    tokenizer.chat_template = ("{%- for m in messages -%}{%- if m.role in ['system', 'user', 'assistant'] -%}"
                               "{{ m.role }}: {{ m.content }};{%- endif -%}{%- endfor -%}")
    developer = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    system = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    assert chat_prompt_ids(tokenizer, developer, {}) == chat_prompt_ids(tokenizer, system, {})
    assert tokenizer.decode(chat_prompt_ids(tokenizer, developer, {})) == "system: Answer in French.;user: Hi;"
    assert developer[0]["role"] == "developer"  # the caller's list is left as it was


def test_a_participant_name_the_template_drops_is_refused_and_one_it_uses_is_served():
    """`messages[i].name` reached the template, which (Qwen3's) drops it: the name was ignored without a word."""
    from mstar_common.families.qwen3.tiny import build_tokenizer
    from mstar_common.families.text import chat_prompt_ids

    tokenizer = build_tokenizer()
    named = [{"role": "user", "content": "Hi", "name": "alice"}]
    with pytest.raises(ValueError, match=r"^messages\[0\]\.name: this checkpoint's chat template does not use "
                                         r"participant names"):
        chat_prompt_ids(tokenizer, named, {})
    tokenizer.chat_template = "{% for m in messages %}{{ m.get('name', m['role']) }}: {{ m['content'] }};{% endfor %}"
    assert tokenizer.decode(chat_prompt_ids(tokenizer, named, {})) == "alice: Hi;"
    for key, rule in (("tool_calls", "tool calling is not available"), ("reasoning_content", "a message is its role")):
        with pytest.raises(ValueError, match=rf"^messages\[0\]\.{key}: not accepted \({rule}"):
            chat_prompt_ids(tokenizer, [{"role": "user", "content": "Hi", key: []}], {})
    with pytest.raises(ValueError) as refused:  # a direct client's key, quoted escaped (TritonError takes UTF-8)
        chat_prompt_ids(tokenizer, [{"role": "user", "content": "Hi", "x\ud800\n": []}], {})
    assert str(refused.value).startswith("messages[0].x\\ud800\\n: not accepted")


# lone UTF-16 surrogates: valid JSON, not text


@pytest.mark.parametrize("raw, param", [
    ('{"model": "qwen3", "messages": [{"role": "user", "content": "\\ud800x"}]}', "messages[0].content"),
    ('{"model": "qwen3", "messages": [{"role": "user", "content": "a"}], "stop": ["\\udfff"]}', "stop[0]"),
    ('{"model": "\\ud83d", "messages": []}', "model"),
    ('{"model": "qwen3", "messages": [], "chat_template_kwargs": {"\\ud800": 1}}', "chat_template_kwargs"),
])
def test_a_lone_surrogate_is_400_naming_the_field(served, raw, param):
    client, fake = served
    error = error_of(client.post("/v1/chat/completions", content=raw.encode(),
                                 headers={"content-type": "application/json"}))
    assert error["param"] == param and "surrogate" in error["message"]
    assert fake.requests == []


@pytest.mark.parametrize("path, raw", [
    ("/v1/chat/completions", b'{"model": "qwen3", "messages": [{"role": "user", "content": "hi\xed\xa0\x80"}]}'),
    ("/v1/chat/completions",  # a pair in CESU-8 (Java's "modified UTF-8"): json.loads joins it, UTF-8 does not
     b'{"model": "qwen3", "messages": [{"role": "user", "content": "\xed\xa0\xbd\xed\xb8\x80"}]}'),
    ("/v1/completions", b'{"model": "qwen3", "prompt": "a\xed\xa0\x80"}'),
    ("/v1/chat/completions", b'{"model": "qwen3\xed\xa0\x80", "messages": []}'),
    ("/v1/chat/completions",
     '{"model": "qwen3", "messages": [{"role": "user", "content": "\\ud800"}]}'.encode("utf-16-le")),
    ("/v1/chat/completions", b'{"model": "qwen3", "messages": [{"role": "user", "content": "hi\xff"}]}'),
    ("/generate", b'{"model": "qwen3", "text": "hi\xed\xa0\x80"}'),
])
def test_a_body_that_is_not_utf8_is_400_not_a_server_error(served, path, raw):
    """Python's json reads CESU-8's encoded surrogates and UTF-16 bodies, which carried lone surrogates past the
    escape search to the first encode (a 500); invalid UTF-8 got a 400 blaming nesting depth or long numbers."""
    client, fake = served
    error = error_of(client.post(path, content=raw, headers={"content-type": "application/json"}))
    assert "not UTF-8 text" in error["message"], error
    assert fake.requests == []
    reply = client.post("/v1/chat/completions", headers={"content-type": "application/json"},
                        content='{"model": "qwen3", "messages": [{"role": "user", "content": "é 😀"}]}'.encode())
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("content_type", ["text/plain", "application/octet-stream"])
@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_a_generate_body_of_another_content_type_must_be_utf8_too(served, content_type, encoding):
    """/generate reads a body of any content type as JSON, where json.loads took UTF-16 and UTF-32 itself: a lone
    surrogate in it reached the first encode (a 500), and one without went through (200), against api.md's rule."""
    client, fake = served
    for text in ("hi\ud800", "héllo"):
        raw = json.dumps({"model": "qwen3", "text": text}, ensure_ascii=False).encode(encoding, "surrogatepass")
        error = error_of(client.post("/generate", content=raw, headers={"content-type": content_type}))
        assert "not UTF-8 text" in error["message"], error
    assert fake.requests == []
    raw = "\ufeff" + json.dumps({"model": "qwen3", "text": "héllo"}, ensure_ascii=False)  # a UTF-8 BOM is fine
    reply = client.post("/generate", content=raw.encode(), headers={"content-type": content_type})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("form", [False, True])
@pytest.mark.parametrize("fields, param", [
    ({"model_kwargs": json.dumps({"messages": [{"role": "user", "content": "a\ud800b"}]})},
     "model_kwargs.messages[0].content"),
    ({"text": "hi", "model_kwargs": json.dumps({"stop": ["x", "\udfff"]})}, "model_kwargs.stop[1]"),
    ({"text": "hi", "model_kwargs": json.dumps({"chat_template_kwargs": {"\ud800": 1}})},
     "model_kwargs.chat_template_kwargs"),
])
def test_a_lone_surrogate_in_model_kwargs_sent_as_a_string_is_400_naming_it(served, fields, param, form):
    """A JSON string of model_kwargs (as a form always sends it) holds its escapes one level down, past the body's
    check: the lone surrogate reached the first encode, a 500."""
    client, fake = served
    reply = client.post("/generate", data=fields) if form else client.post("/generate", json=fields)
    error = error_of(reply)
    assert error["param"] == param and "surrogate" in error["message"], error
    assert fake.requests == []


def test_a_generate_body_of_another_content_type_naming_a_surrogate_model_is_400(served):
    """/generate's look-up of the model a body names read it with a bare json.loads: a lone surrogate there (in a
    text/plain body, past the middleware's JSON check) went into the 404's message, whose encode failed: a 500."""
    client, fake = served
    raw = b'{"model": "\\ud800", "text": "hi"}'
    error = error_of(client.post("/generate", content=raw, headers={"content-type": "text/plain"}))
    assert error["param"] == "model" and "surrogate" in error["message"], error
    assert fake.requests == []


def test_a_content_type_sent_twice_is_read_as_the_routes_read_it(served):
    """The middleware kept a header's last value, the routes its first: `application/json` then `text/plain` skipped
    the body's text check while FastAPI still read it as JSON, and its lone surrogate reached the first encode."""
    client, fake = served
    raw = b'{"model": "qwen3", "prompt": "hi \\ud800"}'
    error = error_of(client.post("/v1/completions", content=raw,
                                 headers=[("content-type", "application/json"), ("content-type", "text/plain")]))
    assert error["param"] == "prompt" and "surrogate" in error["message"], error
    assert fake.requests == []


def _two_fields(boundary: str, text: bytes) -> bytes:
    return (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nqwen3\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"text\"\r\n\r\n").encode() + text + (
            f"\r\n--{boundary}--\r\n").encode()


@pytest.mark.parametrize("charset, text", [("unicode_escape", b"\\ud800"), ("utf-7", b"+2AA-"),
                                           ("latin-1", b"caf\xe9")])
def test_a_multipart_body_in_another_charset_is_400(served, charset, text):
    """Starlette decodes a multipart body's names and fields in the charset its Content-Type names: utf-7 and
    unicode_escape made lone surrogates of ASCII (a 500 at the first encode, in a field's value or its name)."""
    client, fake = served
    boundary = "b0undary"
    body = _two_fields(boundary, text)
    headers = {"content-type": f"multipart/form-data; boundary={boundary}; charset={charset}"}
    error = error_of(client.post("/generate", content=body, headers=headers))
    assert f"charset must be utf-8, not '{charset}'" in error["message"], error
    assert fake.requests == []
    headers = {"content-type": f"multipart/form-data; boundary={boundary}; charset=UTF-8"}
    assert client.post("/generate", content=body.replace(text, b"hi"), headers=headers).status_code == 200


def test_an_error_quoting_a_lone_surrogate_is_rendered():
    from mstar_common.proxy.errors import APIError

    error = APIError(404, "model 'x\ud800' is not served", param="model.\udfff")
    body = json.loads(error.response().body)["error"]  # (its encode raised: a 500 in place of the 404)
    assert body["message"] == "model 'x\\ud800' is not served" and body["param"] == "model.\\udfff"


def test_a_surrogate_pair_and_an_escaped_backslash_are_text(served):
    client, fake = served
    raw = '{"model": "qwen3", "messages": [{"role": "user", "content": "\\ud83d\\ude00 \\\\ud800"}]}'
    reply = client.post("/v1/chat/completions", content=raw.encode(), headers={"content-type": "application/json"})
    assert reply.status_code == 200, reply.text
    assert json.loads(fake.requests[-1].tensors[wire.MESSAGES][2][0])[0]["content"] == "\U0001F600 \\ud800"


# numbers the wire's tensors cannot hold


@pytest.mark.parametrize("body, param, shown", [
    # a value that breaks the rule as sent is refused as sent, without a word of rounding
    ({"temperature": 1e39}, "temperature", "must be <= 100.0, got 1e+39"),
    ({"temperature": 150.3}, "temperature", "must be <= 100.0, got 150.3"),
    ({"repetition_penalty": 1e-50}, "repetition_penalty", "must be >= 0.001 (1.0 is off), got 1e-50"),
    ({"top_p": 1e-46}, "top_p", "send a larger value"),  # (not "send 0": 0 is outside top_p's rule)
    ({"temperature": 1e-46}, "temperature", "1e-46 is 0 as a 32-bit float (the smallest non-zero is about 1.4e-45); "
                                            "send 0 or a larger value"),  # was served greedily
    ({"min_p": 0.99999999999}, "min_p", "0.99999999999 was sent"),
    ({"top_p": 1.00000001}, "top_p", "got 1.00000001"),  # 1.0 as 32 bits: was served as top_p 1
    ({"stop": [f"s{i}" for i in range(17)]}, "stop", "at most 16"),
    ({"stop": ["x" * 300]}, "stop", "at most 256 characters"),
    ({"max_completion_tokens": -3}, "max_completion_tokens", "got -3"),
])
def test_knobs_are_checked_as_the_server_holds_them(served, body, param, shown):
    client, fake = served
    error = error_of(chat(client, **body))
    assert error["param"] == param and error["message"].startswith(f"{param}: ") and shown in error["message"]
    assert ("was sent" in error["message"]) == ("was sent" in shown)
    assert fake.requests == []


def test_a_nan_knob_is_not_said_to_be_rounded(served):
    client, fake = served
    body = b'{"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    error = error_of(client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}))
    assert error["param"] == "temperature" and error["message"] == "temperature: must be finite, got nan"
    assert fake.requests == []


def test_generate_names_its_knobs_under_model_kwargs(served):
    client, _ = served
    error = error_of(client.post("/generate", json={"model": "qwen3", "text": "hi",
                                                    "model_kwargs": {"temperature": -1}}))
    assert error["param"] == "model_kwargs.temperature" and error["message"].startswith("model_kwargs.temperature:")


@pytest.mark.parametrize("body, param", [
    ({"n": 2**32 + 1}, "n"), ({"num_inference_steps": 2**32 + 1}, "num_inference_steps"),
    ({"seed": 2**63}, "seed"),
])
def test_image_integers_that_would_wrap_are_400(body, param):  # (a size's digits are bounded by its own pattern)
    app, fake = make_app(FakeTriton(script=image_script()), models=[IMAGE_MODEL])
    client = TestClient(app)
    error = error_of(client.post("/v1/images/generations", json={"model": "klein", "prompt": "a cat", **body}))
    assert error["param"] == param and str(list(body.values())[0]) in error["message"]
    assert f"must be in [{0 if param == 'seed' else 1}, " in error["message"]
    error = error_of(client.post("/generate", json={"model": "klein", "text": "a cat", "model_kwargs": body}))
    assert error["param"] == f"model_kwargs.{param}"
    assert fake.requests == []


@pytest.mark.parametrize("data, param", [
    ({"max_tokens": str(2**32 + 5)}, "max_tokens"), ({"seed": str(2**63)}, "seed"),
    ({"temperature": "1e39"}, "temperature"),
])
def test_transcription_numbers_that_would_wrap_are_400(data, param):
    app, fake = make_app(FakeTriton(script=transcript_script()), models=[WHISPER])
    client = TestClient(app)
    error = error_of(client.post("/v1/audio/transcriptions", data={"model": "whisper", **data}, files=WAV))
    assert error["param"] == param
    value = json.loads(data[param])
    error = error_of(client.post("/generate", data={"model": "whisper", "model_kwargs": json.dumps({param: value})},
                                 files={"audio": WAV["file"]}))
    assert error["param"] == f"model_kwargs.{param}"
    assert fake.requests == []


# stream_options and stream


def test_stream_options_need_a_stream_and_continuous_usage_needs_usage(served):
    client, fake = served
    error = error_of(chat(client, stream_options={"include_usage": True}))
    assert error["param"] == "stream_options"
    error = error_of(chat(client, stream=True, stream_options={"continuous_usage_stats": True}))
    assert error["param"] == "stream_options.continuous_usage_stats"
    assert fake.requests == []


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "Hi"}),
])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(served, route, body):
    client, _ = served
    reply = client.post(route, json={"model": "qwen3", "stream": True, **body,
                                     "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = sse_events(reply.text)[:-1]
    *chunks, finish, total = events
    text_chunks = [c for c in chunks if c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text")]
    assert text_chunks and all("usage" in c for c in text_chunks)
    counts = [c["usage"]["completion_tokens"] for c in text_chunks]
    assert counts == sorted(counts) and counts[-1] <= finish["usage"]["completion_tokens"]
    assert finish["usage"] == total["usage"] and total["choices"] == []


def test_stream_null_means_not_streamed(served):
    client, _ = served
    reply = chat(client, stream=None)
    assert reply.status_code == 200 and reply.json()["object"] == "chat.completion"


# bodies that are not a JSON object


def test_a_form_or_empty_body_says_what_the_route_takes(served):
    client, _ = served
    body = json.dumps({"model": "qwen3", "messages": MESSAGES})
    error = error_of(client.post("/v1/chat/completions", content=body.encode(),
                                 headers={"content-type": "application/x-www-form-urlencoded"}))
    assert "content-type: application/json" in error["message"]
    error = error_of(client.post("/v1/chat/completions"))
    assert "content-type: application/json" in error["message"] and "''" not in error["message"]


# form fields that are not UTF-8 (Starlette would decode them as latin-1 or with U+FFFD, silently)


def test_a_form_field_that_is_not_utf8_is_400_and_utf8_text_passes(served):
    client, fake = served
    boundary = "b0undary"

    def multipart(text: bytes) -> bytes:
        return (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nqwen3\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"text\"\r\n\r\n").encode() + text + (
                f"\r\n--{boundary}--\r\n").encode()

    headers = {"content-type": f"multipart/form-data; boundary={boundary}"}
    error = error_of(client.post("/generate", content=multipart(b"caf\xe9 \xff"), headers=headers))
    assert error["param"] == "text" and "UTF-8" in error["message"]
    form = {"content-type": "application/x-www-form-urlencoded"}
    error = error_of(client.post("/generate", content=b"model=qwen3&text=caf%E9", headers=form))
    assert error["param"] == "text"
    assert fake.requests == []
    error = error_of(client.post("/generate", content=b"model=qwen3&text=hi\xff", headers=form))
    assert error["param"] == "text"
    for reply in (client.post("/generate", content=multipart("café ✓".encode()), headers=headers),
                  client.post("/generate", content=b"model=qwen3&text=caf%C3%A9+%E2%9C%93", headers=form),
                  client.post("/generate", content="model=qwen3&text=café ✓".encode(), headers=form)):
        assert reply.status_code == 200, reply.text
        assert json.loads(fake.requests[-1].tensors[wire.MESSAGES][2][0])[0]["content"] == "café ✓"
    app, fake = make_app(FakeTriton(script=transcript_script()), models=[WHISPER])
    whisper = TestClient(app)
    error = error_of(whisper.post("/v1/audio/transcriptions", data={"model": "whisper", "prompt": b"\xff\xfe"},
                                  files=WAV))
    assert error["param"] == "prompt" and fake.requests == []


# the text component's own refusals, for Triton clients (the second sweep, through tritonclient)


@pytest.fixture(scope="module")
def runtime():
    from mstar_common.families.qwen3.tiny import build_tokenizer
    from mstar_common.families.text import TextLMRuntime

    tokenizer = build_tokenizer()
    return TextLMRuntime(engine=None, tokenizer=tokenizer, vocab_size=len(tokenizer), max_model_len=64,
                         default_max_tokens=8)


def _inputs(**values) -> dict:
    import numpy as np

    out = {}
    for name, value in values.items():
        if name in wire.SAMPLING_INPUTS:
            out[name] = np.array([value], dtype=wire.SAMPLING_INPUTS[name][1])
        elif name == wire.INPUT_IDS:
            out[name] = np.array(value, dtype=np.int32)
        else:
            out[name] = np.array(value if isinstance(value, list) else [value], dtype=np.object_)
    return out


@pytest.mark.parametrize("values, message", [
    ({"text_input": None, "messages": '[{"role": "user", "content": "a\\udc00"}]'},
     "messages[0].content: not Unicode text"),
    ({"text_input": None, "messages": '[{"role": "user", "content": "a"}]', "chat_template_kwargs": '{"x": "\\ud800"}'},
     "chat_template_kwargs.x: not Unicode text"),
    ({"top_p": -0.5}, "top_p: must be in (0, 1], got -0.5"),
    ({"top_p": 0.0}, "top_p: must be in (0, 1], got 0.0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty: must be >= 0.001 (1.0 is off), got -1.0"),
    # a normal FP32 that overflowed a seen logit to +inf: the GPU sampler then drew id 0 at every step
    ({"repetition_penalty": 2e-38}, "repetition_penalty: must be >= 0.001 (1.0 is off), got 2.00000001"),
    # exp(gap / T) rounded to 1.0 for distinct logits: the GPU top-k kept 8 tokens for top_k 1
    ({"temperature": 1e8, "top_k": 1}, "temperature: must be <= 100.0, got 100000000.0"),
    ({"min_p": -0.25}, "min_p: must be in [0, 1), got -0.25"),
    ({"stop": [b"\xff\xfe"]}, "stop: must be UTF-8 text"),
    ({"text_input": b"\xff"}, "text_input: must be UTF-8 text"),
    ({"text_input": None, "messages": b"\xff"}, "messages: must be UTF-8 text"),  # said: a number past 4300 digits
    ({"text_input": None, "messages": b'[{"role":"user","content":"a"}]', "chat_template_kwargs": b"\xfe"},
     "chat_template_kwargs: must be UTF-8 text"),
    ({"chat_template_kwargs": b"{not json"}, "chat_template_kwargs: applies only to a messages prompt"),
    ({"input_ids": [1, 2], "text_input": None, "chat_template_kwargs": b"{}"},
     "chat_template_kwargs: applies only to a messages prompt"),
])
def test_the_text_components_refusals_state_one_rule_and_name_the_input(runtime, values, message):
    values = {"text_input": b"hi", **values}
    values = {k: v for k, v in values.items() if v is not None}
    with pytest.raises(ValueError) as info:
        runtime.parse_request(_inputs(**values))
    assert str(info.value).startswith(message), str(info.value)


def test_a_client_that_leaves_mid_upload_is_a_499_line_not_a_server_fault(caplog):
    import asyncio

    app, fake = make_app(FakeTriton(script=transcript_script()), models=[WHISPER])
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwh",
                 "more_body": True}, {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    route = "/v1/audio/transcriptions"
    scope = {"type": "http", "method": "POST", "path": route, "raw_path": route.encode(), "query_string": b"",
             "headers": [(b"content-type", b"multipart/form-data; boundary=b")],
             "http_version": "1.1", "scheme": "http", "server": ("test", 80), "client": ("test", 1), "root_path": ""}
    with caplog.at_level("INFO"):
        asyncio.run(app(scope, receive, send))
    assert not any(m.get("status") == 500 for m in sent)
    assert "client disconnected (499)" in caplog.text and "unhandled" not in caplog.text
    assert fake.requests == []


# numbers past Python's int digit limit (a ValueError of json.loads that is not a JSONDecodeError)

HUGE = "1" * 4301
SPEECH = ServedModel("orpheus", "orpheus_lm", kind="speech")


@pytest.mark.parametrize("models, route, request_kwargs", [
    ([IMAGE_MODEL], "/v1/images/generations", {"content": '{"prompt": "x", "n": %s}' % HUGE}),
    ([IMAGE_MODEL], "/v1/images/generations", {"content": '{"prompt": "x", "unknown": %s}' % HUGE}),
    ([IMAGE_MODEL], "/generate", {"content": '{"model": "klein", "text": "x", "model_kwargs": {"seed": %s}}' % HUGE}),
    ([IMAGE_MODEL], "/generate", {"json": {"model": "klein", "text": "x", "model_kwargs": '{"seed": %s}' % HUGE}}),
    ([IMAGE_MODEL], "/generate", {"data": {"model": "klein", "text": "x", "model_kwargs": '{"seed": %s}' % HUGE}}),
    ([WHISPER], "/generate", {"data": {"model": "whisper", "model_kwargs": '{"seed": %s}' % HUGE},
                              "files": {"audio": WAV["file"]}}),
    (None, "/generate", {"data": {"text": "x", "model_kwargs": '{"seed": %s}' % HUGE}}),
    (None, "/v1/chat/completions", {"content": '{"messages": [{"role": "user", "content": "x"}], "seed": %s}' % HUGE}),
    ([SPEECH], "/v1/audio/speech", {"content": '{"input": "x", "seed": %s}' % HUGE}),
    ([SPEECH], "/generate", {"data": {"text": "x", "model_kwargs": '{"seed": %s}' % HUGE}}),
])
def test_a_number_past_the_int_digit_limit_is_400_on_every_route(models, route, request_kwargs):
    app, fake = make_app(FakeTriton(), **({"models": models} if models else {}))
    headers = {"content-type": "application/json"} if "content" in request_kwargs else {}
    reply = TestClient(app).post(route, headers=headers, **request_kwargs)
    assert reply.status_code == 400, reply.text
    assert fake.requests == []


@pytest.mark.parametrize("models, route", [([IMAGE_MODEL], "/v1/images/edits"), ([WHISPER], "/v1/audio/transcriptions"),
                                           ([IMAGE_MODEL], "/generate"), (None, "/generate")])
def test_a_truncated_multipart_body_is_named_as_such_not_as_a_missing_field(models, route):
    app, fake = make_app(FakeTriton(), **({"models": models} if models else {}))
    client = TestClient(app)
    cut = b'--XX\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n\r\n\x89PNG'
    for body in (b"--XX\r\nbroken", cut):
        reply = client.post(route, content=body, headers={"content-type": "multipart/form-data; boundary=XX"})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["message"] == ("the multipart body is truncated or malformed: its closing "
                                                   "boundary is missing")
    reply = client.post(route, content=b"x", headers={"content-type": "multipart/form-data"})
    assert reply.status_code == 400 and "boundary parameter" in reply.json()["error"]["message"]
    assert fake.requests == []


# arrays nested past json.loads' recursion limit (a RecursionError, neither a JSONDecodeError nor a ValueError)

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("models, route, request_kwargs", [
    ([IMAGE_MODEL], "/v1/images/generations", {"content": '{"prompt": %s}' % DEEP}),
    ([IMAGE_MODEL], "/generate", {"content": '{"model": "klein", "text": "x", "model_kwargs": %s}' % DEEP}),
    ([IMAGE_MODEL], "/generate", {"json": {"model": "klein", "text": "x", "model_kwargs": DEEP}}),
    ([IMAGE_MODEL], "/generate", {"data": {"model": "klein", "text": "x", "model_kwargs": DEEP}}),
    ([WHISPER], "/generate", {"data": {"model": "whisper", "model_kwargs": DEEP}, "files": {"audio": WAV["file"]}}),
    (None, "/generate", {"content": '{"text": "x", "model_kwargs": %s}' % DEEP}),
    (None, "/generate", {"data": {"text": "x", "model_kwargs": DEEP}}),
    (None, "/v1/chat/completions", {"content": '{"model": "qwen3", "messages": %s}' % DEEP}),
    ([SPEECH], "/v1/audio/speech", {"content": '{"input": %s}' % DEEP}),
    ([SPEECH], "/generate", {"data": {"text": "x", "model_kwargs": DEEP}}),
])
def test_json_nested_past_the_parsers_depth_is_400_on_every_route(models, route, request_kwargs):
    app, fake = make_app(FakeTriton(), **({"models": models} if models else {}))
    headers = {"content-type": "application/json"} if "content" in request_kwargs else {}
    reply = TestClient(app, raise_server_exceptions=False).post(route, headers=headers, **request_kwargs)
    assert reply.status_code == 400, reply.text
    assert "nests arrays or objects too deeply" in reply.json()["error"]["message"]  # not "an error parsing"
    assert fake.requests == []


def test_the_text_component_refuses_a_messages_tensor_nested_too_deeply():
    import numpy as np

    from mstar_common.families.text import _json

    with pytest.raises(ValueError, match=r"^messages: nests arrays or objects too deeply"):
        _json({wire.MESSAGES: np.array([DEEP.encode()], dtype=np.object_)}, wire.MESSAGES)


def test_the_text_component_names_a_messages_tensor_with_a_number_past_the_digit_limit():
    """json.loads raises a plain ValueError (not a JSONDecodeError) for an int of more than 4,300 digits: it reached
    the client in Python's words, naming neither the tensor nor the rule."""
    import numpy as np

    from mstar_common.families.text import _json

    with pytest.raises(ValueError, match=r"^messages: holds a number of more than \d+ digits"):
        _json({wire.MESSAGES: np.array([("[" + "9" * 5000 + "]").encode()], dtype=np.object_)}, wire.MESSAGES)


def test_a_request_without_max_tokens_runs_to_the_room_its_prompt_leaves(runtime):
    """ENGINE.md: a request that names no max_tokens is fitted to the room its prompt leaves (as vLLM runs a reply to
    the window); a deployment's `default_max_tokens` caps it where set, and a null one is the room."""
    from dataclasses import replace

    from mstar_common.config import DeploymentError, deployment_from_dict

    prompt = [5, 6, 7, 8]
    uncapped = replace(runtime, default_max_tokens=None)
    assert uncapped.parse_request(_inputs(input_ids=prompt)).params.max_tokens == 64 - len(prompt)
    assert runtime.parse_request(_inputs(input_ids=prompt)).params.max_tokens == 8
    assert uncapped.parse_request(_inputs(input_ids=prompt, max_tokens=3)).params.max_tokens == 3
    base = {"name": "q", "family": "qwen3", "checkpoint": "builtin:qwen3-tiny-random", "components": {"llm": {}},
            "resources": {"max_model_len": 128}}
    for value in (None, 16):  # deployment_from_dict runs the family's checks
        deployment_from_dict({**base, "model_kwargs": {"default_max_tokens": value}})
    with pytest.raises(DeploymentError, match="default_max_tokens: must be an integer >= 1 or null"):
        deployment_from_dict({**base, "model_kwargs": {"default_max_tokens": 0}})


def test_a_template_variable_the_template_never_reads_is_refused():
    """`chat_template_kwargs: {"enable_thinkng": false}` (misspelt) was served with thinking on: the template never
    read it, and the prompt was the one without it."""
    from mstar_common.families.qwen3.tiny import build_tokenizer
    from mstar_common.families.text import chat_prompt_ids

    tokenizer = build_tokenizer()
    with pytest.raises(ValueError, match=r"^chat_template_kwargs\.enable_thinkng: this checkpoint's chat template "
                                         r"has no variable 'enable_thinkng' .*its own variables: enable_thinking$"):
        chat_prompt_ids(tokenizer, MESSAGES, {"enable_thinkng": False})
    off, on = (chat_prompt_ids(tokenizer, MESSAGES, {"enable_thinking": value}) for value in (False, True))
    assert off != on  # the variable it reads is served, and changes the prompt
    tokenizer.chat_template = "{{ messages[-1]['content'] }}{% if persona %}({{ persona }}){% endif %}"
    with pytest.raises(ValueError, match=r"^chat_template_kwargs\.enable_thinking: .*its own variables: persona$"):
        chat_prompt_ids(tokenizer, MESSAGES, {"enable_thinking": False})
    assert tokenizer.decode(chat_prompt_ids(tokenizer, MESSAGES, {"persona": "terse"})) == "Hi(terse)"
    # a template this environment cannot parse (an extension of transformers') is not checked: served as before
    tokenizer.chat_template = "{% generation %}{{ messages[-1]['content'] }}{% endgeneration %}"
    assert tokenizer.decode(chat_prompt_ids(tokenizer, MESSAGES, {"anything": 1})) == "Hi"


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"enable_thinking": False}, "enable_thinking"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": False}},
     "chat_template_kwargs.enable_thinking"),
    ("/generate", {"model_kwargs": {"enable_thinking": False}}, "model_kwargs.enable_thinking"),
    ("/generate", {"model_kwargs": {"chat_template_kwargs": {"enable_thinking": False}}},
     "model_kwargs.chat_template_kwargs.enable_thinking"),
])
def test_a_template_without_enable_thinking_names_the_field_as_the_client_sent_it(route, body, param):
    """The top-level `enable_thinking` shortcut is folded into chat_template_kwargs; a checkpoint whose template
    has no such variable refused it as `chat_template_kwargs.enable_thinking`, a field the request never held."""
    from mstar_common.proxy.triton_stream import TritonInvalidRequest

    refusal = ("chat_template_kwargs.enable_thinking: this checkpoint's chat template has no variable "
               "'enable_thinking' (it would be ignored); its own variables: none")
    app, _ = make_app(FakeTriton(script=[TritonInvalidRequest(refusal)]))
    payload = {"model": "qwen3", "messages": MESSAGES} if route != "/generate" else {"text": "hi"}
    if route == "/generate":
        payload["model_kwargs"] = body["model_kwargs"]
    else:
        payload.update(body)
    error = error_of(TestClient(app).post(route, json=payload))
    assert error["param"] == param and error["message"].startswith(f"{param}: this checkpoint's chat template")


def test_a_variable_the_template_always_sets_itself_is_not_taken_as_one_of_its_switches():
    """jinja2 counts a name the template sets in both branches of an if before reading it (Qwen3's `content`,
    `reasoning_content`): `{"content": "zzz"}` was accepted and changed nothing, and a misspelt switch's 400 offered
    `content` as one of the template's own variables. A name the template asks about (`is defined`, `default`) is
    a switch with a default and stays one."""
    from mstar_common.families.qwen3.tiny import build_tokenizer
    from mstar_common.families.text import chat_prompt_ids

    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{%- for m in messages -%}{%- if m.content is string -%}{%- set content = m.content -%}{%- else -%}"
        "{%- set content = '' -%}{%- endif -%}{{ m.role }}: {{ content }};{%- endfor -%}"
        "{%- if not today is defined -%}{%- set today = '1 Jan' -%}{%- endif -%}{{ today }}"
        "{%- if enable_thinking is defined and enable_thinking is false -%} (no thinking){%- endif -%}")
    with pytest.raises(ValueError, match=r"^chat_template_kwargs\.content: this checkpoint's chat template has no "
                                         r"variable 'content' \(it would be ignored\); its own variables: "
                                         r"enable_thinking, today$"):
        chat_prompt_ids(tokenizer, MESSAGES, {"content": "zzz"})
    with pytest.raises(ValueError, match=r"its own variables: enable_thinking, today$"):
        chat_prompt_ids(tokenizer, MESSAGES, {"enable_thinkng": False})
    assert tokenizer.decode(chat_prompt_ids(tokenizer, MESSAGES, {"today": "2 Feb", "enable_thinking": False})) \
        == "user: Hi;2 Feb(no thinking)"  # the `-%}` before it strips the space
    # a switch the template reads and then sets again changes the prompt: it stays (an AST rule alone refused it)
    tokenizer.chat_template = ("{%- for m in messages -%}{{ m.content }}{%- endfor -%}"
                               "{%- if style -%}{%- set style = style | upper -%}[{{ style }}]{%- endif -%}")
    assert tokenizer.decode(chat_prompt_ids(tokenizer, MESSAGES, {"style": "x"})) == "Hi[X]"
    # read only as true/false, or compared with a value, before it is set; and one no string can render (a 500)
    for template, kwargs, prompt in (
            ("{%- set thinking = thinking or false -%}{{ messages[0].content }}{%- if thinking -%}!{%- endif -%}",
             {"thinking": True}, "Hi!"),
            ("{%- if mode == 'formal' -%}Dear {% endif -%}{%- set mode = 'done' -%}{{ messages[0].content }}",
             {"mode": "formal"}, "Dear Hi"),
            ("{%- set opts = opts or {} -%}{{ messages[0].content }}"
             "{%- for k, v in opts | dictsort -%}[{{ k }}={{ v }}]{%- endfor -%}",
             {"opts": {"lang": "fr"}}, "Hi[lang=fr]")):
        tokenizer.chat_template = template
        assert tokenizer.decode(chat_prompt_ids(tokenizer, MESSAGES, kwargs)) == prompt


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_the_openai_packages_include_obfuscation_is_accepted_without_effect(served, route):
    """The openai package types stream_options with include_obfuscation; it was refused as an unknown field."""
    client, _ = served
    body = {"messages": MESSAGES} if route.endswith("chat/completions") else {"prompt": "hi"}
    for value in (False, True, None):
        reply = client.post(route, json={"model": "qwen3", **body, "stream": True,
                                         "stream_options": {"include_usage": True, "include_obfuscation": value}})
        assert reply.status_code == 200, reply.text
        events = sse_events(reply.text)
        assert events[-1] == "[DONE]" and events[-2]["usage"]["total_tokens"] > 0
        assert not any("obfuscation" in event for event in events[:-1])


def test_a_null_enable_thinking_is_unset_wherever_it_is_sent():
    """`chat_template_kwargs.enable_thinking: null` was a 400 ("must be a boolean") where null is unset everywhere
    else, the top-level shortcut's null included; passed on as None, a template's `{% if enable_thinking %}` would
    have read it as false."""
    from mstar_common.families.qwen3.tiny import build_tokenizer
    from mstar_common.families.text import chat_prompt_ids

    assert wire.check_chat_template_kwargs({"enable_thinking": None, "persona": None}) == {"persona": None}
    with pytest.raises(ValueError, match=r"enable_thinking: must be a boolean or null, got 'no'"):
        wire.check_chat_template_kwargs({"enable_thinking": "no"})
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{{ messages[-1]['content'] }}{% if enable_thinking %}(think){% else %}(quick){% endif %}"
    assert tokenizer.decode(chat_prompt_ids(tokenizer, MESSAGES, {"enable_thinking": None})) == "Hi(quick)"
    app, fake = make_app()
    unset = {"model": "qwen3", "messages": MESSAGES}
    assert TestClient(app).post("/v1/chat/completions", json=unset).status_code == 200
    for body in ({"chat_template_kwargs": {"enable_thinking": None}}, {"enable_thinking": None}):
        assert TestClient(app).post("/v1/chat/completions", json={**unset, **body}).status_code == 200
        assert wire.CHAT_TEMPLATE_KWARGS not in fake.requests[-1].tensors


def test_a_null_enable_thinking_beside_the_shortcut_is_named_as_the_shortcut():
    from mstar_common.proxy.protocol import thinking_shortcut_names

    assert thinking_shortcut_names({"enable_thinking": None}, True, "enable_thinking") == thinking_shortcut_names(
        {}, True, "enable_thinking") == {"chat_template_kwargs.enable_thinking": "enable_thinking"}


@pytest.mark.parametrize("content_type, status", [
    ("multipart/form-data; boundary=XX; charset=utf-8; charset=utf-7", 400),  # Starlette decodes with the last
    ("multipart/form-data; boundary=XX; charset =utf-7", 400),
    ("multipart/form-data; boundary=XX ; charset=utf-8", 200),  # a space before ';' is legal (RFC 9110 5.6.6)
    ("multipart/form-data; boundary=A; boundary=XX", 200),
    ('multipart/form-data; boundary="XX"', 200),
])
def test_a_multipart_content_types_parameters_are_read_as_the_form_parser_reads_them(served, content_type, status):
    """The charset and boundary checks read the Content-Type with regexes of their own (first match, no space before
    '='): a second or spaced charset=utf-7 was decoded as UTF-7 past the refusal, and legal headers were refused as
    a truncated body."""
    client, fake = served
    reply = client.post("/generate", content=_two_fields("XX", b"+AGgAaQ- there"),
                        headers={"content-type": content_type})
    assert reply.status_code == status, reply.text
    if status == 400:
        assert "charset must be utf-8, not 'utf-7'" in reply.json()["error"]["message"]
    else:
        assert json.loads(fake.requests[-1].tensors[wire.MESSAGES][2][0])[0]["content"] == "+AGgAaQ- there"


def test_a_compressed_body_is_415_naming_the_coding(served):
    """Content-Encoding was ignored: a gzip'd JSON body got a 400 blaming its bytes ("not UTF-8 text"), a urlencoded
    one echoed compressed bytes as a field name, and a plain body labelled gzip was served."""
    import gzip

    client, fake = served
    body = json.dumps({"model": "qwen3", "prompt": "hi"}).encode()
    for coding, raw in (("gzip", gzip.compress(body)), ("br", body)):
        reply = client.post("/v1/completions", content=raw,
                            headers={"content-type": "application/json", "content-encoding": coding})
        assert reply.status_code == 415 and reply.headers["accept-encoding"] == "identity", reply.text
        error = reply.json()["error"]
        assert error["param"] == "content-encoding" and f"'{coding}'" in error["message"], error
    reply = client.post("/v1/completions", content=gzip.compress(body),  # two lines are one list (RFC 9110)
                        headers=[("content-type", "application/json"), ("content-encoding", "identity"),
                                 ("content-encoding", "gzip")])
    assert reply.status_code == 415 and "'gzip'" in reply.json()["error"]["message"], reply.text
    assert fake.requests == []
    reply = client.post("/v1/completions", content=body,
                        headers={"content-type": "application/json", "content-encoding": "identity"})
    assert reply.status_code == 200, reply.text
