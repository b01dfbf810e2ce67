"""The benchmark CLI (`mstar bench`, `scripts/bench.py`): its serve arguments reach the deployment it starts
(CPU: no server is started), and both ways in reach the same commands."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mstar_common.bench import cli as bench_cli
from mstar_common.bench.workload import Workload
from mstar_common.config import deployment_from_dict

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return bench_cli


def test_mstar_bench_runs_the_benchmark_commands(tmp_path, capsys):
    """`mstar bench ...` hands its arguments to the benchmark's own parser: a perf_analyzer data file is written
    with the asked lengths, and `--help` lists the benchmark's subcommands, not mstar's."""
    from mstar_common.cli import main

    assert main(["bench", "perf-analyzer-data", "--out", str(tmp_path), "--prompt-len", "24", "--output-len", "5",
                 "--num-prompts", "3"]) == 0
    data = json.loads((tmp_path / "fixed_24in_5out.json").read_text())["data"]
    assert len(data) == 3
    assert all(len(row["input_ids"]["content"]) == 24 for row in data)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mstar bench") and "perf-analyzer-data" in out and "gen-repo" not in out


def test_the_checkout_script_is_the_same_cli(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "perf-analyzer-data", "--out",
                           str(tmp_path), "--prompt-len", "8", "--output-len", "2", "--num-prompts", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "fixed_8in_2out.json").is_file()


def _serve_args(bench, monkeypatch, *extra):
    seen = []
    monkeypatch.setattr(bench, "cmd_serve", lambda args: seen.append(args) or 0)
    assert bench.main(["serve", "--checkpoint", "/tmp/ckpt", "--out", "/tmp/out.json", *extra]) == 0
    return seen[0]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_kv_dtype_reaches_the_deployment(bench, monkeypatch, kv_dtype):
    args = _serve_args(bench, monkeypatch, "--kv-dtype", kv_dtype)
    dep = deployment_from_dict(bench.deployment(args), source="test")
    assert dep.resources.kv_cache.dtype == kv_dtype


def test_kv_dtype_default_is_the_models_and_bad_values_are_refused(bench, monkeypatch, capsys):
    assert _serve_args(bench, monkeypatch).kv_dtype == "auto"
    with pytest.raises(SystemExit):
        _serve_args(bench, monkeypatch, "--kv-dtype", "fp4")
    assert "--kv-dtype" in capsys.readouterr().err


def test_num_pages_takes_a_count_or_auto(bench, monkeypatch, capsys):
    args = _serve_args(bench, monkeypatch, "--num-pages", "auto")
    assert deployment_from_dict(bench.deployment(args), source="test").resources.kv_cache.is_auto
    assert _serve_args(bench, monkeypatch, "--num-pages", "2048").num_pages == 2048
    with pytest.raises(SystemExit):
        _serve_args(bench, monkeypatch, "--num-pages", "0")
    assert "argument --num-pages: must be an integer >= 1, not '0'" in capsys.readouterr().err


def test_instances_reach_the_placement(bench, monkeypatch, capsys):
    """`--instances 2` serves two engines of the LLM on GPU 0 (each with its own pool); 0 is refused by name."""
    assert deployment_from_dict(bench.deployment(_serve_args(bench, monkeypatch)),
                                source="test").components["llm"].placement.instances == 1
    args = _serve_args(bench, monkeypatch, "--device", "gpu", "--instances", "2")
    placement = deployment_from_dict(bench.deployment(args), source="test").components["llm"].placement
    assert (placement.instances, placement.gpus, placement.total_instances) == (2, [0], 2)
    with pytest.raises(SystemExit):
        _serve_args(bench, monkeypatch, "--instances", "0")
    assert "argument --instances: must be an integer >= 1, not '0'" in capsys.readouterr().err


def test_the_benchmark_serves_its_workloads_knobs_not_the_checkpoints_generation_config(bench, monkeypatch):
    """A checkpoint's recommended repetition_penalty would reach the served rows (the workload never sends one) but
    not --check-eager's engine nor the report."""
    dep = deployment_from_dict(bench.deployment(_serve_args(bench, monkeypatch)), source="test")
    assert dep.model_kwargs["generation_config"] == "ignore"


def test_the_benchmark_serves_without_the_prefix_cache_unless_asked(bench, monkeypatch):
    """Its figures are full prefills unless asked: the proxy's prompts are all alike, which a cache would skip."""
    for extra, expected in (((), False), (("--prefix-caching",), True)):
        dep = deployment_from_dict(bench.deployment(_serve_args(bench, monkeypatch, *extra)), source="test")
        assert dep.resources.kv_cache.prefix_caching is expected


def test_the_benchmark_packs_steps_as_a_default_deployment_and_refuses_buckets_above_the_budget(bench, monkeypatch):
    """`mstar bench serve` measures the step budget `mstar serve` deploys unless told otherwise, and a captured token
    bucket no step could fill is the deployment's refusal, named, not a graph captured for nothing."""
    from mstar_common.config import DeploymentError, Resources

    dep = deployment_from_dict(bench.deployment(_serve_args(bench, monkeypatch)), source="test")
    assert dep.resources.max_batch_tokens == Resources().max_batch_tokens
    dep = deployment_from_dict(bench.deployment(_serve_args(bench, monkeypatch, "--max-batch-tokens", "4096",
                                                            "--token-buckets", "512", "4096")), source="test")
    assert dep.resources.max_batch_tokens == 4096
    with pytest.raises(DeploymentError, match=r"prefill_token_buckets: \[4096\] exceed resources.max_batch_tokens"):
        deployment_from_dict(bench.deployment(_serve_args(bench, monkeypatch, "--token-buckets", "512", "4096")),
                             source="test")


def test_the_report_states_the_serving_settings_of_the_run(bench, monkeypatch):
    """The settings that move the figures are written beside them, defaults included, from the deployment as served."""
    import json

    from mstar_common.bench.report import markdown

    gpu = deployment_from_dict(bench.deployment(_serve_args(bench, monkeypatch, "--device", "gpu", "--decode-buckets",
                                                            "1", "2", "4", "--kv-dtype", "fp8_e4m3")), source="t")
    model = {"deployment": json.loads(json.dumps(gpu.to_dict())), "runs": []}  # as the results file stores it
    text = markdown({"meta": {}, "models": {"m": model}})
    assert ("Serving: `max_batch_tokens` 2,048; KV pool 1,024 pages of 64 tokens, dtype fp8_e4m3; "
            "`max_concurrent_requests` 64; llm: CUDA graphs for decode rows 1, 2, 4 and packed tokens the default "
            "ladder, attention `auto`.") in text
    cpu = deployment_from_dict(bench.deployment(_serve_args(bench, monkeypatch, "--device", "cpu",
                                                            "--max-batch-tokens", "512")), source="t")
    text = markdown({"meta": {}, "models": {"m": {"deployment": cpu.to_dict(), "runs": []}}})
    assert "`max_batch_tokens` 512;" in text and "llm: eager on cpu." in text


@pytest.mark.parametrize("argv, line", [
    ([], "Workload: 512-token prompts; 256 output tokens exactly (ignore_eos); greedy."),
    (["--temperature", "0.7", "--top-p", "0.9", "--top-k", "50", "--shared-prefix-len", "448"],
     "Workload: 512-token prompts; the first 448 shared; 256 output tokens exactly (ignore_eos); "
     "sampled (temperature 0.7, top_p 0.9, top_k 50)."),
    (["--prompt-len", "10", "--prompt-len-max", "30", "--output-len", "3", "--output-len-max", "9",
      "--no-ignore-eos", "--temperature", "1"],
     "Workload: 10-30-token prompts; 3-9 output tokens at most, or to EOS; sampled (temperature 1)."),
])
def test_the_report_states_the_workload_it_sent(tmp_path, argv, line):
    """The results file records the workload of each level as the sweep describes it, and the report prints it."""
    from mstar_common.bench.report import markdown

    parser = argparse.ArgumentParser()
    bench_cli.add_length_args(parser)
    args = parser.parse_args(argv)
    described = bench_cli.describe_workload(bench_cli.workload_from_args(args))
    summary = {"num_requests": 1, "requests_per_s": 1.0, "output_tok_per_s": 1.0, "tokens_per_response": 1.0,
               "num_errors": 0, **{k: {"p50": 1.0, "p90": 1.0, "p99": 1.0} for k in ("ttft_ms", "itl_ms")}}
    model = {"runs": [{"target": "triton", "concurrency": 1, "workload": described, "summary": summary}]}
    assert line in markdown({"meta": {}, "models": {"m": model}})
    file_model = {"runs": [{**model["runs"][0], "workload": {"input_data": "w.json", "requests": 16,
                                                             "prompt_len": [512, 512], "output_len": [256, 256]}}]}
    assert "Workload: 16 requests from `w.json`, prompts of 512-512 tokens, max_tokens 256-256." in \
        markdown({"meta": {}, "models": {"m": file_model}})


def test_workload_prompts_are_distinct_across_a_run_and_share_only_the_asked_start():
    from mstar_common.bench.workload import Workload

    plain = Workload("w", prompt_len=64, output_len=4)
    first, later = plain.requests(3), plain.requests(3, first=3)
    assert plain.requests(3) == first  # the same requests again for the same numbers
    prompts = [r["input_ids"] for r in first + later]
    assert all(len(p) == 64 for p in prompts) and len({tuple(p[:8]) for p in prompts}) == 6
    shared = Workload("w", prompt_len=64, output_len=4, shared_prefix_len=40).requests(4)
    starts = {tuple(r["input_ids"][:40]) for r in shared}
    assert len(starts) == 1 and len({tuple(r["input_ids"][40:]) for r in shared}) == 4
    with pytest.raises(ValueError, match="shared_prefix_len"):
        Workload("w", prompt_len=8, output_len=4, shared_prefix_len=9)


def test_engine_metrics_sums_the_prefix_cache_counters_over_instances(bench):
    """`engine_metrics` reads Triton's metrics text: each counter summed over its labelled series, 0 when absent."""
    from tests.unit.local_http import answering

    text = ("# HELP mstar_prefix_cache_hit_tokens_total prompt tokens\n"
            'mstar_prefix_cache_hit_tokens_total{model="qwen3_llm",instance="0"} 448\n'
            'mstar_prefix_cache_hit_tokens_total{model="qwen3_llm",instance="1"} 64\n'
            'mstar_prefix_cache_queried_tokens_total{model="qwen3_llm",instance="0"} 1024\n'
            'nv_inference_count{model="qwen3_llm"} 9\n').encode()

    with answering(text) as url:
        got = bench.engine_metrics(f"{url}/metrics")
    assert got == {"mstar_prefix_cache_queried_tokens_total": 1024.0, "mstar_prefix_cache_hit_tokens_total": 512.0,
                   "mstar_kv_pages_cached": 0.0}
    assert bench.engine_metrics(url) == {}  # the server is gone: reported, not raised


def test_input_data_files_round_trip_and_send_only_what_an_entry_holds(tmp_path):
    """An entry that leaves a knob out sends none, as perf_analyzer does (the server's default applies under
    both); `ignore_eos` and `temperature` were filled in, so the two ran different workloads from one file."""
    from mstar_common.bench.drivers import OpenAIDriver, _triton_inputs
    from mstar_common.bench.workload import Workload, perf_analyzer_data, requests_from_file

    written = Workload("fixed", 12, 5, temperature=0.5).requests(3)
    path = tmp_path / "w.json"
    path.write_text(json.dumps(perf_analyzer_data(written)))
    assert requests_from_file(path) == written
    path.write_text(json.dumps({"data": [{"input_ids": {"content": [5, 6, 7], "shape": [3]}, "max_tokens": [4]}]}))
    (bare,) = requests_from_file(path)
    assert bare == {"input_ids": [5, 6, 7], "max_tokens": 4}
    assert {t.name() for t in _triton_inputs(bare)} == {"input_ids", "max_tokens"}
    body = OpenAIDriver("http://127.0.0.1:9", "m", lambda ids: "x " * len(ids)).body(bare)
    assert "ignore_eos" not in body and "temperature" not in body and body["max_tokens"] == 4


def test_the_proxy_arm_sends_every_knob_of_an_input_data_entry(tmp_path):
    """`seed`, `min_p` and `repetition_penalty` reached Triton as tensors and were dropped from the proxy's body,
    so the two arms of one run served different requests."""
    from mstar_common.bench.drivers import OpenAIDriver, _triton_inputs
    from mstar_common.bench.workload import requests_from_file

    knobs = {"ignore_eos": [True], "temperature": [0.7], "top_p": [0.9], "top_k": [20], "min_p": [0.05],
             "repetition_penalty": [1.1], "seed": [7], "stop": ["END"], "stop_token_ids": [11]}
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"data": [{"input_ids": [5, 6, 7], "max_tokens": [4], **knobs}]}))
    (request,) = requests_from_file(path)
    body = OpenAIDriver("http://127.0.0.1:9", "m", lambda ids: "x " * len(ids)).body(request)
    sent = {name for name in body if name not in ("model", "prompt", "stream", "stream_options")}
    assert sent == {t.name() for t in _triton_inputs(request)} - {"input_ids"} == set(knobs) | {"max_tokens"}
    assert (body["seed"], body["min_p"], body["repetition_penalty"]) == (7, 0.05, 1.1)


def test_input_data_keeps_the_list_inputs_whole_and_sends_them_as_one_tensor(tmp_path):
    """`stop_token_ids: [11, 12]` was read as 11 and sent with shape [] (Triton refused every request), and of
    `stop: ["\n\n", "END"]` only the first string was sent."""
    from mstar_common.bench.drivers import _triton_inputs
    from mstar_common.bench.workload import requests_from_file

    path = tmp_path / "w.json"
    path.write_text(json.dumps({"data": [{"input_ids": {"content": [5, 6, 7], "shape": [3]}, "max_tokens": [4],
                                          "stop_token_ids": [11, 12], "stop": ["\n\n", "END"]}]}))
    (request,) = requests_from_file(path)
    assert request["stop_token_ids"] == [11, 12] and request["stop"] == ["\n\n", "END"]
    tensors = {t.name(): (t.datatype(), t.shape()) for t in _triton_inputs(request)}
    assert tensors["stop_token_ids"] == ("INT32", [2]) and tensors["stop"] == ("BYTES", [2])
    assert tensors["max_tokens"] == ("INT32", [1]) and tensors["input_ids"] == ("INT32", [3])


@pytest.mark.parametrize("data, fragment", [
    ({"data": []}, "data: no requests"),
    ({"data": [{"max_tokens": [4]}]}, "data[0].input_ids"),
    ({"data": [{"input_ids": {"content": [], "shape": [0]}, "max_tokens": [4]}]}, "data[0].input_ids"),
    ({"data": [{"input_ids": [1, 2], "max_tokens": [2]}, {"input_ids": [3], "max_tokens": [0]}]},
     "data[1].max_tokens: must be an integer >= 1, got 0"),
    ({"rows": []}, "not a perf_analyzer input-data file"),
    ({"data": [{"input_ids": [1, 2], "max_tokens": [2], "temperature": [0.5, 0.7]}]},
     "data[0].temperature: one value per request, got 2"),
    ({"data": [{"input_ids": [1, 2], "max_tokens": [2], "stop": [5]}]}, "data[0].stop: must be a list of strings"),
    # perf_analyzer refuses a name the entry model lacks; the harness sent it as a BYTES tensor the server refused
    ({"data": [{"input_ids": [1, 2], "max_tokens": [2], "ignore_eso": [True]}]},
     "data[0].ignore_eso: not an input of the text-LM entry model"),
    # the entry's text prompts are real inputs: refused as not replayed here, not as missing from the entry
    ({"data": [{"input_ids": [1, 2], "max_tokens": [2], "text_input": ["hi"]}]},
     "data[0].text_input: the harness replays token-id prompts (input_ids)"),
    ({"data": [{"input_ids": [1, 2], "max_tokens": [2], "ignore_eos": [1]}]},
     "data[0].ignore_eos: must be true or false, got 1"),
    ({"data": [{"input_ids": [1, 2], "max_tokens": [2], "seed": [1.5]}]}, "data[0].seed: must be an integer"),
    ({"data": [{"input_ids": [1, 2], "max_tokens": [2], "temperature": ["0.5"]}]},
     "data[0].temperature: must be a number"),
    # Python's json reads NaN (not JSON); it was accepted, and every request refused by the server at run time
    ({"data": [{"input_ids": [1, 2], "max_tokens": [2], "temperature": [float("nan")]}]},
     "data[0].temperature: must be a finite number"),
    ({"data": [{"input_ids": [1, 2], "max_tokens": [True]}]}, "data[0].max_tokens: must be an integer >= 1"),
    ({"data": [{"input_ids": [1, 2], "max_tokens": [2], "stop_token_ids": [1.5]}]},
     "data[0].stop_token_ids: must be a list of token ids"),
])
def test_bad_input_data_is_refused_before_anything_runs(tmp_path, capsys, data, fragment):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit) as exit_info:
        bench_cli.main(["url", "--grpc", "127.0.0.1:9", "--input-data", str(path), "--out", str(tmp_path / "o.json")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--input-data:" in err and fragment in err, err
    assert not (tmp_path / "o.json").exists()


def test_greedy_workloads_send_top_p_and_top_k_only_when_set_and_sampled_ones_always(tmp_path):
    """A sampled request that left a filter unset would sample with the served checkpoint's generation_config.json
    value for it (Qwen3: top_p 0.95, top_k 20), not the "off" the workload states."""
    from mstar_common.bench.drivers import OpenAIDriver, _triton_inputs
    from mstar_common.bench.workload import Workload, perf_analyzer_data, requests_from_file

    greedy = Workload("w", 12, 5).requests(2)
    assert all(set(r) == {"input_ids", "max_tokens", "ignore_eos", "temperature"} for r in greedy)
    sampled = Workload("w", 12, 5, temperature=0.7, top_p=0.9, top_k=50).requests(2)
    assert [(r["temperature"], r["top_p"], r["top_k"]) for r in sampled] == [(0.7, 0.9, 50)] * 2
    temperature_alone = Workload("w", 12, 5, temperature=1.0).requests(1)[0]
    assert (temperature_alone["top_p"], temperature_alone["top_k"]) == (1.0, 0)
    assert [r["input_ids"] for r in sampled] == [r["input_ids"] for r in greedy]  # the same prompts
    path = tmp_path / "sampled.json"
    path.write_text(json.dumps(perf_analyzer_data(sampled)))
    assert requests_from_file(path) == sampled
    # the Triton inputs carry them with the entry model's dtypes; the proxy's body as OpenAI fields
    tensors = {t.name(): t.datatype() for t in _triton_inputs(sampled[0])}
    assert tensors["top_p"] == "FP32" and tensors["top_k"] == "INT32" and tensors["temperature"] == "FP32"
    assert "top_p" not in {t.name() for t in _triton_inputs(greedy[0])}
    body = OpenAIDriver("http://127.0.0.1:9", "m", lambda ids: "x " * len(ids)).body(sampled[0])
    assert body["top_p"] == 0.9 and body["top_k"] == 50 and body["temperature"] == 0.7


def test_length_ranges_and_natural_eos_are_drawn_the_same_every_run(tmp_path):
    from mstar_common.bench.workload import Workload, requests_from_file

    fixed = Workload("w", prompt_len=64, output_len=4)
    ranged = Workload("w", prompt_len=10, output_len=3, prompt_len_max=30, output_len_max=9, ignore_eos=False)
    first = ranged.requests(40)
    assert first == ranged.requests(40) and first[5:] == ranged.requests(35, first=5)
    prompts, outputs = [len(r["input_ids"]) for r in first], [r["max_tokens"] for r in first]
    assert min(prompts) >= 10 and max(prompts) <= 30 and len(set(prompts)) > 5
    assert min(outputs) >= 3 and max(outputs) <= 9 and len(set(outputs)) > 3
    assert not any(r["ignore_eos"] for r in first) and all(r["ignore_eos"] for r in fixed.requests(3))
    assert [len(r["input_ids"]) for r in fixed.requests(3)] == [64] * 3
    # the committed perf_analyzer workload is still what the generator writes
    committed = ROOT / "perf_analyzer_configs" / "text_lm" / "fixed_512in_256out.json"
    assert requests_from_file(committed) == Workload("fixed", 512, 256).requests(16)
    # and the one for the built-in demo, whose max_model_len (512) the 512 + 256 workload does not fit
    from mstar_common.cli import DEFAULT_DEPLOYMENT
    from mstar_common.config import load_deployment

    tiny = requests_from_file(ROOT / "perf_analyzer_configs" / "text_lm" / "fixed_128in_64out.json")
    assert tiny == Workload("fixed", 128, 64).requests(16)
    assert 128 + 64 <= load_deployment(DEFAULT_DEPLOYMENT).resources.max_model_len < 512 + 256
    assert bench_cli.main(["perf-analyzer-data", "--out", str(tmp_path), "--prompt-len", "10", "--prompt-len-max",
                           "30", "--output-len", "3", "--output-len-max", "9", "--no-ignore-eos",
                           "--num-prompts", "40"]) == 0
    assert requests_from_file(tmp_path / "eos_10-30in_3-9out.json") == first


@pytest.mark.parametrize("flags, message", [
    (["--output-len", "8", "--output-len-max", "3"], "--output-len-max must be >= --output-len (8), got 3"),
    (["--prompt-len", "8", "--shared-prefix-len", "9"], "--shared-prefix-len must be in [0, --prompt-len=8]"),
    (["--prompt-len", "0"], "--prompt-len and --output-len must be >= 1"),
    (["--temperature", "-1"], "--temperature must be in [0, 100] (the server's range), got -1.0"),
    # NaN passed `< 0`: a perf_analyzer file of `[NaN]` (not JSON) and a run whose every request the server refused
    (["--temperature", "nan"], "--temperature must be in [0, 100] (the server's range), got nan"),
    (["--temperature", "inf"], "--temperature must be in [0, 100]"),
    (["--temperature", "0.7", "--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--temperature", "0.7", "--top-k", "-2"], "--top-k must be >= 0 (0: off), got -2"),
])
def test_bad_lengths_are_refused_with_the_flags(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        bench_cli.main(["url", "--grpc", "127.0.0.1:9", "--out", "/tmp/never.json", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bench_url_refuses_an_unreachable_server(tmp_path, capsys):
    from mstar_common.launcher import free_port

    assert bench_cli.main(["url", "--grpc", f"127.0.0.1:{free_port()}", "--out", str(tmp_path / "o.json")]) == 2
    assert "did not answer" in capsys.readouterr().err and not (tmp_path / "o.json").exists()


def test_serve_writes_its_results_after_every_level(bench, monkeypatch, tmp_path):
    """A run cut short (here the second level fails; on the device, a stage's time limit) leaves the levels it
    measured in its results file, for the baseline and the report that follow it."""
    from mstar_common.bench.metrics import RequestRecord

    out = tmp_path / "run.json"
    args = _serve_args(bench, monkeypatch, "--concurrency", "1", "8", "--rates", "--proxy-concurrency",
                       "--check-eager", "0", "--out", str(out))

    class FakeDriver:
        def __init__(self, url, model, outputs=None, processes=1):
            pass

        def run(self, batch, concurrency=None, rate=None):
            if concurrency == 8:
                raise TimeoutError("8 requests unfinished")
            return [RequestRecord(start=0.0, chunks=[(0.004, 1), (0.005, 1)], end=0.005) for _ in batch]

    monkeypatch.setattr(bench, "Server", FakeServer)
    monkeypatch.setattr(bench, "TritonDriver", FakeDriver)
    with pytest.raises(TimeoutError):
        bench._serve(args)
    saved = json.loads(out.read_text())
    assert [run["concurrency"] for run in saved["runs"]] == [1]
    assert saved["runs"][0]["summary"]["num_requests"] == 4 and saved["startup_s"] == 1.0


@pytest.mark.parametrize("flag, outputs", [([], None), (["--triton-outputs", "token_ids"], ["token_ids"])])
def test_the_triton_client_asks_for_all_outputs_or_the_token_ids_alone(bench, monkeypatch, tmp_path, flag, outputs):
    """`--triton-outputs`: by default the Triton levels' client names no outputs (Triton returns them all); with
    `token_ids` it asks for the token ids alone. Each Triton run records which."""
    from mstar_common.bench.metrics import RequestRecord

    out = tmp_path / "run.json"
    args = _serve_args(bench, monkeypatch, "--concurrency", "1", "--rates", "--proxy-concurrency",
                       "--check-eager", "0", "--out", str(out), *flag)
    asked = []

    class FakeDriver:
        def __init__(self, url, model, outputs=None, processes=1):
            asked.append(outputs)

        def run(self, batch, concurrency=None, rate=None):
            return [RequestRecord(start=0.0, chunks=[(0.004, 1)], end=0.004) for _ in batch]

    monkeypatch.setattr(bench, "Server", FakeServer)
    monkeypatch.setattr(bench, "TritonDriver", FakeDriver)
    monkeypatch.setattr(bench, "engine_metrics", lambda url: {})
    assert bench._serve(args) == 0
    assert asked == [outputs]
    assert json.loads(out.read_text())["runs"][0]["outputs"] == (outputs[0] if outputs else "all")


class FakeServer:
    """`bench.Server` without processes: the sweep's drivers are faked too."""

    startup_s, entry = 1.0, "qwen3_llm"

    def __init__(self, raw, with_proxy):
        from types import SimpleNamespace

        self.dep = SimpleNamespace(to_dict=lambda: raw)
        self.ports = SimpleNamespace(grpc_url="127.0.0.1:1", proxy_url=None, metrics_url=None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _fake_nvidia_smi(tmp_path, monkeypatch, mib: int) -> Path:
    """An `nvidia-smi` first on PATH that answers the memory query with the number in `mem.txt` (one GPU), and then
    adds a line to `reads.txt` (`_reads`)."""
    state = tmp_path / "mem.txt"
    state.write_text(str(mib))
    script = tmp_path / "bin" / "nvidia-smi"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\n[ "$1" = "--query-gpu=memory.used" ] || exit 9\ncat {state}\n'
                      f'echo >> {tmp_path / "reads.txt"}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}:{os.environ['PATH']}")
    return state


def _reads(state: Path) -> int:
    """How many memory queries the fake `nvidia-smi` of `state` has answered."""
    reads = state.parent / "reads.txt"
    return len(reads.read_text().splitlines()) if reads.exists() else 0


def test_serve_records_gpu_memory_before_start_once_ready_and_at_the_sweeps_peak(bench, monkeypatch, tmp_path):
    """`gpu_memory_mib`: nvidia-smi's reading before the server starts, once it is ready, and the highest a background
    sample saw during the sweep (here the driver raises the reading mid-level and lowers it again); the report
    prints them."""
    from mstar_common.bench import gpu_memory
    from mstar_common.bench.metrics import RequestRecord
    from mstar_common.bench.report import markdown

    monkeypatch.setattr(gpu_memory, "SAMPLE_S", 0.2)
    state = _fake_nvidia_smi(tmp_path, monkeypatch, 1_000)
    out = tmp_path / "run.json"
    args = _serve_args(bench, monkeypatch, "--concurrency", "1", "--rates", "--proxy-concurrency",
                       "--check-eager", "0", "--out", str(out))

    class StartingServer(FakeServer):
        def __enter__(self):
            state.write_text("5000")  # the server's weights, pools and graphs
            return self

    class FakeDriver:
        def __init__(self, url, model, outputs=None, processes=1):
            pass

        def run(self, batch, concurrency=None, rate=None):
            state.write_text("9250")
            # The sampler reads every 0.2 s here. Two reads ended after the write: the second one began after it
            # (one read at a time), so it saw 9250, however late a loaded machine ran the sampler's thread.
            seen, deadline = _reads(state), time.monotonic() + 30
            while _reads(state) < seen + 2:
                assert time.monotonic() < deadline, "the sampler did not read the memory during the sweep"
                time.sleep(0.05)
            state.write_text("6000")
            return [RequestRecord(start=0.0, chunks=[(0.004, 1)], end=0.004) for _ in batch]

    monkeypatch.setattr(bench, "Server", StartingServer)
    monkeypatch.setattr(bench, "TritonDriver", FakeDriver)
    monkeypatch.setattr(bench, "engine_metrics", lambda url: {})
    assert bench._serve(args) == 0
    saved = json.loads(out.read_text())
    assert saved["gpu_memory_mib"] == {"before_start": 1_000, "after_start": 5_000, "peak": 9_250}
    text = markdown({"meta": {}, "models": {"m": saved}})
    assert "5,000 MiB once ready; 4,000 MiB of it taken by the server's start; 9,250 MiB at the sweep's peak" in text


def test_serve_records_the_code_and_the_switches_it_ran_with(bench, monkeypatch, tmp_path):
    """A results file names the commit (`+changes` for a checkout that differs from it) and the `MSTAR_*` switches
    the server inherited, paths left out; the report prints both."""
    from mstar_common.bench.metrics import RequestRecord
    from mstar_common.bench.report import markdown

    out = tmp_path / "run.json"
    args = _serve_args(bench, monkeypatch, "--concurrency", "1", "--rates", "--proxy-concurrency",
                       "--check-eager", "0", "--out", str(out))

    class FakeDriver:
        def __init__(self, url, model, outputs=None, processes=1):
            pass

        def run(self, batch, concurrency=None, rate=None):
            return [RequestRecord(start=0.0, chunks=[(0.004, 1)], end=0.004) for _ in batch]

    monkeypatch.setattr(bench, "Server", FakeServer)
    monkeypatch.setattr(bench, "TritonDriver", FakeDriver)
    monkeypatch.setattr(bench, "engine_metrics", lambda url: {})
    for name in [k for k in os.environ if k.startswith("MSTAR_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MSTAR_ENGINE_PROCESS", "1")
    monkeypatch.setenv("MSTAR_PDL", "0")
    monkeypatch.setenv("MSTAR_STEP_TIMES", "")  # empty: unset
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path))  # a place, not a switch
    assert bench._serve(args) == 0
    saved = json.loads(out.read_text())
    assert saved["switches"] == {"MSTAR_ENGINE_PROCESS": "1", "MSTAR_PDL": "0"}
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert saved["code"].split("+")[0] == head.stdout.strip()
        assert saved["code"].endswith("+changes") == bool(subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True,
            text=True).stdout.strip())
    text = markdown({"meta": {}, "models": {"m": saved}})
    assert f"Code {saved['code'] or 'unknown'}; environment switches: `MSTAR_ENGINE_PROCESS=1`, `MSTAR_PDL=0`." in text
    saved["switches"] = {}
    assert "environment switches: none set (the defaults)." in markdown({"meta": {}, "models": {"m": saved}})


def test_gpu_memory_is_none_without_nvidia_smi_and_the_report_leaves_it_out(monkeypatch, tmp_path):
    from mstar_common.bench import gpu_memory
    from mstar_common.bench.report import markdown

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi here
    assert gpu_memory.used_mib() is None
    assert gpu_memory.PeakSampler(interval_s=0.01).start().stop() is None
    memory = {"before_start": None, "after_start": None, "peak": None}
    assert gpu_memory.report_line(memory) is None
    assert "GPU memory" not in markdown({"meta": {}, "models": {"m": {"gpu_memory_mib": memory}}})


def test_gpu_memory_sums_every_gpu_and_a_failing_query_reads_none(monkeypatch, tmp_path):
    from mstar_common.bench import gpu_memory

    state = _fake_nvidia_smi(tmp_path, monkeypatch, 0)
    state.write_text("1200\n 800\n")
    assert gpu_memory.used_mib() == 2_000
    state.write_text("[N/A]\n")
    assert gpu_memory.used_mib() is None


@pytest.mark.parametrize("flag, value, rule", [
    ("--concurrency", "-2", "must be an integer >= 1"),  # hung for good
    ("--concurrency", "0", "must be an integer >= 1"),
    ("--rates", "0", "must be a number > 0"),  # ZeroDivisionError in the arrival draw
    ("--proxy-rates", "nan", "must be a number > 0"),
    ("--requests-per-level", "0", "must be an integer >= 1"),
])
def test_levels_the_sweep_cannot_run_are_refused_by_the_parser(capsys, flag, value, rule):
    with pytest.raises(SystemExit) as exit_info:
        bench_cli.main(["url", "--grpc", "127.0.0.1:1", "--out", "x.json", flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: {rule}" in capsys.readouterr().err


def test_a_report_of_files_that_are_not_results_is_one_error_line(tmp_path, capsys):
    (tmp_path / "dep.yaml").write_text("name: x\n")
    for path in (tmp_path / "missing.json", tmp_path / "dep.yaml"):
        assert bench_cli.main(["report", str(path), "--out", str(tmp_path / "r")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"mstar bench: error: {path}: not a results file") and "Traceback" not in err


def test_a_level_where_every_request_failed_says_why_and_fails_the_command(capsys):
    assert bench_cli._exit_status([{"target": "triton"}]) == 0
    assert bench_cli._exit_status([{"target": "triton", "all_failed": True}]) == 1
    assert "1 level(s) had no request succeed" in capsys.readouterr().err


def test_build_checkpoint_names_an_unknown_family_in_one_line(capsys):
    from mstar_common.cli import main

    assert main(["build-checkpoint", "nofam", "builtin:qwen3-tiny"]) == 2
    assert capsys.readouterr().err.startswith("mstar: error: unknown family 'nofam'; available: ['flux2_klein'")


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("argv, rule", [
    (["url", "--grpc", "127.0.0.1:1", "--out", "x.json", "--proxy-concurrency", "4"],
     "--proxy-concurrency and --proxy-rates need --proxy"),
    (["url", "--grpc", "127.0.0.1:1", "--out", "x.json", "--concurrency"], "nothing to run: every level list is empty"),
    (["serve", "--checkpoint", "c", "--out", "x.json", "--concurrency"],
     "and there is no --check-eager, --floor or --hf-baseline"),
    (["serve", "--checkpoint", "c", "--out", "x.json", "--hf-repeats", "0"], "argument --hf-repeats: must be"),
    (["serve", "--checkpoint", "c", "--out", "x.json", "--hf-output-len", "1"], "argument --hf-output-len: must be"),
    (["perf-analyzer-data", "--out", "pa", "--num-prompts", "0"], "argument --num-prompts: must be an integer >= 1"),
])
def test_runs_that_cannot_run_as_asked_are_refused_before_anything_starts(argv, rule, capsys):
    """Each of these once ran silently short (proxy levels dropped, an empty report), wrote an empty input file, or
    failed with a traceback after a whole sweep."""
    with pytest.raises(SystemExit) as exit_info:
        bench_cli.main(argv)
    assert exit_info.value.code == 2 and rule in _err(capsys)


def test_an_out_path_that_cannot_be_written_is_one_line(tmp_path, capsys):
    a_file = tmp_path / "r.json"
    a_file.write_text("{}")
    for argv, rule in (
        (["report", str(a_file), "--out", str(a_file)], "a file is there; this command writes a folder"),
        (["perf-analyzer-data", "--out", str(a_file)], "a file is there; this command writes a folder"),
        (["url", "--grpc", "127.0.0.1:1", "--out", str(tmp_path)], "a folder is there; this command writes a JSON"),
        (["url", "--grpc", "127.0.0.1:1", "--out", str(a_file / "x.json")], "cannot create its folder"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            bench_cli.main(argv)
        assert exit_info.value.code == 2 and f"--out {argv[argv.index('--out') + 1]}: {rule}" in _err(capsys)


@pytest.mark.parametrize("argv, rule", [
    (["--checkpoint", "/nonexistent/ckpt", "--hf-baseline", "--device", "cpu"],
     "checkpoint: /nonexistent/ckpt is not a directory"),
    (["--checkpoint", "builtin:nope", "--hf-baseline", "--device", "cpu"], "checkpoint: unknown builtin 'nope'"),
    (["--checkpoint", "/nonexistent/ckpt"], "nothing to measure: pass --floor and/or --hf-baseline"),
    (["--checkpoint", "builtin:qwen3-tiny", "--floor", "--device", "cpu"], "--floor measures a GPU's read bandwidth"),
])
def test_the_baseline_command_refuses_in_one_line(tmp_path, argv, rule, capsys):
    out = tmp_path / "b.json"
    assert bench_cli.main(["baseline", *argv, "--out", str(out)]) == 2
    assert f"mstar bench: error: {rule}" in _err(capsys) and not out.exists()


def test_the_hf_baseline_runs_on_the_cpu_and_adds_to_the_results_file(tmp_path, capsys):
    """`--device cpu`: HF generate on the CPU (it was hard-wired to CUDA and failed after the whole sweep), merged
    into the results file that is already there."""
    out = tmp_path / "b.json"
    out.write_text(json.dumps({"name": "tiny", "runs": []}))
    assert bench_cli.main(["baseline", "--checkpoint", "builtin:qwen3-tiny", "--hf-baseline", "--device", "cpu",
                           "--dtype", "float32", "--prompt-len", "8", "--output-len", "4", "--hf-batch", "1",
                           "--hf-repeats", "1", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["name"] == "tiny" and saved["runs"] == []
    (row,) = saved["hf_generate"]
    assert row["batch"] == 1 and row["output_tok_per_s"] > 0 and row["itl_ms"] >= 0
    # into a new file: it records the machine, date and command, as README says every results file does
    fresh = tmp_path / "new.json"
    assert bench_cli.main(["baseline", "--checkpoint", "builtin:qwen3-tiny", "--hf-baseline", "--device", "cpu",
                           "--dtype", "float32", "--prompt-len", "8", "--output-len", "4", "--hf-batch", "1",
                           "--hf-repeats", "1", "--out", str(fresh)]) == 0
    saved = json.loads(fresh.read_text())
    assert saved["meta"]["hardware"].startswith("CPU only") and saved["meta"]["date"] and saved["hf_generate"]


def test_the_report_refuses_two_files_of_one_name_and_files_it_cannot_render(tmp_path, capsys):
    first, second, broken = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    first.write_text(json.dumps({"name": "model", "runs": []}))
    second.write_text(json.dumps({"name": "model", "runs": []}))
    broken.write_text(json.dumps({"name": "x", "runs": [{"target": "triton"}]}))
    assert bench_cli.main(["report", str(first), str(second), "--out", str(tmp_path / "r")]) == 2
    assert f"{first} and {second} both hold the results of 'model'" in _err(capsys)
    assert bench_cli.main(["report", str(broken), "--out", str(tmp_path / "r")]) == 2
    assert f"{broken}: not a results file of `mstar bench` (KeyError: 'summary')" in _err(capsys)


def test_the_report_labels_each_model_with_the_machine_that_measured_it():
    from mstar_common.bench.report import markdown

    measured = {"hardware": "NVIDIA H200 (140 GiB)", "software": "torch 2.13", "date": "2026-12-05",
                "command": "mstar bench serve --name a"}
    text = markdown({"meta": {"hardware": "CPU only (2 cores)", "command": "mstar bench report"},
                     "models": {"a": {"meta": measured, "runs": []}, "b": {"runs": []}}})
    assert text.startswith("Report made on CPU only (2 cores)")
    assert ("### a\n\nMeasured on NVIDIA H200 (140 GiB) (torch 2.13), 2026-12-05: `mstar bench serve --name a`."
            in text)
    assert "### b\n\nMeasured on: not recorded" in text


def test_a_failed_check_request_closes_its_stream(monkeypatch):
    """A check request that fails closed nothing, so the server's shutdown waited 25 s on the open stream."""
    import tritonclient.grpc as grpcclient

    calls = []

    class FakeClient:
        def __init__(self, url, channel_args=None):
            pass

        def start_stream(self, callback):
            self.callback = callback

        def async_stream_infer(self, *args, **kwargs):
            self.callback(None, "exceeds max_model_len")

        def stop_stream(self):
            calls.append("stop_stream")

        def close(self):
            calls.append("close")

    monkeypatch.setattr(grpcclient, "InferenceServerClient", FakeClient)
    args = argparse.Namespace(prompt_len=8, check_len=4, check_eager=1)
    with pytest.raises(RuntimeError, match="check request failed: exceeds max_model_len"):
        bench_cli.served_tokens("127.0.0.1:1", "qwen3_llm", args)
    assert calls == ["stop_stream", "close"]


def test_the_proxys_text_prompts_count_the_bos_a_llama_tokenizer_adds_and_differ_as_the_ids_do(tmp_path):
    """The component encodes `text_input` (the proxy's completions prompt) as `tokenizer(text)` does, with a Llama
    tokenizer's BOS, so a proxy level's prompt is as long as the Triton level's token-id prompt only if the text is
    one token shorter. The prompts differ from their start wherever the ids do: one text for every request made a
    server with the prefix cache on serve all but the first from the cache."""
    from tokenizers import processors

    from mstar_common.families.qwen3.tiny import build_tokenizer

    plain = build_tokenizer()
    plain.save_pretrained(tmp_path / "plain")
    with_bos = build_tokenizer()
    bos = "<|endoftext|>"
    with_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, with_bos.convert_tokens_to_ids(bos))])
    with_bos.save_pretrained(tmp_path / "bos")
    requests = Workload("fixed", 32, 4).requests(20)
    for checkpoint, num_words in ((tmp_path / "plain", 32), (tmp_path / "bos", 31), (None, 32)):
        text = bench_cli.prompt_text_for(checkpoint)  # with a checkpoint it asserts each prompt's token count
        prompts = [text(r["input_ids"]) for r in requests]
        assert all(p.count(" ") == num_words and p.endswith(" the" * (num_words - 8)) for p in prompts)
        # as distinct as the ids from their first words (a prefix cache must not serve one from another), and
        # the same ids give the same prompt
        assert len({p[:40] for p in prompts}) == len(prompts)
        assert text(requests[3]["input_ids"]) == prompts[3]
    assert bench_cli.prompt_text_for(None)([1, 2, 3]).count(" ") == 3


@pytest.mark.parametrize("flags, message", [
    (["--prompt-len", "1024"], "--prompt-len 1024 plus --output-len 256 is 1280 tokens, more than --max-model-len "
                               "1024"),
    (["--prompt-len", "100", "--output-len", "8", "--output-len-max", "64", "--max-model-len", "128"],
     "--prompt-len 100 plus --output-len-max 64 is 164 tokens"),
    (["--prompt-len", "100", "--output-len", "8", "--max-model-len", "128", "--check-eager", "1"],
     "--check-eager: --prompt-len 100 plus --check-len 64 is more than --max-model-len 128"),
])
def test_a_workload_longer_than_the_servers_context_is_refused_before_it_starts(bench, monkeypatch, capsys, flags,
                                                                                message):
    """Every request of such a sweep was refused by the engine after the server had started and captured its
    graphs, and the run ended with `every request failed`."""
    monkeypatch.setattr(bench, "cmd_serve", lambda args: pytest.fail("the server would start"))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["serve", "--checkpoint", "/tmp/ckpt", "--out", "/tmp/out.json", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_input_data_longer_than_the_servers_context_is_refused_before_it_starts(bench, monkeypatch, capsys,
                                                                                tmp_path):
    from mstar_common.bench.workload import Workload, perf_analyzer_data

    data = tmp_path / "long.json"
    data.write_text(json.dumps(perf_analyzer_data(Workload("fixed", 900, 200).requests(2))))
    monkeypatch.setattr(bench, "cmd_serve", lambda args: pytest.fail("the server would start"))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["serve", "--checkpoint", "/tmp/ckpt", "--out", "/tmp/out.json", "--input-data", str(data)])
    assert exit_info.value.code == 2
    assert "--input-data: a request's prompt and max_tokens come to 1100 tokens" in capsys.readouterr().err


def test_the_eager_check_holds_a_request_as_long_as_the_server_takes(bench, monkeypatch, tmp_path):
    """Its engine had 64 pages whatever the lengths: a 4,096-token check (or here 1-token pages) raised
    AdmissionError after the sweep, losing the check and the baselines after it."""
    from mstar_common.families.qwen3.tiny import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint(tmp_path / "qwen3_tiny")
    args = _serve_args(bench, monkeypatch, "--device", "cpu", "--dtype", "float32", "--prompt-len", "70",
                       "--output-len", "4", "--check-len", "4", "--check-eager", "1", "--page-size", "1",
                       "--max-model-len", "80", "--max-batch-tokens", "128")
    args.checkpoint = checkpoint
    [tokens] = bench.eager_tokens(args)
    assert len(tokens) == 4


def test_baseline_refuses_lengths_below_one(bench, capsys):
    for flags in (["--output-len", "0"], ["--prompt-len", "-3"]):
        with pytest.raises(SystemExit) as exit_info:
            bench.main(["baseline", "--checkpoint", "/nowhere", "--out", "/tmp/b.json", "--hf-baseline", *flags])
        assert exit_info.value.code == 2 and "must be an integer >= 1" in capsys.readouterr().err


def test_a_sampled_workloads_data_file_never_takes_the_greedy_ones_name(bench, tmp_path):
    """`--temperature 0.8` wrote fixed_512in_256out.json too, over the committed greedy workload's file."""
    from mstar_common.bench.workload import requests_from_file

    for flags in ([], ["--temperature", "0.8"], ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "50"]):
        assert bench.main(["perf-analyzer-data", "--out", str(tmp_path), "--prompt-len", "8", "--output-len", "2",
                           "--num-prompts", "2", *flags]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["fixed_8in_2out.json", "fixed_8in_2out_temp0.8.json",
                     "fixed_8in_2out_temp0.8_topp0.9_topk50.json"]
    assert {r["temperature"] for r in requests_from_file(tmp_path / "fixed_8in_2out_temp0.8.json")} == {0.8}
    assert {r["temperature"] for r in requests_from_file(tmp_path / "fixed_8in_2out.json")} == {0.0}


def test_the_log_copies_of_an_org_name_deployment_are_files_not_folders(tmp_path, monkeypatch):
    """`--name Qwen/Qwen3-0.6B` put the copies at DIR/tritonserver-Qwen/Qwen3-0.6B.log (a subfolder made quietly)."""
    from types import SimpleNamespace

    from mstar_common.bench import cli as bench_cli

    root = tmp_path / "run"
    root.mkdir()
    for name in ("tritonserver.log", "proxy.log"):
        (root / name).write_text(f"{name} lines\n")
    server = object.__new__(bench_cli.Server)
    server.root, server.dep, server.triton, server.proxy = root, SimpleNamespace(name="Qwen/Qwen3-0.6B"), None, None
    monkeypatch.setenv("MSTAR_BENCH_LOG_DIR", str(tmp_path / "logs"))
    server.__exit__(None, None, None)
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["proxy-Qwen_Qwen3-0.6B.log",
                                                                     "tritonserver-Qwen_Qwen3-0.6B.log"]


def test_the_bench_reads_its_own_servers_metrics_whatever_http_proxy_says(monkeypatch):
    """urllib sends even a loopback request through the environment's http_proxy: on a host with one set, the bench
    recorded no engine counters or server-side latency ("metrics endpoint unreadable")."""
    from tests.unit.local_http import answering, behind_unreachable_proxy

    behind_unreachable_proxy(monkeypatch)
    with answering(b"mstar_up 1\n") as url:
        assert bench_cli._metrics_text(f"{url}/metrics", "counters") == "mstar_up 1\n"


def test_the_hf_baseline_runs_at_an_input_data_files_lengths_where_it_has_one_of_each():
    """`--hf-baseline --input-data F` timed HF at --prompt-len/--output-len (512/256) whatever F held, and the
    report then declined every comparison."""
    args = argparse.Namespace(prompt_len=512, output_len=256, hf_output_len=None, input_requests=None)
    assert bench_cli.hf_lengths(args) == (512, 256)
    args.input_requests = [{"input_ids": [5] * 128, "max_tokens": 64}] * 3
    assert bench_cli.hf_lengths(args) == (128, 64)
    args.hf_output_len = 32
    assert bench_cli.hf_lengths(args) == (128, 32)
    args.hf_output_len, args.input_requests = None, [{"input_ids": [5] * 128, "max_tokens": 64},
                                                     {"input_ids": [5] * 100, "max_tokens": 64}]
    assert bench_cli.hf_lengths(args) == (512, 256)  # not one length: the flags', and no level is compared


def test_a_served_deployment_says_whether_its_prefix_cache_is_on():
    assert bench_cli.served_prefix_cache(None) is None
    assert bench_cli.served_prefix_cache({"resources": {"kv_cache": {"prefix_caching": None}}}) is True
    assert bench_cli.served_prefix_cache({"resources": {"kv_cache": {"prefix_caching": False}}}) is False
    assert bench_cli.served_prefix_cache({"resources": {"kv_cache": {"prefix_caching": True}}}) is True


def test_a_targets_repeated_prompts_are_its_own(monkeypatch):
    """The proxy sends a prompt as text, which tokenizes otherwise than the ids Triton was sent: a file's prompt
    that only the Triton levels had sent was counted as a cache hit for the proxy's levels too."""
    class Record:
        ttft, error = 0.01, None

    class Driver:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def run(self, batch, **load):
            return [Record() for _ in batch]

    monkeypatch.setattr(bench_cli, "TritonDriver", Driver)
    monkeypatch.setattr(bench_cli, "OpenAIDriver", Driver)
    monkeypatch.setattr(bench_cli, "summarize", lambda records, slo: {
        "num_requests": len(records), "output_tok_per_s": 0.0, "num_errors": 0,
        "ttft_ms": {"p50": None, "mean": None}, "itl_ms": {"p50": None, "p99": None}})
    given = [{"input_ids": [i, 5, 6], "max_tokens": 4} for i in range(16)]
    args = argparse.Namespace(
        input_requests=given, input_data="f.json", slo_ttft_ms=None, slo_tpot_ms=None, triton_outputs="all",
        warmup=2, min_requests=4, requests_per_level=2, concurrency=[1, 8], rates=[], proxy_concurrency=[1, 8],
        proxy_rates=[], triton_client_processes=1, client_processes=1, name="m", prompt_len=3, output_len=4,
        temperature=0.0, top_p=1.0, top_k=0, shared_prefix_len=0, prompt_len_max=None, output_len_max=None,
        no_ignore_eos=False)
    runs = bench_cli.sweep(args, "grpc", "entry", "http://proxy", None, None, prefix_cache=True)
    # requests 0-1 warm-up, 2-5 c=1, 6-21 c=8 (file 6..15, then 0..5: six resent); the proxy: 22-23 warm-up
    # (files 6, 7), 24-27 c=1 (8-11), 28-43 c=8 (12-15, 0-11: 6-11 resent by the proxy itself)
    assert [(r["target"], r.get("repeated_prompts")) for r in runs] == [
        ("triton", None), ("triton", 6), ("openai", None), ("openai", 6)]
    # and with the cache off nothing is counted
    runs = bench_cli.sweep(args, "grpc", "entry", "http://proxy", None, None, prefix_cache=False)
    assert not any(r.get("repeated_prompts") for r in runs)


def test_the_bench_asks_a_local_proxy_directly_whatever_http_proxy_says(monkeypatch):
    """`check_targets` asked the proxy's /health and /v1/models with urllib's urlopen, which sends even a loopback
    request through the environment's http_proxy: `mstar bench url` on such a host refused its own local server."""
    from tests.unit.local_http import answering, behind_unreachable_proxy

    class Ready:
        def is_server_ready(self, client_timeout):
            return True

        def is_model_ready(self, model, client_timeout):
            return True

        def close(self):
            pass

    monkeypatch.setattr(bench_cli, "triton_grpc_client", lambda url: Ready())
    behind_unreachable_proxy(monkeypatch)
    with answering(json.dumps({"data": [{"id": "qwen3-tiny"}]}).encode()) as url:
        assert bench_cli.check_targets("127.0.0.1:1", "qwen3_llm", url, "qwen3-tiny") is None
        assert "serves ['qwen3-tiny'], not 'other'" in bench_cli.check_targets("127.0.0.1:1", "qwen3_llm", url, "other")
