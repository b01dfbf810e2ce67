"""`mstar bench serve` end to end on the CPU: it builds the builtin tiny Qwen3, starts its own tritonserver and
proxy, runs a level through each (the Triton one from two client processes), checks served greedy tokens against
its in-process eager engine, writes the JSON and stops both servers; and it names a checkpoint or a server it
cannot use instead of a traceback."""

from __future__ import annotations

import json

import pytest

from mstar_common.checkpoints import BUILTIN_DIR
from mstar_common.cli import main

pytestmark = pytest.mark.server


def test_bench_serve_measures_its_own_server_and_checks_it_against_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "runs" / "tiny.json"
    assert main(["bench", "serve", "--checkpoint", "builtin:qwen3-tiny", "--device", "cpu", "--name", "qwen3-tiny",
                 "--max-model-len", "512", "--concurrency", "2", "--proxy-concurrency", "1", "--prompt-len", "12",
                 "--output-len", "5", "--warmup", "1", "--check-eager", "2", "--check-len", "6",
                 "--triton-outputs", "token_ids", "--triton-client-processes", "2", "--out", str(out)]) == 0
    model = json.loads(out.read_text())
    assert model["checkpoint"] == str(tmp_path / "cache" / BUILTIN_DIR / "qwen3-tiny") and model["startup_s"] > 0
    served = model["deployment"]  # the deployment as served, defaults filled in
    assert served["resources"]["max_batch_tokens"] == 2048 and served["resources"]["max_model_len"] == 512
    assert served["components"]["llm"]["placement"]["device"] == "cpu"
    assert [(run["target"], run["concurrency"]) for run in model["runs"]] == [("triton", 2), ("openai", 1)]
    assert model["runs"][0]["outputs"] == "token_ids"  # its client asked for the token ids alone
    for run in model["runs"]:
        summary = run["summary"]
        assert summary["num_errors"] == 0 and summary["output_tokens"] == 5 * summary["num_requests"], summary
        # the server's own latency over the level (warm-up excluded): one first token per request, and inside the
        # client's time to it
        server = run["server"]
        assert server["ttft_samples"] == summary["num_requests"], server
        assert 0 < server["ttft_ms_mean"] < summary["ttft_ms"]["mean"], (server, summary["ttft_ms"])
        assert server["itl_samples"] >= 1 and server["itl_ms_mean"] > 0, server
        # the engine's steps over the level: each request's 12 prompt tokens and 4 fed-back outputs, eager on the
        # CPU (no graphs, no padding)
        steps = server["steps"]
        assert steps["tokens"] == 16 * summary["num_requests"], steps
        assert steps["graph_share"] == 0 and steps["padding_share"] == 0, steps
        assert 1 <= steps["rows_per_step"] <= run["concurrency"], steps
    (check,) = model["checks"].values()
    assert check.startswith("2/2 requests identical"), check


def test_bench_serve_names_a_missing_checkpoint_and_a_server_that_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    base = ["bench", "serve", "--device", "cpu", "--concurrency", "1", "--out", str(tmp_path / "never.json")]
    assert main([*base, "--checkpoint", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    # the tiny checkpoint has 512 positions, the default --max-model-len is 1024: the stub refuses to load
    assert main([*base, "--checkpoint", "builtin:qwen3-tiny"]) == 1
    err = capsys.readouterr().err
    assert "tritonserver exited" in err and "max_position_embeddings=512" in err  # the log's tail says why
    assert not (tmp_path / "never.json").exists()
