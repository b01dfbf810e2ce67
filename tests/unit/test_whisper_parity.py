"""Whisper parity on the tiny random checkpoint: our walk, encoder batcher and decoder engine (in-process, the
same code the Triton nodes run) against transformers' `WhisperForConditionalGeneration.generate`.

Every decoder stream the walk opens is recorded; its prompt + tokens must equal transformers' whole decoder
sequence for the same window's audio (greedy): language detection, forced language, translate, timestamps,
an initial prompt, 30 s, and a long upload cut into windows (each window against `generate` on that window).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import re

import numpy as np
import pytest
import soundfile
import torch
import yaml

from mstar_common.cli import CONFIGS
from mstar_common.config import deployment_from_dict
from mstar_common.families.whisper.audio import split_windows
from mstar_common.families.whisper.decoding import LANGUAGE
from tests.whisper_local import LocalWhisper, tiny_deployment

SR = 16_000


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from mstar_common.families.whisper.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("whisper") / "tiny")


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    return (WhisperForConditionalGeneration.from_pretrained(checkpoint).eval(),
            WhisperFeatureExtractor.from_pretrained(checkpoint), AutoTokenizer.from_pretrained(checkpoint))


@pytest.fixture(scope="module")
def local(checkpoint):
    with LocalWhisper(checkpoint) as harness:
        yield harness


def clip(index: int, seconds: float) -> np.ndarray:
    """A distinct synthetic 'utterance' per index (modulated tones; the tiny model listens to them)."""
    t = np.arange(int(SR * seconds)) / SR
    f0 = 150 + 120 * index
    wave = np.sin(2 * np.pi * f0 * t * (1 + 0.3 * np.sin(2 * np.pi * 0.5 * t)))
    return (0.3 * wave * (0.5 + 0.5 * np.sin(2 * np.pi * (1 + index) * t))).astype(np.float32)


def wav(pcm: np.ndarray) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, pcm, SR, format="WAV", subtype="FLOAT")  # lossless: the reference sees the same samples
    return out.getvalue()


def hf_sequence(reference, pcm: np.ndarray, **kwargs) -> list[int]:
    model, extractor, _ = reference
    features = extractor(pcm, sampling_rate=SR, return_tensors="pt").input_features
    with torch.no_grad():
        out = model.generate(features, force_unique_generate_call=True, return_dict_in_generate=True, **kwargs)
    return out.sequences[0].tolist()


def our_sequences(local) -> list[list[int]]:
    """prompt + tokens of each transcribing decoder stream (a standalone language detection is skipped)."""
    return [[int(t) for t in call["inputs"]["input_ids"]] + call["tokens"] for call in local.decoder_calls
            if list(call["inputs"]["forced_ids"]) != [LANGUAGE] or "max_tokens" not in call["inputs"]]


CASES = {
    "detect language, 5 s": (clip(0, 5), {}, {}),
    "forced language, 30 s": (clip(1, 30), {"language": "fr"}, {"language": "fr"}),
    "translate": (clip(2, 9), {"language": "german", "task": "translate"}, {"language": "de", "task": "translate"}),
    "timestamps, detect": (clip(3, 17), {"timestamps": True, "temperature": 0.0}, {"return_timestamps": True}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_equal_transformers_generate(local, reference, name):
    pcm, ours, theirs = CASES[name]
    local.decoder_calls.clear()
    out = asyncio.run(local.transcribe(audio=wav(pcm), **ours))
    [sequence] = our_sequences(local)
    assert sequence == hf_sequence(reference, pcm, **theirs)
    assert out["language"] == theirs.get("language", local.walk.tokens.code_of(sequence[1]))


def test_initial_prompt_and_language_detection(local, reference):
    _, _, tokenizer = reference
    pcm = clip(1, 9)
    local.decoder_calls.clear()
    asyncio.run(local.transcribe(audio=wav(pcm), prompt="hello world"))
    prompt_ids = torch.tensor(tokenizer.get_prompt_ids("hello world"))
    assert our_sequences(local) == [hf_sequence(reference, pcm, prompt_ids=prompt_ids)]


def test_timestamp_segments_match_transformers(local, reference):
    model, extractor, _ = reference
    pcm = clip(3, 17)
    out = asyncio.run(local.transcribe(audio=wav(pcm), timestamps=True, temperature=0.0))
    features = extractor(pcm, sampling_rate=SR, return_tensors="pt").input_features
    result = model.generate(features, return_timestamps=True, return_segments=True, force_unique_generate_call=True)
    theirs = result["segments"][0]
    ours = json.loads(out["segments"])
    # Every decoded token is in a segment: the closed ones as the reference's, then the tail after the last
    # timestamp pair as one more (the reference's segments leave it out; its sequence and text hold it).
    sequence = [t for t in result["sequences"][0].tolist() if t != model.generation_config.eos_token_id]
    flat = [t for got in ours for t in got["tokens"]]
    assert len(sequence) - len(flat) == 3 and flat == sequence[3:]  # after <|startoftranscript|><|lang|><|task|>
    assert len(ours) == len(theirs) + 1
    assert theirs, "the reference closed no segment"
    # The reference's times count in the model's 30 s frame; ours are held to the 17 s of audio and kept in order
    # (random weights put the first segment's end at ~24 s).
    floor = 0.0
    for want, got in zip(theirs, ours, strict=False):
        assert got["tokens"] == want["tokens"].tolist()
        start = min(max(float(want["start"]), floor), 17.0)
        end = min(max(float(want["end"]), start), 17.0)
        assert got["start"] == pytest.approx(start) and got["end"] == pytest.approx(end)
        floor = end
    assert any(float(want["end"]) > 17.0 for want in theirs)  # (so the hold above is exercised)


def test_long_upload_windows_each_equal_transformers(local, reference):
    rng = np.random.default_rng(2)
    pcm = np.concatenate([clip(4, 27), np.zeros(SR // 2, np.float32), clip(5, 24), 0.01 * rng.standard_normal(
        SR // 2).astype(np.float32), clip(6, 18)])
    windows = split_windows(pcm)
    assert len(windows) == 3
    local.decoder_calls.clear()
    out = asyncio.run(local.transcribe(audio=wav(pcm)))
    sequences = sorted(our_sequences(local), key=len)  # calls finish in any order; match them by content
    language = out["language"]
    want = [hf_sequence(reference, pcm[w.start:w.end], **({} if i == 0 else {"language": language}))
            for i, w in enumerate(windows)]
    assert sorted(sequences) == sorted(want)
    segments = json.loads(out["segments"])
    assert [s["start"] for s in segments] == pytest.approx([w.offset_s for w in windows][: len(segments)])
    assert out["duration"] == pytest.approx(pcm.shape[0] / SR)


SCORE_CASES = {  # (audio, our inputs, transformers' generate kwargs)
    "detect language, untimed (overlapped steps)": CASES["detect language, 5 s"],
    "forced language, timed (steps collected one by one)": (clip(3, 17), {"language": "fr", "timestamps": True,
                                                                            "temperature": 0.0},
                                                            {"language": "fr", "return_timestamps": True}),
    "an initial prompt before <|startoftranscript|>": (clip(1, 9), {"prompt": "hello world", "language": "en"},
                                                       {"language": "en"}),
}


def reference_scores(reference, tokens, pcm: np.ndarray, **theirs) -> tuple[list[int], float, float]:
    """transformers' decoder sequence for the window, its `avg_logprob` (OpenAI Whisper's definition, from
    `generate`'s processed scores) and `no_speech_prob` (a teacher-forced forward's raw logits at
    <|startoftranscript|>)."""
    model, extractor, _ = reference
    features = extractor(pcm, sampling_rate=SR, return_tensors="pt").input_features
    with torch.no_grad():
        generated = model.generate(features, force_unique_generate_call=True, return_dict_in_generate=True,
                                   output_scores=True, **theirs)
        sequence = generated.sequences[0].tolist()
        free = sequence[len(sequence) - len(generated.scores):]  # generate's own steps: the forced prefix is not
        logprobs = [torch.log_softmax(score[0].float(), -1)[token].item()
                    for score, token in zip(generated.scores, free, strict=True)]
        logits = model(input_features=features, decoder_input_ids=torch.tensor([sequence])).logits[0]
    avg = sum(logprobs) / (sum(t != tokens.eot for t in free) + 1)  # ended by <|endoftext|> or by length
    no_speech = torch.softmax(logits[sequence.index(tokens.sot)].float(), -1)[tokens.no_speech].item()
    return sequence, avg, no_speech


def assert_window_scores(segments: list[dict], avg: float, no_speech: float) -> None:
    assert segments, "no text to attach the scores to"
    for segment in segments:  # every segment of the window carries the window's scores
        assert segment["avg_logprob"] == pytest.approx(avg, rel=1e-5)
        assert segment["no_speech_prob"] == pytest.approx(no_speech, rel=1e-5)
    assert avg < 0 and 0 < no_speech < 1


@pytest.mark.parametrize("name", list(SCORE_CASES))
def test_window_scores_equal_transformers(local, reference, name):
    """Each segment's `avg_logprob` and `no_speech_prob` (OpenAI Whisper's definitions) against transformers on the
    same window: the mean log-probability of `generate`'s free tokens under its own processed scores (the token
    rules; <|endoftext|> counted, divided by the other tokens + 1), and P(<|nospeech|>) from the model's raw logits
    at <|startoftranscript|> on the decoded sequence."""
    pcm, ours, theirs = SCORE_CASES[name]
    if "prompt" in ours:
        theirs = {**theirs, "prompt_ids": torch.tensor(reference[2].get_prompt_ids(ours["prompt"]))}
    local.decoder_calls.clear()
    out = asyncio.run(local.transcribe(audio=wav(pcm), **ours))
    sequence, avg, no_speech = reference_scores(reference, local.walk.tokens, pcm, **theirs)
    assert our_sequences(local) == [sequence]
    assert_window_scores(json.loads(out["segments"]), avg, no_speech)


def test_the_fallback_retries_an_unsure_window_at_higher_temperatures(local):
    """A timestamped request without a temperature: the tiny random model is unsure of every token (avg_logprob
    far under -1) without repeating itself, so only OpenAI Whisper's log-probability rule sends the window back,
    through every temperature; the last decode's tokens and scores are the ones kept."""
    from ensembles.whisper import FALLBACK_TEMPERATURES
    from mstar_common.families.whisper.decoding import compression_ratio

    local.decoder_calls.clear()
    out = asyncio.run(local.transcribe(audio=wav(clip(3, 17)), timestamps=True, seed=11))
    calls = local.decoder_calls
    assert [float(c["inputs"]["temperature"][0]) for c in calls] == pytest.approx(list(FALLBACK_TEMPERATURES))
    first = local.walk.tokenizer.decode(local.walk.tokens.text_ids(calls[0]["tokens"]), skip_special_tokens=True)
    assert compression_ratio(first) <= 2.4 and calls[0]["scores"]["avg_logprob"] < -1  # the old rule kept it
    segments = json.loads(out["segments"])
    assert segments and {s["temperature"] for s in segments} == {1.0}
    # every segment carries its window's compression ratio (OpenAI Whisper's), that of the kept decode's whole text
    kept = local.walk.tokenizer.decode(local.walk.tokens.text_ids(calls[-1]["tokens"]), skip_special_tokens=True)
    ratio = round(compression_ratio(kept.strip()), 4)
    assert len(segments) > 1 and {s["compression_ratio"] for s in segments} == {ratio}
    assert [s["avg_logprob"] for s in segments] == pytest.approx([calls[-1]["scores"]["avg_logprob"]] * len(segments),
                                                                rel=1e-5)


def test_the_fallback_rules_and_the_no_speech_skip(local, monkeypatch):
    from ensembles import whisper as walk

    rules, scores = walk.FallbackRules(), walk._Scores
    unsure, sure, silent = scores(-1.5, 0.1), scores(-0.5, 0.9), scores(-1.5, 0.9)
    assert rules.needs_fallback("a short text", unsure) and not rules.needs_fallback("a short text", sure)
    assert rules.needs_fallback("ab" * 200, sure)  # repetitive: compresses over 2.4
    assert not rules.needs_fallback("ab" * 200, silent)  # silence is not retried
    assert not rules.needs_fallback("a short text", scores(None, None))  # nothing decoded: nothing to judge
    assert rules.should_skip(silent) and not rules.should_skip(sure) and not rules.should_skip(unsure)
    # a rule set to None is off (OpenAI Whisper's and transformers' convention)
    assert not walk.FallbackRules(logprob_threshold=None).needs_fallback("a short text", unsure)
    assert not walk.FallbackRules(compression_ratio_threshold=None).needs_fallback("ab" * 200, sure)
    assert walk.FallbackRules(logprob_threshold=None).should_skip(sure)  # no log-probability to overrule it
    assert not walk.FallbackRules(no_speech_threshold=None).should_skip(silent)
    assert walk.FallbackRules(no_speech_threshold=None).needs_fallback("a short text", silent)

    decode = walk._Transcription._decode
    texts = {}
    for name, given in {"silence": silent, "speech": sure}.items():
        async def scored(self, *args, given=given):
            free, finish, _ = await decode(self, *args)
            return free, finish, given

        monkeypatch.setattr(walk._Transcription, "_decode", scored)
        local.decoder_calls.clear()
        out = asyncio.run(local.transcribe(audio=wav(clip(2, 6)), timestamps=True))
        texts[name] = (out["text_output"], json.loads(out["segments"]), len(local.decoder_calls))
    assert texts["silence"] == ("", [], 1)  # dropped after one decode: not retried, no text, no segment
    assert texts["speech"][0] and texts["speech"][1] and texts["speech"][2] == 1  # sure: kept at once

    # A timestamped request with its own temperature is never retried, but silence is dropped all the same (OpenAI
    # Whisper's no-speech check runs whatever the temperatures); an untimed one streams as it decodes and keeps it.
    async def silence(self, *args):
        free, finish, _ = await decode(self, *args)
        return free, finish, silent

    monkeypatch.setattr(walk._Transcription, "_decode", silence)
    local.decoder_calls.clear()
    out = asyncio.run(local.transcribe(audio=wav(clip(2, 6)), timestamps=True, temperature=0.4, seed=3, language="en"))
    assert (out["text_output"], json.loads(out["segments"]), len(local.decoder_calls)) == ("", [], 1)
    assert local.decoder_calls[0]["tokens"]  # it decoded text, and dropped it
    out = asyncio.run(local.transcribe(audio=wav(clip(2, 6)), temperature=0.4, seed=3, language="en"))
    assert out["text_output"]


def test_the_language_is_detected_greedily_and_kept_by_the_retries(local):
    """Without a language, window 0 detects it by argmax, as OpenAI Whisper and transformers do, and never draws it at
    a temperature: in the fallback, the retries (0.2 ... 1.0) carry the language the greedy first decode found; with
    a temperature over 0, detection is a greedy one-token decode of its own before the window's."""
    local.decoder_calls.clear()
    out = asyncio.run(local.transcribe(audio=wav(clip(3, 17)), timestamps=True, seed=11))
    calls = local.decoder_calls
    assert len(calls) == 6 and [int(t) for t in calls[0]["inputs"]["forced_ids"]][0] == LANGUAGE
    language = local.walk.tokens.lang_to_id[out["language"]]
    assert calls[0]["tokens"][0] == language  # the first decode (at 0) detected it
    for call in calls[1:]:  # every retry's prompt carries it: no LANGUAGE placeholder left to sample
        assert LANGUAGE not in [int(t) for t in call["inputs"]["forced_ids"]]
        assert language in [int(t) for t in call["inputs"]["input_ids"]]

    local.decoder_calls.clear()
    out = asyncio.run(local.transcribe(audio=wav(clip(3, 17)), temperature=1.0, seed=5))
    detect, decode = local.decoder_calls
    assert [int(t) for t in detect["inputs"]["forced_ids"]] == [LANGUAGE] and "temperature" not in detect["inputs"]
    assert detect["tokens"] == [language]  # greedy: the same language as above
    assert LANGUAGE not in [int(t) for t in decode["inputs"]["forced_ids"]]
    assert language in [int(t) for t in decode["inputs"]["input_ids"]]
    assert float(decode["inputs"]["temperature"][0]) == 1.0 and out["language"]


def test_segments_split_as_transformers_cuts_them(checkpoint):
    """`split_segments`, as transformers' `_retrieve_segment`: consecutive timestamps close a segment, a window that
    ends in a pair gives the last segment both, a single trailing timestamp closes it, and without a pair the window
    is one segment. Where the token cap cut a window after a pair, transformers still gives the last segment both
    timestamps (`slices[-1] += 1`) and decodes the rest again from there; windows here are decoded once, so that
    rest is a tail segment, from the segment's end to the window's."""
    from mstar_common.families.whisper.decoding import split_segments
    from mstar_common.families.whisper.family import read_tokens

    tokens = read_tokens(checkpoint)
    ts = lambda seconds: tokens.timestamp_begin + round(seconds / 0.02)  # noqa: E731
    a, b, c = 300, 301, 302  # text tokens

    def cut(free):
        return [(round(s.start, 2), round(s.end, 2), s.token_ids) for s in split_segments(tokens, free, 10.0, 20.0)]

    assert cut([ts(0), a, b, ts(5), ts(5), c, ts(9), ts(9)]) == [
        (10.0, 15.0, [ts(0), a, b, ts(5)]), (15.0, 19.0, [ts(5), c, ts(9), ts(9)])]
    assert cut([ts(0), a, ts(5), ts(6), c, ts(9)]) == [(10.0, 15.0, [ts(0), a, ts(5)]), (16.0, 19.0, [ts(6), c, ts(9)])]
    assert cut([ts(0), a, ts(5), ts(6), c]) == [(10.0, 15.0, [ts(0), a, ts(5), ts(6)]), (15.0, 30.0, [c])]
    assert cut([ts(0), a, b, ts(4)]) == [(10.0, 14.0, [ts(0), a, b, ts(4)])]
    assert cut([ts(0), a, b]) == [(10.0, 30.0, [ts(0), a, b])]


def test_the_fallback_thresholds_from_the_deployment(checkpoint):
    """`model_kwargs` sets the thresholds; all three null: a timestamped request decodes once."""
    from mstar_common.config import DeploymentError
    from mstar_common.families.whisper.family import options_from_kwargs

    off = {"compression_ratio_threshold": None, "logprob_threshold": None, "no_speech_threshold": None}
    with LocalWhisper(checkpoint, tiny_deployment(model_kwargs=off)) as harness:
        assert harness.walk.options.fallback == harness.walk.options.fallback.__class__(None, None, None)
        asyncio.run(harness.transcribe(audio=wav(clip(3, 17)), timestamps=True, seed=11))
        assert len(harness.decoder_calls) == 1
    for key, value, rule in (("logprob_threshold", 0.5, "<= 0.0"), ("no_speech_threshold", 1.5, "in [0.0, 1.0]"),
                             ("compression_ratio_threshold", "2.4", ">= 0.0"), ("logprob_threshold", True, "<= 0.0")):
        with pytest.raises(DeploymentError, match=rf"model_kwargs.{key}: must be null \(the rule off\) or a "
                                                  rf"number {re.escape(rule)}"):
            options_from_kwargs({key: value}, "test")


def test_a_max_tokens_past_the_windows_room_is_refused_naming_the_room(local):
    """ENGINE.md: refuse rather than truncate. A larger `max_tokens` was cut to what a window's decoder positions
    leave after its prompt, silently (and before that came back as the decoder's `max_tokens: must be in [0, 124]`,
    a cap the client never sent); now the 400 names that room."""
    data = wav(clip(1, 5))
    room = local.walk.tokens.max_length - 4  # <|startoftranscript|>, the language, the task, <|notimestamps|>
    unset = asyncio.run(local.transcribe(audio=data, language="en"))
    at_room = asyncio.run(local.transcribe(audio=data, language="en", max_tokens=room))
    assert at_room["text_output"] == unset["text_output"] and at_room["finish_reason"] == unset["finish_reason"]
    for extra in ({}, {"prompt": "hello world"}):
        with pytest.raises(ValueError, match=rf"^max_tokens: at most \d+ tokens a window with this prompt \(the "
                                             rf"decoder's {room + 4} positions less its \d+ prompt tokens\), got "
                                             rf"{room + 1}$"):
            asyncio.run(local.transcribe(audio=data, language="en", max_tokens=room + 1, **extra))
    asyncio.run(local.transcribe(audio=data, language="en", max_tokens=room + 1, timestamps=True))  # 3 tokens


def test_streamed_deltas_join_to_the_final_text_and_batching_keeps_requests_apart(local):
    uploads = [wav(clip(i, 4 + 3 * i)) for i in range(8)]
    solo = [asyncio.run(local.transcribe(audio=data, language="en", max_tokens=32))["text_output"] for data in uploads]

    async def together():
        return await asyncio.gather(*(local.stream(audio=data, language="en", max_tokens=32) for data in uploads))

    for responses, want in zip(asyncio.run(together()), solo, strict=True):
        assert "".join(r["text_output"] for r in responses) == want  # 8 at once: cross-KV slots never mix
        assert responses[-1]["finish_reason"] in ("stop", "length")
        assert all(r["finish_reason"] == "" for r in responses[:-1])
    assert any(solo) and len(set(solo)) > 1


@pytest.mark.parametrize("inputs, rule", [
    ({"language": "klingon"}, "language: 'klingon' is not a language"),
    ({"task": "summarize"}, "task: must be one of"),
    ({"temperature": -0.5}, "temperature: must be in"),
    ({"temperature": 1.5}, r"temperature: must be in \[0, 1\], got 1.5"),  # the OpenAI route's range everywhere
    ({"prompt": "word " * 200}, r"prompt: \d+ tokens; at most 63"),
    ({"prompt": "<|en|> hi"}, "prompt: must be plain text"),
    ({"audio": b"not audio" * 50}, "audio: not a readable audio file"),
    ({"audio": b""}, "audio: the upload is empty"),
])
def test_refusals_name_the_field(local, inputs, rule):
    inputs = {"audio": wav(clip(0, 2)), **inputs}
    with pytest.raises(ValueError, match=rule):
        asyncio.run(local.transcribe(**inputs))


def test_upload_caps(checkpoint):
    dep = tiny_deployment(**{"limits.max_upload_s": 20.0, "model_kwargs.max_audio_bytes": 2_000_000})
    with LocalWhisper(checkpoint, dep) as small:
        with pytest.raises(ValueError, match="audio: the audio is 25.0 s long; this deployment accepts at most 20 s"):
            asyncio.run(small.transcribe(audio=wav(clip(0, 25))))
        with pytest.raises(ValueError, match="at most 2000000 bytes"):
            asyncio.run(small.transcribe(audio=wav(clip(0, 19)) + b"\0" * 2_000_000))
        assert asyncio.run(small.transcribe(audio_pcm=clip(0, 3), sample_rate=SR))["finish_reason"]


def test_captured_decode_steps_equal_transformers(checkpoint, reference):
    """The decoder's decode steps through the engine's graph runner (CPU stand-in: FakeGraph over static buffers,
    graph-safe attention) with the packed q/k/v projection: the rows' cross-KV slots come from a static buffer,
    the token rules run on the replay's logits."""
    from mstar_common.engine.ar_engine import AREngine
    from mstar_common.engine.attention import TorchStaticAttention
    from mstar_common.engine.cuda_graph import GraphConfig

    harness = LocalWhisper(checkpoint)
    eager = harness.decoder.engine
    model = eager.runner.model
    model.attn_backend = TorchStaticAttention()
    model.fuse_projections()  # the GPU's packed q/k/v GEMM, here against transformers too
    attn = model.model.decoder.layers[0].self_attn
    packed = attn.qkv_proj.weight
    assert attn.k_proj.weight.data_ptr() == packed.data_ptr() + packed[0].numel() * packed.element_size() * \
        attn.q_proj.out_features  # the HF parameters are views of the packed weight: stored once
    harness.decoder.engine = AREngine(model, eager.config, eos_token_ids=sorted(eager.eos_token_ids),
                                      vocab_size=eager.vocab_size,
                                      graphs=GraphConfig(decode_buckets=[1, 2, 4], token_buckets=[],
                                                         capture_sampling=False))
    with harness:
        for pcm, ours, theirs in (CASES["detect language, 5 s"], CASES["timestamps, detect"]):
            harness.decoder_calls.clear()
            out = asyncio.run(harness.transcribe(audio=wav(pcm), **ours))
            sequence, avg, no_speech = reference_scores(reference, harness.walk.tokens, pcm, **theirs)
            assert our_sequences(harness) == [sequence]
            assert_window_scores(json.loads(out["segments"]), avg, no_speech)  # scored after each replay
        assert harness.decoder.engine.runner.graphs.num_replays > 100


@pytest.mark.gpu
def test_gpu_decoder_fused_ops_keep_the_tokens(checkpoint):
    """On a GPU (fp32, captured decode graphs, Triton attention): the packed q/k/v GEMM and the fused residual-add
    + LayerNorm kernel give the tokens of the same decoder with `fused_ops: false` (HF's separate ops). (Against
    transformers on the CPU the tiny random model's near-ties flip with cuDNN's TF32 convolutions.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mstar_common.layers.norm import ResidualLayerNorm

    sequences, scores = [], []
    for fused in (True, False):
        raw = yaml.safe_load((CONFIGS / "whisper.yaml").read_text())
        for name in ("encoder", "decoder"):  # fused_ops is the decoder's (the encoder refuses it)
            raw["components"][name] = {"placement": {"device": "gpu", "gpus": [0], "instances": 1},
                                       "cuda_graphs": True, **({"fused_ops": fused} if name == "decoder" else {})}
        harness = LocalWhisper(checkpoint, deployment_from_dict(raw, source="test-whisper-gpu"), device="cuda:0")
        model = harness.decoder.engine.runner.model
        assert (model.model.decoder.layers[0].self_attn.qkv_proj is not None) == fused
        assert all(m.use_kernel == fused for m in model.modules() if isinstance(m, ResidualLayerNorm))
        with harness:
            segments = []
            for pcm, ours, _ in (CASES["detect language, 5 s"], CASES["translate"], CASES["timestamps, detect"]):
                segments += json.loads(asyncio.run(harness.transcribe(audio=wav(pcm), **ours))["segments"])
            sequences.append(our_sequences(harness))
            scores.append([(s["avg_logprob"], s["no_speech_prob"]) for s in segments])
            assert harness.decoder.engine.runner.graphs.num_replays > 50
    assert sequences[0] == sequences[1]
    assert sum(len(s) for s in sequences[0]) > 100
    # the window scores, read back beside the tokens from the device, agree between the two op orders
    assert scores[0] and all(avg < 0 and 0 < no_speech < 1 for avg, no_speech in scores[0])
    assert np.asarray(scores[0]) == pytest.approx(np.asarray(scores[1]), rel=1e-3)


class _Seq:
    def __init__(self, state, token_ids):
        self.request_state, self.token_ids = state, token_ids


def test_token_rules_rows_without_list_indexing(checkpoint):
    """The rule masks (suppress, begin-suppress, forced tokens) row by row == the list-indexed form they
    replaced (which synced the CUDA stream each step); all-rows and some-rows paths both checked."""
    from mstar_common.families.whisper.decoding import _NEG_INF, TokenRules, WhisperDecodeState
    from mstar_common.families.whisper.family import read_tokens

    tokens = read_tokens(checkpoint)
    rules = TokenRules(tokens, "cpu")
    prompt = [tokens.sot]
    forced = [tokens.lang_to_id["en"], tokens.task_to_id["transcribe"], tokens.no_timestamps]
    state = lambda f: WhisperDecodeState(None, forced=list(f), timestamps=False, num_prompt_tokens=1)  # noqa: E731
    generator = torch.Generator().manual_seed(0)
    cases = {
        "every row free": [_Seq(state([]), prompt + [5] * k) for k in (1, 3, 7)],
        "every row at its first free token": [_Seq(state([]), prompt), _Seq(state(forced), prompt + forced)],
        "mixed": [_Seq(state(forced), prompt), _Seq(state([]), prompt), _Seq(state([]), prompt + [7, 8]),
                  _Seq(state(forced), prompt + forced[:2]), _Seq(None, prompt)],
    }
    for name, seqs in cases.items():
        logits = torch.randn(len(seqs), tokens.vocab_size, generator=generator)
        want = logits.clone()
        begin, free = [], []
        for row, seq in enumerate(seqs):  # the replaced form, with list indexing
            if seq.request_state is None:
                continue
            generated = len(seq.token_ids) - 1
            f = seq.request_state.forced
            if generated < len(f):
                keep = want[row, f[generated]].clone()
                want[row] = _NEG_INF
                want[row, f[generated]] = keep
                continue
            free.append(row)
            if generated == len(f):
                begin.append(row)
        if begin:
            want[begin] = want[begin].masked_fill(rules._begin_suppress, _NEG_INF)
        if free:
            want[free] = want[free].masked_fill(rules._suppress, _NEG_INF)
        got = rules.process(logits, seqs)
        assert torch.equal(got, want), name
        assert torch.isinf(got).any(), name  # the rules did mask something


@pytest.mark.gpu
def test_token_rules_do_not_sync_the_stream(checkpoint):
    """Without timestamps the rules launch only device work: CUDA's sync debug mode raises on any sync."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mstar_common.families.whisper.decoding import TokenRules, WhisperDecodeState
    from mstar_common.families.whisper.family import read_tokens

    tokens = read_tokens(checkpoint)
    rules = TokenRules(tokens, "cuda")
    forced = [tokens.lang_to_id["en"], tokens.task_to_id["transcribe"]]
    seqs = [_Seq(WhisperDecodeState(None, forced=list(f), timestamps=False, num_prompt_tokens=1), [tokens.sot] + t)
            for f, t in (([], [3]), (forced, []), ([], []))]
    logits = torch.randn(len(seqs), tokens.vocab_size, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rules.process(logits, seqs)  # some rows free, one forced, one at its first free token
        rules.process(logits[:1], seqs[:1])  # every row free
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_the_mid_gemm_timing_inputs_run_through_the_decoder(checkpoint):
    """MSTAR_MID_GEMM=auto (the default) times each 5-64-row decode bucket at start-up on inputs of its own
    (`CudaGraphRunner._fill_timing`): the decoder, with its cross-attention slots and learned positions, must take
    them (here on the CPU stand-in; positions stay under its 448-token table)."""
    from mstar_common.engine.ar_engine import AREngine
    from mstar_common.engine.attention import TorchStaticAttention
    from mstar_common.engine.cuda_graph import DECODE, GREEDY, GraphConfig

    harness = LocalWhisper(checkpoint)
    eager = harness.decoder.engine
    model = eager.runner.model
    model.attn_backend = TorchStaticAttention()
    # pages of 256 tokens: one page holds more than the 128 positions the tiny decoder embeds
    config = dataclasses.replace(eager.config, page_size=256, num_kv_pages=16)
    engine = AREngine(model, config, eos_token_ids=sorted(eager.eos_token_ids), vocab_size=eager.vocab_size,
                      graphs=GraphConfig(decode_buckets=[1, 8], token_buckets=[], capture_sampling=False))
    runner = engine.runner.graphs
    key = (DECODE, 8, GREEDY)
    with torch.inference_mode():  # as in `capture`
        context = runner._fill_timing(key)
        runner.graphs[key].replay()  # the stand-in re-runs the step over those inputs
    assert context == config.max_model_len == 128
    assert runner.buffers.out_tokens[: key[1]].min() >= 0


def test_a_window_that_fails_leaves_no_failure_unread_for_the_loop_to_log(local, monkeypatch):
    """The language every window waits for carries the first failure; with the other windows cancelled no one read
    it, and asyncio logged 'Future exception was never retrieved' at ERROR with a traceback for each such request
    (a client leaving a multi-window upload, seen in a QA pass)."""
    import gc

    from mstar_common.walk_api import ComponentError

    async def encoder_refuses(component, inputs):
        raise ComponentError(component, "cancelled: the client went away")

    monkeypatch.setattr(local, "call", encoder_refuses)
    lost = []

    async def transcribe():
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: lost.append(context["message"]))
        with pytest.raises(ComponentError):
            await local.transcribe(audio=wav(clip(0, 70)))
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(transcribe())
    assert lost == []


def test_a_deployment_without_limits_starts_with_the_upload_cap_under_the_body_cap():
    """Left out, `max_audio_bytes` is OpenAI's 25 MiB or the proxy's body cap where that is smaller (16 MiB unless
    `limits.max_body_bytes` is set): a deployment with neither set was refused at startup."""
    from mstar_common.config import DeploymentError
    from mstar_common.families.whisper.family import WhisperOptions, max_audio_bytes

    raw = yaml.safe_load((CONFIGS / "whisper.yaml").read_text())
    raw.pop("limits", None)
    raw["model_kwargs"].pop("max_audio_bytes", None)
    dep = deployment_from_dict(raw, source="test")
    assert max_audio_bytes(dep, WhisperOptions()) == dep.limits.max_body_bytes == 16 * 1024 * 1024
    raw["limits"] = {"max_body_bytes": 64 * 1024 * 1024}
    assert max_audio_bytes(deployment_from_dict(raw, source="test"), WhisperOptions()) == 25 * 1024 * 1024
    raw["limits"], raw["model_kwargs"]["max_audio_bytes"] = {}, 20 * 1024 * 1024  # set, over the cap: refused
    with pytest.raises(DeploymentError, match="max_audio_bytes: 20971520 exceeds limits.max_body_bytes"):
        deployment_from_dict(raw, source="test")


def test_a_first_window_whose_decode_is_cancelled_does_not_leave_the_others_waiting(local):
    """Without a language, windows 1.. wait for window 0's first token, the detected language. A client that left
    while window 0's decode was queued got that hop cancelled: its stream ended with no token, the language was
    never set, and the walk waited on window 1 for ever (until its deadline), holding its admission place and the
    upload. Now the waiting windows fail at once and the walk ends."""
    from mstar_common.families.whisper import graph as g

    async def call(component, inputs):
        return {g.ENCODER_OUTPUT: np.zeros((1, 4, 8), np.float32)}

    async def call_stream(component, inputs):  # the decoder hop, cancelled before its first token
        return
        yield

    async def transcribe():
        inputs = {g.AUDIO_PCM: clip(1, 45), g.SAMPLE_RATE: np.array([SR], np.int32)}
        return [out async for out in local.walk.stream(inputs, call, call_stream)]

    with pytest.raises(RuntimeError, match="window 0's decode ended without a token, so no language was detected"):
        asyncio.run(asyncio.wait_for(transcribe(), timeout=10))


def test_the_walk_sizes_prompts_and_max_tokens_by_the_deployments_max_model_len(checkpoint):
    """With resources.max_model_len below the checkpoint's positions, the walk sized the prompt's half and each
    window's max_tokens room by the checkpoint's: max_tokens 1,000,000 was a 400 quoting a cap the client never sent
    (the decoder's), and a long prompt a 400 naming the internal input_ids instead of prompt."""
    dep = tiny_deployment(**{"resources.max_model_len": 64})
    with LocalWhisper(checkpoint, dep=dep) as harness:
        assert harness.walk.tokens.max_length == 64 and harness.walk.max_prompt_tokens == 31
        out = asyncio.run(harness.transcribe(audio=wav(clip(2, 5)), language="en", max_tokens=60))
        assert out["finish_reason"] in ("stop", "length")
        with pytest.raises(ValueError, match=r"^max_tokens: at most 60 tokens a window .*decoder's 64 positions"):
            asyncio.run(harness.transcribe(audio=wav(clip(2, 5)), language="en", max_tokens=1_000_000))
        with pytest.raises(ValueError, match=r"^prompt: "):
            asyncio.run(harness.transcribe(audio=wav(clip(2, 5)), language="en", prompt=" the" * 200))


def test_a_window_that_fails_while_window_0_detects_the_language_apart_gives_its_own_error(local):
    """With a prompt or a temperature above 0, window 0 detects the language in a one-token decode of its own while
    the other windows run their encoder calls. One of those failing sets the shared language to its error, and the
    detection's set_result on that done future raised InvalidStateError: a 500 instead of the failure's own status
    (a 429, 503, 504 or the client's cancel)."""
    from mstar_common import wire
    from mstar_common.families.whisper import graph as g
    from mstar_common.walk_api import ComponentError

    language = local.walk.tokens.lang_to_id["en"]

    async def call(component, inputs):
        if not call.first:  # window 0's call is the first; every later one fails
            raise ComponentError("encoder", wire.OVERLOADED_PREFIX + "encoder queue full")
        call.first = False
        return {g.ENCODER_OUTPUT: np.zeros((1, 4, 8), np.float32)}
    call.first = True

    async def call_stream(component, inputs):  # the detection: one token, after the other windows' encoder calls
        await asyncio.sleep(0.05)
        yield {"token_ids": np.array([language], np.int32), "finish_reason": np.array([b"length"], object)}

    async def transcribe(**extra):
        inputs = {g.AUDIO_PCM: clip(1, 45), g.SAMPLE_RATE: np.array([SR], np.int32), **extra}
        return [out async for out in local.walk.stream(inputs, call, call_stream)]

    for extra in ({g.TEMPERATURE: np.array([0.5], np.float32)}, {g.PROMPT: np.array([b"hello"], object)}):
        call.first = True
        with pytest.raises(ComponentError, match="encoder queue full"):
            asyncio.run(asyncio.wait_for(transcribe(**extra), timeout=10))


def test_a_windows_failure_ends_the_request_at_once_and_starts_no_more_hops(local):
    """A window's error queued for the client in that window's turn only: a 429 of window 1 reached the client after
    window 0 had decoded to its end (or became a 504 at the deadline), while windows 2.. still opened decoder
    streams for a request that had failed (docs/reliability.md: the walk ends its stream at the first error)."""
    import time

    from mstar_common import wire
    from mstar_common.families.whisper import graph as g
    from mstar_common.walk_api import ComponentError

    token = local.walk.tokens.text_ids(list(range(40)))[5]
    opened = []

    async def call(component, inputs):
        return {g.ENCODER_OUTPUT: np.zeros((1, 4, 8), np.float32)}

    async def call_stream(component, inputs):
        opened.append(time.monotonic() - started)
        if len(opened) == 2:  # window 1's decoder refuses it
            raise ComponentError("decoder", wire.OVERLOADED_PREFIX + "64 requests in whisper_decoder already")
        yield {"token_ids": np.array([token], np.int32)}
        await asyncio.Event().wait()  # window 0 decodes on, never to end: the failure must not wait for it
        yield {"token_ids": np.array([token], np.int32), "finish_reason": np.array([b"stop"], object)}

    async def transcribe():
        inputs = {g.AUDIO_PCM: clip(1, 140), g.SAMPLE_RATE: np.array([SR], np.int32),
                  g.LANGUAGE: np.array([b"en"], object)}
        return [out async for out in local.walk.stream(inputs, call, call_stream)]

    options = local.walk.options
    local.walk.options = dataclasses.replace(options, max_parallel_windows=2)
    started = time.monotonic()
    try:  # (window 0 never ends: a failure that waited for it would time out here instead)
        with pytest.raises(ComponentError, match="64 requests"):
            asyncio.run(asyncio.wait_for(transcribe(), timeout=30))
    finally:
        local.walk.options = options
    assert len(opened) == 2, opened  # windows 2.. (5 in all) never reached the decoder


def test_the_encoder_buckets_give_the_encoders_output_and_transformers(local, reference):
    """The GPU deployment runs the encoder through captured batch buckets (`cuda_graphs: true`); on the CPU the same
    buckets replay eagerly over their static inputs. Batches of 1 and 3 windows (3 pads to the 4-row bucket) through
    the buckets equal the plain forward, and transformers' encoder on its own features."""
    from mstar_common.families.whisper.encoder_graphs import EncoderGraphs
    from mstar_common.families.whisper.frontend import pad_or_trim

    model, extractor, _ = reference
    encoder = local.encoder
    graphs = EncoderGraphs(encoder.forward, (encoder.num_samples,), [1, 2, 4], "cpu", capture=False)
    windows = [clip(i, seconds) for i, seconds in ((1, 4), (2, 30), (3, 11.5))]
    pcm = torch.stack([pad_or_trim(torch.from_numpy(w), encoder.num_samples) for w in windows])
    with torch.inference_mode():
        plain = encoder.forward(pcm)
        assert torch.equal(graphs.run(pcm[:1]), plain[:1]) and torch.equal(graphs.run(pcm), plain)
        assert graphs.num_replays == 2
        features = extractor(windows, sampling_rate=SR, return_tensors="pt").input_features
        theirs = model.model.encoder(features).last_hidden_state
    torch.testing.assert_close(plain, theirs, atol=1e-4, rtol=1e-4)


def test_an_upload_that_waits_past_queue_timeout_for_a_window_slot_is_refused_as_a_queue_wait(local, monkeypatch):
    """The walk holds the decoder's load to its cap, so the decoder's queue never fills and its queue-wait limit
    never fired: an upload waited on the walk's window slots, with no limit, until the request's deadline (a 504 at
    600 s where the docs promise a 503 at admission.queue_timeout_s)."""
    import time
    from dataclasses import replace

    from mstar_common import wire
    from mstar_common.walk_api import ComponentError

    monkeypatch.setattr(local.walk, "options", replace(local.walk.options, queue_timeout_s=0.3))

    async def go():
        slots = asyncio.Semaphore(1)
        monkeypatch.setattr(local.walk, "windows", slots)
        await slots.acquire()  # another upload holds the walk's only window slot
        began = time.monotonic()
        with pytest.raises(ComponentError) as info:  # (a TimeoutError, not a hang, where nothing limits the wait)
            await asyncio.wait_for(local.transcribe(audio=wav(clip(0, 45))), 10)  # two windows, both waiting
        assert time.monotonic() - began < 5
        assert wire.error_class(info.value.message) == wire.UNAVAILABLE_PREFIX
        assert "the upload waited 0.3 s for admission (queue_timeout_s=0.3)" in info.value.message
        slots.release()
        served = asyncio.create_task(local.transcribe(audio=wav(clip(0, 45))))
        await asyncio.sleep(0.6)  # past the limit while served: its later windows wait for slots as they come
        assert (await served)["finish_reason"] in ("stop", "length")

    asyncio.run(go())


def test_a_segments_temperature_is_the_one_the_client_sent(local):
    """The walk's temperature tensor is float32: a client's 0.2 came back in every segment as 0.20000000298023224,
    where OpenAI Whisper (and this walk's own fallback ladder) report 0.2."""
    out = asyncio.run(local.transcribe(audio=wav(clip(3, 17)), timestamps=True, temperature=0.2, seed=11))
    segments = json.loads(out["segments"])
    assert segments and {s["temperature"] for s in segments} == {0.2}


@pytest.mark.parametrize("declared", ["language and task", "forced_decoder_ids"])
def test_the_checkpoints_own_language_and_task_apply_to_a_request_without_them(checkpoint, tmp_path, declared):
    """transformers' generate takes a request's missing language and task from the generation config's `language`
    and `task` (or, where it sets neither, from its legacy forced_decoder_ids); they were read for the task alone,
    so a fine-tune for one language had its language detected."""
    import shutil

    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    own = tmp_path / "own"
    shutil.copytree(checkpoint, own)
    gen = json.loads((own / "generation_config.json").read_text())
    if declared == "language and task":
        gen.update(language="fr", task="translate")
    else:
        gen["forced_decoder_ids"] = [[1, gen["lang_to_id"]["<|fr|>"]], [2, gen["task_to_id"]["translate"]]]
    (own / "generation_config.json").write_text(json.dumps(gen))
    reference = (WhisperForConditionalGeneration.from_pretrained(own).eval(),
                 WhisperFeatureExtractor.from_pretrained(own), AutoTokenizer.from_pretrained(own))
    pcm = clip(2, 9)
    with LocalWhisper(own) as harness:
        assert harness.walk.tokens.defaults(None, None) == ("fr", "translate")
        out = asyncio.run(harness.transcribe(audio=wav(pcm)))
        assert our_sequences(harness) == [hf_sequence(reference, pcm)]
        assert out["language"] == "fr"
        # a request naming one of them: the generation config's fields still fill the other, each alone, but the
        # legacy forced_decoder_ids are read only for a request that names neither (the language is then detected
        # and the task is transcribe), as generate does
        for ours in ({"task": "transcribe"}, {"language": "de"}, {"language": "de", "task": "transcribe"}):
            harness.decoder_calls.clear()
            asyncio.run(harness.transcribe(audio=wav(pcm), **ours))
            assert our_sequences(harness) == [hf_sequence(reference, pcm, **ours)], ours


def test_a_generation_configs_language_or_task_it_cannot_serve_is_refused():
    from mstar_common.families.whisper.decoding import WhisperTokens

    gen = {"decoder_start_token_id": 1, "eos_token_id": 2, "no_timestamps_token_id": 9, "lang_to_id": {"<|en|>": 3},
           "task_to_id": {"transcribe": 4, "translate": 5}}
    for extra, rule in (({"task": "summarize"}, "task must be one of"), ({"language": "xx"}, "language: 'xx' is not"),
                        ({"language": ["en", "fr"]}, "language must be one language")):
        with pytest.raises(ValueError, match=f"^generation_config.json: {rule}"):
            WhisperTokens.from_generation_config({**gen, **extra}, 10, 448)
    assert WhisperTokens.from_generation_config({**gen, "language": "English"}, 10, 448).config_language == "en"


def test_scale_embedding_changes_nothing_as_in_transformers(checkpoint, tmp_path):
    """transformers' Whisper computes embed_scale from `scale_embedding` and never applies it (nor does OpenAI's
    model): the decoder multiplied its token embeddings by sqrt(d_model), and its tokens left the reference's."""
    import shutil

    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    own = tmp_path / "scaled"
    shutil.copytree(checkpoint, own)
    config = json.loads((own / "config.json").read_text())
    (own / "config.json").write_text(json.dumps({**config, "scale_embedding": True}))
    reference = (WhisperForConditionalGeneration.from_pretrained(own).eval(),
                 WhisperFeatureExtractor.from_pretrained(own), AutoTokenizer.from_pretrained(own))
    pcm = clip(1, 9)
    with LocalWhisper(own) as harness:
        asyncio.run(harness.transcribe(audio=wav(pcm), language="fr"))
        assert our_sequences(harness) == [hf_sequence(reference, pcm, language="fr")]


def test_a_stream_closed_after_its_first_text_cancels_its_windows_decoder_hops_at_once(local):
    """The walk's stream left its transcription's generator to asyncio's finalizer hook when its client left: the
    window tasks and their decoder hops ran on until the dropped generator was collected. Here nothing collects it
    (the hook keeps what it is given), so only an explicit close ends the hop."""
    import sys

    from tests.whisper_local import _wire

    opened, closed = [], []

    async def call_stream(component, inputs):  # the real decoder's outputs, but the hop never ends by itself
        opened.append(component)
        try:
            async for out in local.call_stream(component, inputs):
                if "finish_reason" in out:
                    await asyncio.Event().wait()
                yield out
        finally:
            closed.append(component)

    async def go():
        kept = []
        sys.set_asyncgen_hooks(firstiter=None, finalizer=kept.append)  # a dropped generator is never closed
        stream = local.walk.stream(_wire({"audio": wav(clip(2, 20)), "language": "en"}), local.call, call_stream)
        first = await asyncio.wait_for(anext(stream), 30)
        assert first["text_output"][0] and opened == ["decoder"]
        await stream.aclose()
        for _ in range(5):
            await asyncio.sleep(0.01)
        assert closed == ["decoder"]

    asyncio.run(go())


def test_an_uploads_queue_wait_counts_from_its_arrival_its_decode_included(local, monkeypatch):
    """docs/whisper.md: an upload none of whose windows has had a slot within `admission.queue_timeout_s` of its
    arrival ends with a 503. The clock started after the upload was decoded, so a slow decode (or a wait for a
    decoding thread) was added to the limit."""
    import time
    from dataclasses import replace

    from mstar_common import wire
    from mstar_common.walk_api import ComponentError

    monkeypatch.setattr(local.walk, "options", replace(local.walk.options, queue_timeout_s=1.5))
    load = local.walk._load_audio

    def slow_load(req):  # a 1.5 s decode
        time.sleep(1.5)
        return load(req)

    monkeypatch.setattr(local.walk, "_load_audio", slow_load)

    async def go():
        slots = asyncio.Semaphore(1)
        monkeypatch.setattr(local.walk, "windows", slots)
        await slots.acquire()  # another upload holds the walk's only window slot
        began = time.monotonic()
        with pytest.raises(ComponentError) as info:
            await asyncio.wait_for(local.transcribe(audio=wav(clip(0, 10))), 10)
        waited = time.monotonic() - began
        assert wire.error_class(info.value.message) == wire.UNAVAILABLE_PREFIX
        assert 1.5 <= waited < 2.4, waited  # the limit from arrival (3 s: the decode and then the whole limit)

    asyncio.run(go())
