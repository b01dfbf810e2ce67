"""scripts/simulate_steps.py: the engine's scheduler run over a closed-loop workload with no model, each step put
in the graph bucket the runner would replay it in."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "simulate_steps.py"


def _module():
    spec = importlib.util.spec_from_file_location("simulate_steps", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_token_is_computed_once_and_each_step_lands_in_its_bucket():
    sim = _module()
    result = sim.simulate(concurrency=8, prompt_len=100, output_len=20, requests=24, max_batch_tokens=256,
                          decode_buckets=[1, 2, 4, 8], token_buckets=[64, 128, 256])
    # each request: its prompt, then one token for each output but the last
    assert result["tokens"] == 24 * (100 + 19)
    assert sum(row["steps"] for row in result["by_bucket"].values()) == result["steps"]
    slots = 0
    for name, row in result["by_bucket"].items():
        kind, size = name.split()
        assert row["tokens_per_step"] <= int(size), name
        slots += row["steps"] * int(size)
    assert slots - result["tokens"] == result["padding_tokens"] > 0
    assert result["by_bucket"]["decode 8"]["steps"] > result["steps"] // 2  # eight streams decoding most steps


def test_a_step_past_the_buckets_runs_eager_and_the_cli_prints_the_fill(capsys):
    sim = _module()
    assert sim.bucket_of(3, 3, True, [1, 2, 4], [64]) == ("decode", 4)
    assert sim.bucket_of(8, 8, True, [1, 2, 4], [64]) == ("mixed", 64)  # too many rows: the mixed graph
    assert sim.bucket_of(2, 100, False, [1, 2, 4], [64]) == ("eager", 0)
    assert sim.main(["--concurrency", "4", "--prompt-len", "64", "--output-len", "8", "--max-batch-tokens", "128",
                     "--decode-buckets", "1", "2", "4", "--token-buckets", "64", "128"]) == 0
    out = capsys.readouterr().out
    assert "tokens computed" in out and "decode 4" in out and "% full)" in out
