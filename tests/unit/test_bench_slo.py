"""The harness's SLO and goodput (`mstar bench --slo-ttft-ms/--slo-tpot-ms`): which requests meet it, the summary
and the report line (CPU; synthetic timings)."""

from __future__ import annotations

import pytest

from mstar_common.bench import cli as bench_cli
from mstar_common.bench.metrics import RequestRecord, Slo, summarize
from mstar_common.bench.report import markdown


def _record(start: float, first_ms: float, gap_ms: float, tokens: int, error: str | None = None) -> RequestRecord:
    """`tokens` tokens, one per response: the first `first_ms` after `start`, then one every `gap_ms`."""
    times = [start + (first_ms + i * gap_ms) / 1e3 for i in range(tokens)]
    return RequestRecord(start=start, chunks=[(t, 1) for t in times], end=times[-1], error=error)


def test_a_request_meets_the_slo_only_within_both_bounds():
    slo = Slo(ttft_ms=100, tpot_ms=10)
    assert slo.met_by(_record(0.0, 80, 9, 11))
    assert not slo.met_by(_record(0.0, 120, 9, 11))  # first token late
    assert not slo.met_by(_record(0.0, 80, 12, 11))  # 12 ms per token after it
    assert not slo.met_by(_record(0.0, 80, 9, 11, error="boom"))
    assert not slo.met_by(RequestRecord(start=0.0, end=1.0))  # no token at all
    assert Slo(ttft_ms=100).met_by(_record(0.0, 80, 50, 5))  # no TPOT bound
    assert Slo(tpot_ms=10).met_by(_record(0.0, 900, 9, 5))  # no TTFT bound
    with pytest.raises(ValueError, match="tpot_ms must be > 0"):
        Slo(tpot_ms=0)


def test_the_summary_counts_the_requests_that_met_it_and_the_goodput():
    records = [_record(0.0, 50, 5, 21), _record(0.0, 150, 5, 21), _record(0.5, 50, 5, 21), _record(0.5, 50, 20, 21)]
    summary = summarize(records, Slo(ttft_ms=100, tpot_ms=10))
    duration = summary["duration_s"]
    assert duration == pytest.approx(0.5 + (50 + 20 * 20) / 1e3)
    assert summary["slo"] == {"ttft_ms": 100, "tpot_ms": 10, "met": 2, "met_fraction": 0.5,
                              "goodput_req_per_s": pytest.approx(2 / duration)}
    assert "slo" not in summarize(records)
    model = {"runs": [{"target": "triton", "concurrency": 4, "summary": summary}]}
    text = markdown({"meta": {}, "models": {"m": model}})
    assert f"triton c=4: 2/4 requests met TTFT <= 100 ms and TPOT <= 10 ms (50%); goodput {2 / duration:.2f} req/s" \
        in text


@pytest.mark.parametrize("value", ["0", "-5", "soon", "inf"])
def test_slo_bounds_must_be_positive_numbers(capsys, value):
    with pytest.raises(SystemExit):
        bench_cli.main(["url", "--grpc", "127.0.0.1:9", "--slo-ttft-ms", value, "--out", "/tmp/never.json"])
    assert "--slo-ttft-ms: must be a number of ms > 0" in capsys.readouterr().err
