"""The server-side latency a benchmark level records (mstar_common/bench/cli.py `latency_totals`, `server_latency`)
and the report's line for it (mstar_common/bench/report.py `server_lines`)."""

from __future__ import annotations

import pytest

from mstar_common.bench.cli import latency_totals, server_latency
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
