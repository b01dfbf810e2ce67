"""perf_analyzer_configs/ for the speech, transcription and image walks: each committed file is what its
generator writes, fits every shipped deployment's entry model as perf_analyzer would check it, and the checker
refuses what perf_analyzer refuses."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from mstar_common.bench import cli as bench_cli
from mstar_common.bench import pa_files
from mstar_common.config import load_deployment
from mstar_common.repository import entry_model, render_repository

ROOT = Path(__file__).resolve().parents[2]
FILES = {  # committed file -> the family whose entry models it feeds
    "perf_analyzer_configs/orpheus/speech_1200tok.json": "orpheus",
    "perf_analyzer_configs/whisper/clips_30s_opus_128tok.json": "whisper",
    "perf_analyzer_configs/image_walk/prompts.json": "image",
}
DEPLOYMENTS = {"orpheus": ("orpheus", "orpheus_3b_gpu", "orpheus_3b_gpu_streams"),
               "whisper": ("whisper", "whisper_large_v3_gpu"),
               "image": ("flux2_klein", "flux2_klein_4b_gpu", "z_image_turbo", "z_image_turbo_gpu")}


def entry_config(deployment: str) -> dict:
    """The entry model's config as tritonclient's get_model_config(as_json=True) gives it, from the rendered
    config.pbtxt."""
    dep = load_deployment(ROOT / "configs" / f"{deployment}.yaml")
    text = render_repository(dep, deployment)[f"{entry_model(dep)}/config.pbtxt"]
    return json_format.MessageToDict(text_format.Parse(text, model_config_pb2.ModelConfig()),
                                     preserving_proto_field_name=True)


@pytest.mark.parametrize("path, deployment", [(p, d) for p, f in FILES.items() for d in DEPLOYMENTS[f]])
def test_each_committed_file_fits_every_shipped_entry_model_it_feeds(path, deployment):
    config = entry_config(deployment)
    family = FILES[path]
    assert config["name"] in pa_files.ENTRY_MODELS[family]
    data = json.loads((ROOT / path).read_text())
    pa_files.check_against_config(data, config)
    tensors = pa_files.infer_inputs(data["data"][0], config)
    assert all(array.shape == (1,) for array, _ in tensors.values())  # every input here is of dims [1]


def test_the_committed_files_are_what_the_generator_writes(tmp_path):
    for family, path in (("orpheus", "orpheus/speech_1200tok.json"), ("image", "image_walk/prompts.json")):
        name, data = pa_files.family_file(family, 4)
        assert (ROOT / "perf_analyzer_configs" / path).name == f"{name}.json"
        assert json.loads((ROOT / "perf_analyzer_configs" / path).read_text()) == data
    # whisper's: the same fields, and audio that decodes to bench_whisper's clips (Opus is lossy, and its bytes
    # may differ between libopus builds)
    committed = json.loads((ROOT / "perf_analyzer_configs/whisper/clips_30s_opus_128tok.json").read_text())
    name, fresh = pa_files.family_file("whisper", 4)
    assert name == "clips_30s_opus_128tok" and len(committed["data"]) == len(fresh["data"]) == 4
    for i, (a, b) in enumerate(zip(committed["data"], fresh["data"], strict=True)):
        assert {k: v for k, v in a.items() if k != "audio"} == {k: v for k, v in b.items() if k != "audio"}
        (upload,) = pa_files.deserialized_bytes(a["audio"]["b64"])
        pcm, rate = soundfile.read(io.BytesIO(upload), dtype="float32")
        want = pa_files.whisper_clip(i, 30.0)
        assert rate == pa_files.WHISPER_RATE and pcm.shape == want.shape
        lag = max(range(400), key=lambda k: float(np.dot(pcm[k:k + 32000], want[:32000])))
        x, y = pcm[lag:lag + 320_000], want[:320_000 - lag]
        assert np.dot(x, y) / np.sqrt(np.dot(x, x) * np.dot(y, y)) > 0.95
    assert len((ROOT / "perf_analyzer_configs/whisper/clips_30s_opus_128tok.json").read_bytes()) < 1_000_000


def test_the_cli_writes_each_familys_file(tmp_path):
    assert bench_cli.main(["perf-analyzer-data", "--family", "orpheus", "--max-tokens", "28", "--num-prompts", "2",
                           "--out", str(tmp_path)]) == 0
    speech = json.loads((tmp_path / "speech_28tok.json").read_text())["data"]
    assert [e["max_tokens"] for e in speech] == [[28], [28]] and [e["seed"] for e in speech] == [[0], [1]]
    assert bench_cli.main(["perf-analyzer-data", "--family", "whisper", "--audio-seconds", "2", "--max-tokens", "8",
                           "--out", str(tmp_path)]) == 0
    clips = json.loads((tmp_path / "clips_2s_opus_8tok.json").read_text())["data"]
    assert len(clips) == 4 and clips[0]["language"] == ["en"] and clips[0]["max_tokens"] == [8]
    assert bench_cli.main(["perf-analyzer-data", "--out", str(tmp_path), "--prompt-len", "8", "--output-len", "2"]) == 0
    assert len(json.loads((tmp_path / "fixed_8in_2out.json").read_text())["data"]) == 16  # text_lm's default


def test_bytes_are_serialized_as_triton_lays_them_out():
    text = pa_files.serialized_bytes([b"ab", b""])
    assert base64.b64decode(text) == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"
    assert pa_files.deserialized_bytes(text) == [b"ab", b""]
    with pytest.raises(ValueError, match="cut short"):
        pa_files.deserialized_bytes(base64.b64encode(b"\x09\x00\x00\x00ab").decode())


@pytest.mark.parametrize("entry, rule", [
    ({"prompt": ["x"], "steps": [4]}, r"data\[0\]\.steps: not an input of flux2_klein_walk"),
    ({"prompt": ["x"], "seed": ["7"]}, r"data\[0\]\.seed: TYPE_INT64: must be an integer"),
    ({"prompt": ["x"], "seed": [True]}, r"data\[0\]\.seed: TYPE_INT64: must be an integer"),
    ({"prompt": ["x", "y"]}, r"data\[0\]\.prompt: 2 elements for shape \[1\]"),
    ({"prompt": ["x"], "width": {"b64": "AAAA"}}, r"data\[0\]\.width: only a STRING input is given as b64"),
    ({"prompt": 5}, r"data\[0\]\.prompt: a list of values"),
    ({"prompt": ["x"], "seed": [2**63]}, r"data\[0\]\.seed: a value outside TYPE_INT64's range"),
    ({"prompt": ["x"], "width": [2**40]}, r"data\[0\]\.width: a value outside TYPE_INT32's range"),
    ({"prompt": ["x"], "reference_images": {"content": ["a"], "shape": [3]}},
     r"data\[0\]\.reference_images: 1 elements for shape \[3\]"),
    ({"prompt": {"content": ["x"], "shape": [3]}}, r"data\[0\]\.prompt: shape \[3\] does not fit dims \[1\]"),
    ({"prompt": {"content": ["x"], "shape": [1, 1]}}, r"data\[0\]\.prompt: shape \[1, 1\] does not fit dims \[1\]"),
    ({"prompt": ["x"], "reference_images": ["a"]}, r"data\[0\]\.reference_images: dims \[-1\] are variable"),
])
def test_the_checker_refuses_what_perf_analyzer_refuses(entry, rule):
    with pytest.raises(ValueError, match=rule):
        pa_files.check_against_config({"data": [entry]}, entry_config("flux2_klein"))


def test_a_variable_input_with_its_shape_is_checked_and_sent_at_it():
    config = entry_config("flux2_klein")
    entry = {"prompt": ["x"], "reference_images": {"content": ["a", "b"], "shape": [2]}}
    pa_files.check_against_config({"data": [entry]}, config)
    array, datatype = pa_files.infer_inputs(entry, config)["reference_images"]
    assert datatype == "BYTES" and array.shape == (2,) and array.tolist() == [b"a", b"b"]


@pytest.mark.parametrize("folder", ["text_lm", "orpheus", "whisper", "image_walk"])
def test_each_folders_flags_name_its_own_file_and_stream(folder):
    """Every entry model is decoupled: perf_analyzer without --streaming fails on it. The flags' --input-data is
    a file of the folder, and its README's regeneration command writes that file's name."""
    flags = (ROOT / "perf_analyzer_configs" / folder / "flags.txt").read_text().split()
    assert "--streaming" in flags and flags[flags.index("-i") + 1] == "grpc"
    data = Path(flags[flags.index("--input-data") + 1])
    assert data.parent == Path("perf_analyzer_configs") / folder and (ROOT / data).is_file()
    readme = (ROOT / "perf_analyzer_configs" / folder / "README.md").read_text()
    assert f"`{data.name}`" in readme and "mstar bench perf-analyzer-data" in readme


def test_replay_refuses_a_file_the_served_entry_would_refuse(tmp_path, monkeypatch, capsys):
    """`mstar bench replay` checks the file against the served entry model's config before sending anything."""
    from mstar_common.bench import replay

    monkeypatch.setattr(replay, "served_config", lambda url, model: entry_config("flux2_klein"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"data": [{"prompt": ["x"], "steps": [4]}]}))
    out = tmp_path / "r.json"
    assert bench_cli.main(["replay", "--model", "flux2_klein_walk", "--input-data", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--input-data:" in err and "data[0].steps: not an input of flux2_klein_walk" in err
    assert not out.exists()
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"data": []}))
    assert bench_cli.main(["replay", "--model", "m", "--input-data", str(empty), "--out", str(out)]) == 2
    assert "a non-empty list of entries" in capsys.readouterr().err


def test_replay_with_no_level_is_refused(tmp_path, capsys):
    assert bench_cli.main(["replay", "--model", "m", "--input-data", "x.json", "--concurrency",
                           "--out", str(tmp_path / "r.json")]) == 2
    assert "nothing to run: --concurrency and --rates are both empty" in capsys.readouterr().err
