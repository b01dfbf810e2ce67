"""scripts/simulate_steps.py: the engine's scheduler run over a closed-loop workload with no model, each step put
in the graph bucket the runner would replay it in."""

from __future__ import annotations

from tests.scripts import load_script


def _module():
    return load_script("simulate_steps")


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
    buckets = sim.RunnerBuckets([1, 2, 4, 16], [64], max_rows=8)  # 16 rows: more than the runner keeps
    assert buckets.bucket_of(3, 3, True) == ("decode", 4)
    assert buckets.bucket_of(8, 8, True) == ("mixed", 64)  # too many rows for the decode graphs: the mixed one
    assert buckets.bucket_of(2, 100, False) == ("eager", 0)
    assert sim.main(["--concurrency", "4", "--prompt-len", "64", "--output-len", "8", "--max-batch-tokens", "128",
                     "--decode-buckets", "1", "2", "4", "--token-buckets", "64", "128"]) == 0
    out = capsys.readouterr().out
    assert "tokens computed" in out and "decode 4" in out and "% full)" in out


def test_late_arrivals_keep_every_token_and_spread_the_prompts():
    """With clients that come back 0-3 steps late every token is still computed once; the steps grow by the idle
    ones, and the prompts no longer all fill the largest graph together."""
    sim = _module()
    common = dict(concurrency=16, prompt_len=512, output_len=64, requests=96, max_batch_tokens=2048,
                  decode_buckets=[1, 2, 4, 8, 16], token_buckets=[512, 1024, 2048])
    prompt, late = sim.simulate(**common), sim.simulate(**common, return_lag=3, seed=1)
    for result in (prompt, late):
        assert result["tokens"] == 96 * (512 + 63)
    assert late["steps"] > prompt["steps"]
    assert late["by_bucket"].get("mixed 1024", {}).get("steps", 0) > prompt["by_bucket"].get("mixed 1024", {}).get(
        "steps", 0)
