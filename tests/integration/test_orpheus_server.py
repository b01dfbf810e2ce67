"""Orpheus TTS through a real tritonserver (tiny random Llama + tiny random SNAC 24 kHz on the CPU) and the
proxy: OpenAI speech streaming, 8 concurrent streams, cancellation, SDK, native /generate, and the served
PCM against the `snac` package decoding the served tokens (tolerance: 1 PCM16 LSB)."""

from __future__ import annotations

import gc
import io
import json
import queue
import re
import struct
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import httpx
import numpy as np
import openai
import pytest
import soundfile
import torch
import tritonclient.grpc as grpcclient
import yaml

from mstar import MStarClient
from mstar_common import wire
from mstar_common.cli import CONFIGS
from mstar_common.config import deployment_from_dict
from tests.integration.conftest import Served, serve_deployment

pytestmark = pytest.mark.server
SAMPLES_PER_FRAME = 2048


@pytest.fixture(scope="module")
def tts(tmp_path_factory) -> Served:
    dep = deployment_from_dict(yaml.safe_load((CONFIGS / "orpheus.yaml").read_text()), source="orpheus.yaml")
    with serve_deployment(dep, tmp_path_factory.mktemp("orpheus"), "orpheus.yaml", ready_timeout_s=240) as served:
        yield served


@pytest.fixture(scope="module")
def oai(tts):
    return openai.OpenAI(base_url=tts.proxy_url + "/v1", api_key="none", max_retries=0)


def _metric(tts, name: str) -> float:
    text = urllib.request.urlopen(tts.metrics_url, timeout=5).read().decode()
    values = [float(v) for v in re.findall(rf'^{name}{{[^}}]*model="orpheus_lm"[^}}]*}} (\S+)$', text, re.M)]
    assert values, f"{name} not exported"
    return sum(values)


@dataclass
class Heard:
    pcm: list[np.ndarray] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: str | None = None


def _speak(tts, request_id: str, **values) -> Heard:
    """One request on a tritonclient gRPC stream; PCM chunks as they come."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(tts.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = []
    for name, value in values.items():
        if name in (wire.TEXT_INPUT, wire.VOICE):
            arr, dtype = np.array([value.encode()], dtype=np.object_), "BYTES"
        else:
            dtype, np_dtype = wire.SAMPLING_INPUTS[name]
            arr = np.array([value], dtype=np_dtype)
        tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
        tensor.set_data_from_numpy(arr)
        inputs.append(tensor)
    heard = Heard()
    try:
        client.async_stream_infer(tts.entry, inputs, request_id=request_id, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                heard.error = str(error)
                return heard
            if result.as_numpy(wire.AUDIO_CHUNK) is not None:
                heard.pcm.append(result.as_numpy(wire.AUDIO_CHUNK))
                heard.token_ids += result.as_numpy(wire.TOKEN_IDS).tolist()
                heard.finish_reason = result.as_numpy(wire.FINISH_REASON)[0].decode() or heard.finish_reason
            if result.get_response().parameters["triton_final_response"].bool_param:
                return heard
    finally:
        client.stop_stream()
        client.close()


def _reference_pcm(checkpoint, token_ids: list[int], audio_start: int) -> np.ndarray:
    """The `snac` package decoding the served tokens: `wrap` codes, 28-token windows, edges repeated."""
    from snac import SNAC

    snac = SNAC.from_pretrained(str(checkpoint / "snac")).eval()
    codes = [(t - audio_start) % 4096 for t in token_ids if audio_start <= t < audio_start + 7 * 4096]
    frames = np.array(codes[: len(codes) // 7 * 7]).reshape(-1, 7)
    out = []
    for f in range(len(frames)):
        w = frames[[min(max(i, 0), len(frames) - 1) for i in range(f - 1, f + 3)]]
        levels = [torch.tensor(w[:, list(p)].reshape(1, -1)) for p in ((0,), (1, 4), (2, 3, 5, 6))]
        with torch.inference_mode():
            audio = snac.decode(levels)[0, 0, SAMPLES_PER_FRAME:2 * SAMPLES_PER_FRAME].numpy()
        out.append((audio * 32767).astype(np.int16))
    return np.concatenate(out)


def check_served_parity(tts) -> None:
    """One greedy request: the served tokens are transformers' (restricted to the custom rows, with the served default
    repetition penalty) and the served PCM is the `snac` package decoding them (within 1 PCM16 LSB)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    heard = _speak(tts, "parity", text_input="Hello there", voice="tara", max_tokens=56, temperature=0.0,
                   ignore_eos=True)
    assert heard.error is None and heard.finish_reason == "length" and len(heard.token_ids) == 56
    tokenizer = AutoTokenizer.from_pretrained(str(tts.checkpoint))
    start = tokenizer.convert_tokens_to_ids("<custom_token_0>")
    pcm = np.concatenate(heard.pcm)
    # a frame for every 7 audio tokens: a random LM may also pick one of the control rows (56 tokens made 7 frames
    # on the tiny checkpoint whose norms vary, 8 before)
    num_audio = sum(start + 10 <= t < start + 10 + 7 * 4096 for t in heard.token_ids)
    assert num_audio >= 42 and pcm.dtype == np.int16 and len(pcm) == num_audio // 7 * SAMPLES_PER_FRAME
    want = _reference_pcm(tts.checkpoint, heard.token_ids, start + 10)
    assert np.abs(pcm.astype(np.int32) - want).max() <= 1
    model = AutoModelForCausalLM.from_pretrained(str(tts.checkpoint), dtype=torch.float32).eval()
    prompt = [start + 3, tokenizer.bos_token_id, *tokenizer.encode("tara: Hello there", add_special_tokens=False),
              tokenizer.convert_tokens_to_ids("<|eot_id|>"), start + 4, start + 5, start + 1]

    def restrict(_ids, scores):
        scores[:, :start] = float("-inf")
        return scores

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=56, min_new_tokens=56, do_sample=False,
                             repetition_penalty=1.3, logits_processor=[restrict])  # the served default penalty
    assert heard.token_ids == out[0, len(prompt):].tolist()


def check_cancel_frees(tts, oai) -> None:
    """A stream cancelled after its first audio: its KV pages and codec state are freed within 5 s."""
    with oai.audio.speech.with_streaming_response.create(
        model=tts.dep.name, input="A long story", voice="tara", response_format="pcm",
        extra_body={"stream": True, "max_tokens": 1200, "ignore_eos": True},
    ) as response:
        # the iterator is kept: httpx's, once collected, closes the connection, which the server takes for the
        # client leaving (a dropped `next(response.iter_bytes())` cancelled the stream whenever the cyclic GC ran
        # before the gauges were read)
        chunks = response.iter_bytes()
        assert next(chunks)
        gc.collect()  # a dropped iterator would close the connection here, not at some later collection
        # The gauges are sampled (every 0.1 s), not read at the request.
        start = time.monotonic()
        readings = []  # (seconds since the first audio, codec streams, KV pages used, engine steps so far)
        while True:
            streams, pages = _metric(tts, "mstar_codec_streams"), _metric(tts, "mstar_kv_pages_used")
            readings.append((round(time.monotonic() - start, 2), streams, pages,
                             _metric(tts, "mstar_engine_steps_total")))
            if streams == 1 and pages > 0:
                break
            assert time.monotonic() < start + 10, (
                "the live stream's codec state and pages never showed in the metrics; (s, codec streams, KV pages "
                f"used, engine steps) read: {readings[:8]} ... {readings[-4:]}")
            time.sleep(0.02)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if (_metric(tts, "mstar_codec_streams"), _metric(tts, "mstar_kv_pages_used"),
                _metric(tts, "mstar_kv_pages_reserved")) == (0, 0, 0):
            return
        time.sleep(0.05)
    raise AssertionError("the cancelled stream still holds KV pages or codec state")


def test_served_pcm_equals_snac_decoding_the_served_tokens(tts):
    check_served_parity(tts)


def test_openai_streamed_speech_is_valid_wav_and_pcm(tts, oai):
    extra = {"stream": True, "max_tokens": 70, "ignore_eos": True, "seed": 5}
    with oai.audio.speech.with_streaming_response.create(model=tts.dep.name, input="Hi there", voice="leah",
                                                         response_format="wav", extra_body=extra) as response:
        assert response.headers["content-type"].startswith("audio/wav")
        body = b"".join(response.iter_bytes())
    assert body[:4] == b"RIFF" and body[8:16] == b"WAVEfmt " and body[36:40] == b"data"
    channels, rate, _, _, bits = struct.unpack("<HIIHH", body[22:36])
    assert (channels, rate, bits) == (1, 24000, 16)
    num_frames, rest = divmod(len(body) - 44, SAMPLES_PER_FRAME * 2)
    assert rest == 0 and num_frames in (9, 10)  # 70 tokens; a sampled marker token (p ~ 1e-3) costs a frame
    with oai.audio.speech.with_streaming_response.create(model=tts.dep.name, input="Hi there", voice="leah",
                                                         response_format="pcm", extra_body=extra) as response:
        pcm = b"".join(response.iter_bytes())
    def lsb(a: bytes, b: bytes) -> int:  # the codec batches differ between runs: float rounding moves 1 LSB
        return int(np.abs(np.frombuffer(a, "<i2").astype(np.int32) - np.frombuffer(b, "<i2")).max())

    assert len(pcm) == len(body) - 44 and lsb(pcm, body[44:]) <= 1  # same seed, same audio
    whole = oai.audio.speech.create(model=tts.dep.name, input="Hi there", voice="leah", response_format="flac",
                                    extra_body={k: v for k, v in extra.items() if k != "stream"})
    audio, rate = soundfile.read(io.BytesIO(whole.content), dtype="int16")
    assert rate == 24000 and len(audio.tobytes()) == len(pcm) and lsb(audio.tobytes(), pcm) <= 1
    # aac (ADTS): the same clip through FFmpeg's encoder, lined up past the encoder's delay
    av = pytest.importorskip("av")
    aac = oai.audio.speech.create(model=tts.dep.name, input="Hi there", voice="leah", response_format="aac",
                                  extra_body={k: v for k, v in extra.items() if k != "stream"})
    with av.open(io.BytesIO(aac.content), format="aac") as container:
        decoded = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
    want = np.frombuffer(pcm, "<i2") / 32768.0
    assert want.shape[0] <= decoded.shape[0] <= want.shape[0] + 3 * 1024
    lag = max(range(2048), key=lambda k: float(np.dot(decoded[k:k + want.shape[0] - 2048], want[:-2048])))
    a, b = decoded[lag:lag + want.shape[0] - 2048], want[:-2048]
    assert np.dot(a, b) / np.sqrt(np.dot(a, a) * np.dot(b, b)) > 0.9
    # mp3 streamed: encoded chunk by chunk as the codec decodes them, the same clip
    with oai.audio.speech.with_streaming_response.create(model=tts.dep.name, input="Hi there", voice="leah",
                                                         response_format="mp3", extra_body=extra) as response:
        assert response.headers["content-type"].startswith("audio/mpeg")
        chunks = list(response.iter_bytes())
    mp3, rate = soundfile.read(io.BytesIO(b"".join(chunks)), dtype="float32")
    assert rate == 24000 and want.shape[0] <= mp3.shape[0] <= want.shape[0] + 3 * 1152
    lag = max(range(2304), key=lambda k: float(np.dot(mp3[k:k + want.shape[0] - 2304], want[:-2304])))
    a, b = mp3[lag:lag + want.shape[0] - 2304], want[:-2304]
    # random weights make noise-like audio, much of which a 64 kbit/s mp3 drops (0.87 here); another clip: ~0
    assert np.dot(a, b) / np.sqrt(np.dot(a, a) * np.dot(b, b)) > 0.75
    # OpenAI's speed: the same clip at twice the pace, half as long
    fast = oai.audio.speech.create(model=tts.dep.name, input="Hi there", voice="leah", response_format="wav",
                                   speed=2.0, extra_body={k: v for k, v in extra.items() if k != "stream"})
    quick, rate = soundfile.read(io.BytesIO(fast.content), dtype="int16")
    assert rate == 24000 and abs(quick.size - want.shape[0] / 2) <= 0.03 * want.shape[0] / 2


def test_eight_concurrent_streams(tts, oai):
    results, errors = {}, []

    def one(i):
        try:
            with oai.audio.speech.with_streaming_response.create(
                model=tts.dep.name, input=f"Stream number {i}", voice="tara", response_format="pcm",
                extra_body={"stream": True, "max_tokens": 42 + 7 * i, "ignore_eos": True, "temperature": 1.0},
            ) as response:
                results[i] = b"".join(response.iter_bytes())
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and sorted(results) == list(range(8))
    for i, pcm in results.items():  # 42 + 7i tokens; a sampled marker token (p ~ 1e-3 each) costs a frame
        num_frames, rest = divmod(len(pcm), SAMPLES_PER_FRAME * 2)
        assert rest == 0 and num_frames in (5 + i, 6 + i), (i, len(pcm))


def test_cancelled_stream_frees_its_pages_and_codec_state(tts, oai):
    check_cancel_frees(tts, oai)


def test_sdk_tts_and_native_generate(tts, tmp_path):
    client = MStarClient(tts.proxy_url)
    # seeded: unseeded, a sampled marker token (p ~ 1e-3 each, see above) cost a frame in ~3% of runs
    result = client.tts("Hello there", voice="dan", max_tokens=35, ignore_eos=True, return_token_ids=True, seed=5)
    path = result.to_wav(tmp_path / "out.wav")
    audio, rate = soundfile.read(path, dtype="int16")
    assert rate == 24000 and len(audio) == 5 * SAMPLES_PER_FRAME and len(result.token_ids) == 35
    with client.tts("Hello there", voice="dan", max_tokens=35, ignore_eos=True, seed=5, stream=True) as stream:
        chunks = list(stream)
    pcm = b"".join(chunk.pcm for chunk in chunks)
    assert len(chunks) >= 2 and all(chunk.pcm and chunk.sample_rate == 24000 for chunk in chunks[:-1])
    assert not chunks[-1].pcm and chunks[-1].finish_reason == "length" and chunks[-1].usage == result.usage
    streamed = np.frombuffer(pcm, "<i2").astype(np.int32)  # the codec batches differ between runs: 1 LSB
    assert len(pcm) == len(result.pcm) and np.abs(streamed - np.frombuffer(result.pcm, "<i2")).max() <= 1
    body = {"text": "Hi", "output_modalities": ["audio"], "streaming": True,
            "model_kwargs": {"max_tokens": 21, "ignore_eos": True, "voice": "mia"}}
    with httpx.stream("POST", tts.proxy_url + "/generate", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]


def test_the_perf_analyzer_speech_file_replays(tts):
    """perf_analyzer_configs/orpheus: its entries fit the served entry model and one streams audio to its end (at
    28 tokens, not the file's 1200, on this CPU)."""
    from tests.integration.pa_replay import replay

    names, count = replay(tts.grpc_url, tts.entry, "perf_analyzer_configs/orpheus/speech_1200tok.json",
                          max_tokens=[28])
    assert "audio_chunk" in names and count >= 1

def test_bad_requests_are_400s_and_voices_are_listed(tts, oai):
    cases = [({"input": ""}, "'input' must not be empty"),
             ({"input": "hi", "voice": "bob"}, "available voices: ['tara'"),
             ({"input": "word " * 400}, "exceeds the limit of 256 tokens"),
             ({"input": "hi", "response_format": "m4a"}, "response_format")]
    for fields, message in cases:
        with pytest.raises(openai.BadRequestError) as info:
            oai.audio.speech.create(model=tts.dep.name, **{"voice": "tara", **fields})
        assert message in str(info.value), (fields, str(info.value))
    voices = httpx.get(tts.proxy_url + "/v1/audio/voices").json()
    assert voices["voices"][0] == "tara" and voices["default_voice"] == "tara"
    with pytest.raises(openai.BadRequestError, match="speech model"):
        oai.chat.completions.create(model=tts.dep.name, messages=[{"role": "user", "content": "hi"}])


def test_bench_script_smoke_mode(tts, tmp_path):
    """scripts/bench_orpheus.py --smoke against this server (the GPU run starts its own at real shapes)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_orpheus", CONFIGS.parent / "scripts" / "bench_orpheus.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--smoke", "--triton-url", tts.grpc_url, "--checkpoint", str(tts.checkpoint),
                       "--streams-per-proc", "1", "--out", str(out)]) == 0  # c=2: two client processes
    results = {(r["system"], r["concurrency"]): r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {("mstar-triton", 1), ("mstar-triton", 2), ("hf-generate+snac", 1)}
    served = results[("mstar-triton", 2)]
    assert served["errors"] == 0 and served["audio_s"] == pytest.approx(2 * 10 * SAMPLES_PER_FRAME / 24000, abs=0.01)
    # both load processes connected first and sent at one instant: each record keeps its send time
    assert all(len(record) == 6 and 0 <= record[5] < 0.15 for record in served["streams"])
    assert served["send_spread_ms"] < 150
    assert results[("hf-generate+snac", 1)]["audio_s"] > 0
