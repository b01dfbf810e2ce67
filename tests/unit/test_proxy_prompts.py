"""Prompts tokenized in the proxy (proxy/prompts.py): the ids the entry model would make, sent instead of the text,
the refusals naming the client's field, the settings and flags that turn it on, and the launcher's arguments."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from mstar_common import wire
from mstar_common.families.text import chat_prompt_ids
from mstar_common.proxy.__main__ import apply_tokenizers, parse_model
from mstar_common.proxy.app import ProxySettings, ServedModel
from tests.unit.proxy_fake_triton import FakeTriton, make_app

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from mstar_common.families.qwen3.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture
def served(tokenizer_dir):
    model = ServedModel("qwen3", "qwen3_llm", tokenizer=str(tokenizer_dir), max_model_len=MAX_MODEL_LEN)
    app, fake = make_app(FakeTriton(), models=[model])
    with TestClient(app) as client:
        yield client, fake


def _sent(fake: FakeTriton) -> dict:
    (request,) = fake.requests
    return request.tensors


def test_completions_send_the_entry_models_ids_instead_of_the_text(served, tokenizer):
    client, fake = served
    r = client.post("/v1/completions", json={"model": "qwen3", "prompt": "Once upon a time", "max_tokens": 3})
    assert r.status_code == 200, r.text
    tensors = _sent(fake)
    assert wire.TEXT_INPUT not in tensors and wire.MESSAGES not in tensors
    assert tensors[wire.INPUT_IDS][2].tolist() == tokenizer.encode("Once upon a time", add_special_tokens=False)
    assert tensors["max_tokens"][2].tolist() == [3]


def test_chat_sends_the_templated_ids_with_its_template_kwargs(served, tokenizer):
    client, fake = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = client.post("/v1/chat/completions", json={"model": "qwen3", "messages": messages,
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    tensors = _sent(fake)
    assert wire.MESSAGES not in tensors and wire.CHAT_TEMPLATE_KWARGS not in tensors
    ids = tensors[wire.INPUT_IDS][2].tolist()
    assert ids == chat_prompt_ids(tokenizer, messages, {"enable_thinking": False})
    assert ids != chat_prompt_ids(tokenizer, messages, {}), "the template kwargs were not applied"


def test_native_generate_text_is_one_user_message(served, tokenizer):
    client, fake = served
    r = client.post("/generate", json={"model": "qwen3", "text": "hello"})
    assert r.status_code == 200, r.text
    expected = chat_prompt_ids(tokenizer, [{"role": "user", "content": "hello"}], {})
    assert _sent(fake)[wire.INPUT_IDS][2].tolist() == expected


@pytest.mark.parametrize("route,body,param,rule", [
    ("/v1/completions", {"prompt": " the" * MAX_MODEL_LEN}, "prompt", "tokens leave no room for output within "
                                                                     f"max_model_len={MAX_MODEL_LEN}"),
    ("/v1/completions", {"prompt": ""}, "prompt", "must not be empty"),
    ("/v1/completions", {"prompt": "x" * 100_000}, "prompt", "bytes cannot fit max_model_len"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": " the" * MAX_MODEL_LEN}]}, "messages",
     "tokens leave no room for output"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "é" * 200_000}]}, "messages",
     "bytes cannot fit max_model_len"),
    ("/generate", {"text": " the" * MAX_MODEL_LEN}, "text", "tokens leave no room for output"),
])
def test_refusals_name_the_clients_field_and_reach_no_model(served, route, body, param, rule):
    client, fake = served
    r = client.post(route, json={"model": "qwen3", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ") and rule in error["message"]
    assert fake.requests == []


def test_without_a_tokenizer_the_text_goes_to_the_entry_model():
    app, fake = make_app()
    with TestClient(app) as client:
        assert client.post("/v1/completions", json={"model": "qwen3", "prompt": "Once"}).status_code == 200
    tensors = _sent(fake)
    assert wire.INPUT_IDS not in tensors and tensors[wire.TEXT_INPUT][2].tolist() == [b"Once"]


def test_settings_refuse_a_tokenizer_they_cannot_use(tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match="only a text model"):
        ProxySettings(models=[ServedModel("tts", "orpheus", kind="speech", tokenizer=str(tokenizer_dir),
                                          max_model_len=64)])
    with pytest.raises(ValueError, match="max_model_len must be >= 2"):
        ProxySettings(models=[ServedModel("qwen3", "qwen3_llm", tokenizer=str(tokenizer_dir))])
    settings = ProxySettings(models=[ServedModel("qwen3", "qwen3_llm", tokenizer=str(tmp_path / "missing"),
                                                 max_model_len=64)])
    with pytest.raises(ValueError, match="model 'qwen3': cannot load the tokenizer"):
        make_app(FakeTriton(), models=settings.models)


def test_flags_set_both_or_are_refused():
    parser = argparse.ArgumentParser()
    models = [parse_model("qwen3=qwen3_llm")]
    apply_tokenizers(parser, models, [("qwen3", "/ckpt")], [("qwen3", "2048")])
    assert (models[0].tokenizer, models[0].max_model_len) == ("/ckpt", 2048)
    for tokenizers, lengths in (([("qwen3", "/ckpt")], []), ([("other", "/ckpt")], [("other", "8")]),
                                ([("qwen3", "/ckpt")], [("qwen3", "many")])):
        with pytest.raises(SystemExit):
            apply_tokenizers(parser, [parse_model("qwen3=qwen3_llm")], tokenizers, lengths)


def test_launcher_passes_the_checkpoint_for_text_models_only(monkeypatch, tmp_path):
    import yaml

    from mstar_common.config import deployment_from_dict
    from mstar_common.launcher import proxy_tokenizer_args

    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path))
    raw = yaml.safe_load(open("configs/qwen3.yaml"))
    args = proxy_tokenizer_args(deployment_from_dict(raw))
    assert args[0] == "--tokenizer" and args[1].startswith("qwen3-tiny=") and args[1].endswith("qwen3-tiny")
    assert args[2:] == ["--max-model-len", "qwen3-tiny=512"]
    raw["server"] = {"tokenize_in_proxy": False}
    assert proxy_tokenizer_args(deployment_from_dict(raw)) == []
    assert proxy_tokenizer_args(deployment_from_dict(yaml.safe_load(open("configs/whisper.yaml")))) == []

