"""The transcription routes against a fake Triton: the walk's tensors, every response format, streaming, refusals."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from mstar_common.proxy.app import ServedModel
from mstar_common.proxy.serving_transcriptions import _clock
from mstar_common.proxy.triton_stream import StreamResponse, TritonInvalidRequest
from tests.unit.proxy_fake_triton import FakeTriton, make_app

SEGMENTS = [{"id": 0, "seek": 0, "start": 0.0, "end": 2.5, "text": " Hello there.", "tokens": [1, 2]},
            {"id": 1, "seek": 0, "start": 2.5, "end": 3661.25, "text": " General Kenobi.", "tokens": [3]}]


def script(language: str = "en") -> list:
    meta = {"language": language, "duration": 3.2, "segments": SEGMENTS}
    return [StreamResponse(text="Hello there.", completion_tokens=2),
            StreamResponse(text=" General Kenobi.", completion_tokens=3),
            StreamResponse(text="", finish_reason="stop", completion_tokens=3, transcript=meta),
            StreamResponse(is_final=True)]


@pytest.fixture
def app():
    fake = FakeTriton(script=script())
    app, _ = make_app(fake, models=[ServedModel("whisper", "whisper_walk", "transcription"),
                                    ServedModel("qwen3", "qwen3_llm")])
    return TestClient(app), fake


def post(client, route="/v1/audio/transcriptions", data=None, files=None):
    files = files if files is not None else {"file": ("a.wav", b"RIFF....", "audio/wav")}
    return client.post(route, data={"model": "whisper", **(data or {})}, files=files)


def test_walk_tensors_and_json(app):
    client, fake = app
    response = post(client, data={"language": "en", "prompt": "Obi-Wan", "temperature": "0", "seed": "7"})
    assert response.status_code == 200
    assert response.json() == {"text": "Hello there. General Kenobi.", "usage": {"type": "duration", "seconds": 4}}
    sent = fake.requests[-1]
    assert sent.model == "whisper_walk"
    assert sent.tensors["audio"][2][0] == b"RIFF...." and sent.tensors["task"][2][0] == b"transcribe"
    assert sent.tensors["language"][2][0] == b"en" and sent.tensors["prompt"][2][0] == b"Obi-Wan"
    assert not sent.tensors["timestamps"][2][0] and sent.tensors["seed"][2][0] == 7


def test_formats(app):
    client, fake = app
    assert post(client, data={"response_format": "text"}).text == "Hello there. General Kenobi."
    verbose = post(client, data={"response_format": "verbose_json", "timestamp_granularities[]": "segment"}).json()
    assert verbose["language"] == "english" and verbose["duration"] == 3.2 and verbose["segments"] == SEGMENTS
    assert fake.requests[-1].tensors["timestamps"][2][0]  # timed formats decode timestamps
    srt = post(client, data={"response_format": "srt"}).text
    assert srt == ("1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n"
                   "2\n00:00:02,500 --> 01:01:01,250\nGeneral Kenobi.\n\n")
    vtt = post(client, data={"response_format": "vtt"}).text
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.\n\n")
    translated = post(client, route="/v1/audio/translations").json()
    assert translated["text"] and fake.requests[-1].tensors["task"][2][0] == b"translate"
    assert _clock(59.9996, ",") == "00:01:00,000"


def test_stream_events_add_up(app):
    client, _ = app
    body = post(client, data={"stream": "true"}).text
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    deltas = [e["delta"] for e in events if e["type"] == "transcript.text.delta"]
    assert events[-1] == {"type": "transcript.text.done", "text": "".join(deltas)} and len(deltas) == 2


@pytest.mark.parametrize("data, files, field", [
    ({}, {}, "file"),
    ({"response_format": "diarized_json"}, None, "response_format"),
    ({"timestamp_granularities[]": "word", "response_format": "verbose_json"}, None, "timestamp_granularities"),
    ({"timestamp_granularities[]": "segment"}, None, "timestamp_granularities"),
    ({"include[]": "logprobs"}, None, "include"),
    ({"chunking_strategy": "server_vad"}, None, "chunking_strategy"),
    ({"chunking_strategy[type]": "server_vad", "chunking_strategy[threshold]": "0.5"}, None, "chunking_strategy"),
    ({"temperature": "1.5"}, None, "temperature"),
    ({"temperature": "hot"}, None, "temperature"),
    # int() and float() read these spellings too ("1_0" as 10, Arabic-Indic digits), which no JSON route takes
    ({"max_tokens": "1_0"}, None, "max_tokens"),
    ({"max_tokens": "9" * 5000}, None, "max_tokens"),  # past int()'s 4,300 digits: was a 500 for a moment
    ({"seed": "\u0665"}, None, "seed"),
    ({"temperature": "0_5"}, None, "temperature"),
    ({"temperature": "1e-46"}, None, "temperature"),  # 0 as the FP32 tensor holds it: was decoded greedily
    ({"stream": "true", "response_format": "vtt"}, None, "stream"),
    ({"known_speaker_names[]": "Ben"}, None, "known_speaker_names"),
    ({"frobnicate": "1"}, None, "frobnicate"),
    ({"task": "translate"}, None, "/v1/audio/translations"),  # the way to translate, named in the refusal
    ({"model": "qwen3"}, None, "model"),
])
def test_refusals_name_the_field(app, data, files, field):
    client, fake = app
    before = len(fake.requests)
    response = post(client, data=data, files=files)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"], response.json()
    assert len(fake.requests) == before  # refused before Triton


def test_the_walk_naming_audio_is_reported_as_file(app):
    client, fake = app
    fake.script = [TritonInvalidRequest("audio: not a readable audio file")]
    error = post(client).json()["error"]
    assert error["param"] == "file" and error["message"].startswith("file: not a readable")
    fake.script = [TritonInvalidRequest("language: 'xx' is not a language this checkpoint knows")]
    error = post(client, data={"language": "xx"}).json()["error"]
    assert error["param"] == "language" and error["message"].startswith("language:")


def test_the_translation_routes_own_names_and_the_srt_charset(app):
    """On /translations a task the model cannot do is the model's fault (the route has no `task`), and a `language`
    is refused as a field translations lacks; an srt response says its charset (non-ASCII captions)."""
    client, fake = app
    fake.script = [TritonInvalidRequest("task: this checkpoint is English-only and cannot translate")]
    error = post(client, route="/v1/audio/translations").json()["error"]
    assert error["param"] == "model" and error["message"].startswith("model: this checkpoint is English-only")
    fake.script = script()
    error = post(client, route="/v1/audio/translations", data={"language": "fr"}).json()["error"]
    assert error["param"] == "language" and "not a field of translations" in error["message"]
    assert post(client, data={"response_format": "srt"}).headers["content-type"] == \
        "application/x-subrip; charset=utf-8"


def test_a_text_field_over_the_part_cap_is_named(app):
    """A text field past 1 MiB (a long prompt, or an upload sent without a filename) is a 400 naming it; Starlette's
    own cap answered without a field."""
    client, fake = app
    before = len(fake.requests)
    response = post(client, data={"prompt": "a" * (1_100_000)})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "prompt", error
    assert "1100000 bytes; the limit is 1048576" in error["message"]
    response = client.post("/v1/audio/transcriptions", data={"model": "whisper"},
                           files={"file": (None, b"R" * 1_100_000)})  # no filename: a text part
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"
    assert len(fake.requests) == before


def test_native_generate_with_an_audio_upload(app):
    client, fake = app
    data = {"model": "whisper", "text": "names: Kenobi", "model_kwargs": json.dumps({"timestamps": True,
                                                                                     "language": "en"})}
    body = client.post("/generate", data=data, files={"audio": ("a.flac", b"fLaC", "audio/flac")}).json()
    assert body["outputs"]["text"] == ["Hello there. General Kenobi."] and body["language"] == "en"
    assert body["segments"] == SEGMENTS and body["duration"] == 3.2
    sent = fake.requests[-1].tensors
    assert sent["prompt"][2][0] == b"names: Kenobi" and sent["timestamps"][2][0]
    # no task given, none sent: the walk fills the checkpoint's own, as transformers' generate does (the proxy sent
    # transcribe, so a checkpoint whose generation config translates never did through /generate)
    assert "task" not in sent
    client.post("/generate", data={**data, "model_kwargs": '{"task": "translate"}'},
                files={"audio": ("a.flac", b"fLaC", "audio/flac")})
    assert fake.requests[-1].tensors["task"][2][0] == b"translate"
    client.post("/v1/audio/transcriptions", data={"model": "whisper"},
                files={"file": ("a.flac", b"fLaC", "audio/flac")})
    assert fake.requests[-1].tensors["task"][2][0] == b"transcribe"  # the route names its task
    refused = client.post("/generate", data={"model": "whisper", "model_kwargs": '{"voice": "tara"}'},
                          files={"audio": ("a.wav", b"x", "audio/wav")})
    assert refused.status_code == 400 and "model_kwargs.voice" in refused.text
    assert client.post("/generate", json={"model": "whisper", "text": "hi"}).status_code == 400
    fake.script = [TritonInvalidRequest("language: 'xx' is not a language this checkpoint knows")]
    error = client.post("/generate", data={**data, "model_kwargs": '{"language": "xx"}'},
                        files={"audio": ("a.flac", b"fLaC", "audio/flac")}).json()["error"]
    assert error["param"] == "model_kwargs.language" and error["message"].startswith("model_kwargs.language: 'xx'")
    fake.script = [TritonInvalidRequest("prompt: 500 tokens is more than the decoder's prompt window")]
    error = client.post("/generate", data={**data, "model_kwargs": "{}"},
                        files={"audio": ("a.flac", b"fLaC", "audio/flac")}).json()["error"]
    assert error["param"] == "text"


def test_an_upload_to_generate_naming_an_unknown_model_is_a_404(app):
    """It used to be refused as an upload to a text-only server, on a server serving whisper."""
    client, fake = app
    before = len(fake.requests)
    response = client.post("/generate", data={"model": "nope"}, files={"audio": ("a.wav", b"RIFF", "audio/wav")})
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["param"] == "model" and "'nope' does not exist" in error["message"]
    assert len(fake.requests) == before


def test_an_empty_upload_to_generate_is_named_as_sent(app):
    client, _ = app
    response = client.post("/generate", data={"model": "whisper"}, files={"audio": ("a.wav", b"", "audio/wav")})
    assert response.status_code == 400 and response.json()["error"]["param"] == "audio", response.text
    assert response.json()["error"]["message"].startswith("'audio': the upload is empty")


def test_a_prompt_given_as_text_and_in_model_kwargs_is_refused_not_one_dropped(app):
    client, fake = app
    before = len(fake.requests)
    response = client.post("/generate", data={"model": "whisper", "text": "a", "model_kwargs": '{"prompt": "b"}'},
                           files={"audio": ("a.wav", b"RIFF", "audio/wav")})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "model_kwargs.prompt" and len(fake.requests) == before


def test_generate_gives_the_segments_untimed_as_the_stream_does(app):
    client, _ = app
    body = client.post("/generate", data={"model": "whisper"}, files={"audio": ("a.wav", b"RIFF", "audio/wav")}).json()
    assert body["segments"] == SEGMENTS


def test_a_translations_verbose_language_is_english_as_openais():
    """OpenAI's TranslationVerbose: the language of the output, always english (it gave the source language)."""
    fake = FakeTriton(script=script(language="nl"))
    app, _ = make_app(fake, models=[ServedModel("whisper", "whisper_walk", "transcription")])
    client = TestClient(app)
    verbose = post(client, route="/v1/audio/translations", data={"response_format": "verbose_json"}).json()
    assert verbose["task"] == "translate" and verbose["language"] == "english"
    fake.script = script(language="nl")
    assert post(client, data={"response_format": "verbose_json"}).json()["language"] == "dutch"


def test_generate_without_model_on_a_server_of_several_says_model_is_required(app):
    """An upload without `model` on a server serving whisper and qwen3 was refused as 'the served models are
    text-only', and an image request as an unknown model_kwargs field."""
    client, fake = app
    for kwargs in ({"files": {"audio": ("a.wav", b"RIFF", "audio/wav")}}, {"json": {"text": "a cat"}},
                   {"data": {"text": "hi"}}):
        error = client.post("/generate", **kwargs).json()["error"]
        assert error["param"] == "model" and "'model' is required" in error["message"], error
    assert fake.requests == []


def test_a_body_that_is_not_json_on_a_server_of_several_says_so_not_that_model_is_missing(app):
    """It named `model` (the body's model could not be read), also for a body that sent one: the JSON's own
    refusal was never reached."""
    client, fake = app
    for body, rule in ((b'{"model": "whisper", "text": "hi",}', "'body' is not valid JSON"),
                       (b'[{"model": "whisper"}]', "'body' must be a JSON object, got list")):
        reply = client.post("/generate", content=body, headers={"content-type": "application/json"})
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["message"].startswith(rule) and error["param"] != "model", error
    assert fake.requests == []


def test_a_lone_surrogate_in_an_uploads_model_kwargs_is_400_naming_it(app):
    """The SDK sends model_kwargs as a JSON string, escaping the surrogate: it got past the body's check and
    failed at its first encode (a 500)."""
    client, fake = app
    error = _generate_refusal(client, '{"prompt": "a\\ud800"}')
    assert error["param"] == "model_kwargs.prompt" and "surrogate" in error["message"]
    assert fake.requests == []


def _generate_refusal(client, model_kwargs: str) -> dict:
    """The 400's error of an upload to /generate with these `model_kwargs`."""
    response = client.post("/generate", data={"model": "whisper", "model_kwargs": model_kwargs},
                           files={"audio": ("a.wav", b"RIFF", "audio/wav")})
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_an_integer_temperature_past_a_floats_range_is_400_naming_it(app):
    """np.float32 of an int past float64's range raises OverflowError (1e400 as a float was refused already)."""
    client, fake = app
    for raw in ("1" + "0" * 400, "-" + "9" * 330, "1e400"):
        error = _generate_refusal(client, '{"temperature": %s}' % raw)
        assert error["param"] == "model_kwargs.temperature" and "must be finite as a 32-bit float" in error["message"]
    assert fake.requests == []


@pytest.mark.parametrize("model_kwargs, shown", [
    ('{"temperature": 1.00000001}', "must be in [0, 1], got 1.00000001"),  # 1.0 as 32 bits: was accepted
    ('{"temperature": 2147483647}', "must be in [0, 1], got 2147483647"),  # the walk named 2147483648.0
    ('{"temperature": 1e-46}', "1e-46 is 0 as a 32-bit float"),
])
def test_generate_checks_the_temperature_as_sent_and_as_held(app, model_kwargs, shown):
    client, fake = app
    error = _generate_refusal(client, model_kwargs)
    assert error["param"] == "model_kwargs.temperature" and shown in error["message"], error
    assert fake.requests == []


def test_a_forms_repeated_modalities_are_a_list_on_every_generate_path(app):
    """httpx sends a list in `data=` as the field repeated: the text models' /generate took it, the transcription
    and image paths refused it ("sent 2 times; send it once")."""
    from tests.unit.test_proxy_images import client as image_client
    from tests.unit.test_proxy_images import png

    client, fake = app
    wav = {"audio": ("a.wav", b"RIFF....", "audio/wav")}
    for modalities in (["audio", "text"], ['["audio", "text"]'], ["audio,text"]):
        reply = client.post("/generate", data={"model": "whisper", "input_modalities": modalities}, files=wav)
        assert reply.status_code == 200, reply.text
    reply = client.post("/generate", data={"model": "whisper", "input_modalities": ["audio", "video"]}, files=wav)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input_modalities"
    images, _ = image_client()
    form = {"text": "a cat", "input_modalities": ["text", "image"], "output_modalities": ["image"]}
    reply = images.post("/generate", data=form, files=[("files", ("a.png", png(), "image/png"))])
    assert reply.status_code == 200, reply.text


def test_a_forms_modalities_that_are_no_list_of_names_are_a_400_naming_them(app):
    """Taken out of the form before its upload check, a modalities field sent as a file was a 500 (UploadFile has
    no lstrip), a list of lists a 500 (unhashable), and an empty list accepted on this path alone."""
    client, fake = app
    wav = {"audio": ("a.wav", b"RIFF....", "audio/wav")}
    for data, files in (({}, {**wav, "input_modalities": ("m.txt", b"audio", "text/plain")}),
                        ({"input_modalities": '[["audio"]]'}, wav), ({"input_modalities": "[{}]"}, wav),
                        ({"input_modalities": "[]"}, wav), ({"input_modalities": ""}, wav)):
        reply = client.post("/generate", data={"model": "whisper", **data}, files=files)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "input_modalities", reply.text
    assert fake.requests == []
