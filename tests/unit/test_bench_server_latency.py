"""The server-side latency a benchmark level records (mstar_common/bench/cli.py `latency_totals`, `server_latency`)
and the report's line for it (mstar_common/bench/report.py `server_lines`)."""

from __future__ import annotations

import pytest

from mstar_common.bench.cli import latency_totals, server_latency, server_steps, step_totals
from mstar_common.bench.report import markdown

PAGE = """# HELP mstar_time_to_first_token_seconds request arrival at the component -> first output sent
# TYPE mstar_time_to_first_token_seconds histogram
mstar_time_to_first_token_seconds_count{{device="cpu",instance="llm_0",model="qwen3_llm"}} {n0}
mstar_time_to_first_token_seconds_sum{{device="cpu",instance="llm_0",model="qwen3_llm"}} {s0}
mstar_time_to_first_token_seconds_bucket{{device="cpu",instance="llm_0",model="qwen3_llm",le="0.001"}} 0
mstar_time_to_first_token_seconds_count{{device="cpu",instance="llm_1",model="qwen3_llm"}} {n1}
mstar_time_to_first_token_seconds_sum{{device="cpu",instance="llm_1",model="qwen3_llm"}} {s1}
mstar_inter_token_latency_seconds_count{{device="cpu",instance="llm_0",model="qwen3_llm"}} {m}
mstar_inter_token_latency_seconds_sum{{device="cpu",instance="llm_0",model="qwen3_llm"}} {t}
nv_inference_count{{model="qwen3_llm",version="1"}} 99
"""


def test_a_level_gets_the_mean_of_what_the_components_observed_during_it():
    before = latency_totals(PAGE.format(n0=3, s0=0.006, n1=1, s1=0.004, m=30, t=0.03))
    assert before == {"ttft": (pytest.approx(0.010), 4.0), "itl": (0.03, 30.0)}  # summed over both instances
    after = latency_totals(PAGE.format(n0=5, s0=0.010, n1=3, s1=0.012, m=90, t=0.09))
    latency = server_latency(before, after)
    assert latency["ttft_samples"] == 4 and latency["ttft_ms_mean"] == pytest.approx(3.0)  # 12 ms over 4
    assert latency["itl_samples"] == 60 and latency["itl_ms_mean"] == pytest.approx(1.0)
    idle = server_latency(after, after)
    assert idle == {"ttft_ms_mean": None, "ttft_samples": 0, "itl_ms_mean": None, "itl_samples": 0}
    assert latency_totals("") == {"ttft": (0.0, 0.0), "itl": (0.0, 0.0)}  # no streaming component


def test_the_report_puts_the_server_means_beside_the_clients():
    summary = {"num_requests": 4, "requests_per_s": 1.0, "output_tok_per_s": 10.0, "tokens_per_response": 1.0,
               "num_errors": 0, "ttft_ms": {"p50": 5.0, "p90": 6.0, "p99": 7.0, "mean": 5.5},
               "itl_ms": {"p50": 0.7, "p90": 0.8, "p99": 0.9, "mean": 0.72}}
    runs = [{"target": "triton", "concurrency": 1, "summary": summary,
             "server": {"ttft_ms_mean": 1.25, "ttft_samples": 4, "itl_ms_mean": 0.71, "itl_samples": 100}},
            {"target": "openai", "rate": 8.0, "summary": summary}]  # no metrics read for this one
    text = markdown({"meta": {}, "models": {"m": {"runs": runs}}})
    assert ("- server side, means (arrival at the component -> first token sent; gaps between its sends): "
            "triton c=1: TTFT 1.250 ms (client 5.500), ITL 0.710 ms (client 0.720)\n") in text
    assert "server side" not in markdown({"meta": {}, "models": {"m": {"runs": runs[1:]}}})


STEPS = """mstar_engine_steps_total{{device="cuda:0",instance="llm_0",model="qwen3_llm"}} {steps}
mstar_graph_steps_total{{device="cuda:0",instance="llm_0",model="qwen3_llm"}} {graph}
mstar_engine_rows_stepped_total{{device="cuda:0",instance="llm_0",model="qwen3_llm"}} {rows}
mstar_engine_tokens_stepped_total{{device="cuda:0",instance="llm_0",model="qwen3_llm"}} {tokens}
mstar_graph_padding_tokens_total{{device="cuda:0",instance="llm_0",model="qwen3_llm"}} {padding}
"""


def test_a_level_gets_the_steps_the_engines_ran_during_it():
    before = step_totals(STEPS.format(steps=10, graph=10, rows=10, tokens=10, padding=0))
    # 100 more steps, 96 replayed: 90 decode steps of 64 rows (5,760 tokens, no padding) and 6 mixed steps of
    # 575 tokens in the 1024 bucket (3,450 tokens, 2,694 padding), 4 eager steps of 1 token
    after = step_totals(STEPS.format(steps=110, graph=106, rows=10 + 90 * 64 + 6 * 64 + 4,
                                     tokens=10 + 5760 + 3450 + 4, padding=2694))
    steps = server_steps(before, after)
    assert steps == {"steps": 100, "tokens": 9214, "padding_tokens": 2694, "graph_share": 0.96,
                     "rows_per_step": 61.48, "tokens_per_step": 92.14, "padding_share": round(2694 / (9214 + 2694), 4)}
    assert server_steps(after, after) is None  # nothing stepped
    assert step_totals("") == dict.fromkeys(["steps", "graph_steps", "rows", "tokens", "padding"], 0.0)


def test_the_report_lists_each_levels_steps():
    summary = {"num_requests": 4, "requests_per_s": 1.0, "output_tok_per_s": 10.0, "tokens_per_response": 1.0,
               "num_errors": 0, "ttft_ms": {"p50": 5.0, "p90": 6.0, "p99": 7.0, "mean": 5.5},
               "itl_ms": {"p50": 0.7, "p90": 0.8, "p99": 0.9, "mean": 0.72}}
    steps = {"steps": 1900, "graph_share": 0.999, "rows_per_step": 61.5, "tokens_per_step": 92.1,
             "padding_share": 0.226}
    runs = [{"target": "triton", "concurrency": 64, "summary": summary,
             "server": {"ttft_ms_mean": 1.25, "ttft_samples": 4, "itl_ms_mean": 0.71, "itl_samples": 100,
                        "steps": steps}}]
    text = markdown({"meta": {}, "models": {"m": {"runs": runs}}})
    assert ("triton c=64: 1,900 steps, 61.5 rows and 92.1 tokens a step, 100% replayed, 23% padding\n") in text
