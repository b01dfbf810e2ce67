"""Per-request timings and their summary: TTFT, ITL (p50/p90/p99), output tok/s, requests/s, and with an SLO
the share of requests that met it and the goodput.

ITL is per token: a response that carries k tokens after a gap g (the server coalesces when a stream falls
behind) counts as k inter-token latencies of g/k, so the mean ITL times the tokens is the decode time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class RequestRecord:
    start: float  # perf_counter when the request was sent
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in the response)
    end: float | None = None
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float | None:
        first = next((t for t, n in self.chunks if n > 0), None)
        return None if first is None else first - self.start

    def itls(self) -> list[float]:
        out: list[float] = []
        times = [(t, n) for t, n in self.chunks if n > 0]
        for (t0, _), (t1, n) in zip(times, times[1:], strict=False):
            out += [(t1 - t0) / n] * n
        return out


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1e3 if values else None


@dataclass(frozen=True, slots=True)
class Slo:
    """A per-request service-level objective: time to first token and mean time per output token after it
    (TPOT: (last token - first token) / (tokens - 1)), in ms; None: no bound on that one."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"slo {name} must be > 0 ms, got {value}")

    def met_by(self, record: RequestRecord) -> bool:
        """An errored request, or one with no token, never meets it."""
        if record.error is not None or record.end is None or record.ttft is None:
            return False
        if self.ttft_ms is not None and record.ttft * 1e3 > self.ttft_ms:
            return False
        if self.tpot_ms is not None:
            times = [t for t, n in record.chunks if n > 0]
            if record.num_tokens > 1 and (times[-1] - times[0]) * 1e3 / (record.num_tokens - 1) > self.tpot_ms:
                return False
        return True


def summarize(records: list[RequestRecord], slo: Slo | None = None) -> dict:
    """`slo`: also how many requests met it, and the goodput (requests meeting it per second of the level)."""
    ok = [r for r in records if r.error is None and r.end is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls()]
    tokens = sum(r.num_tokens for r in ok)
    duration = (max(r.end for r in ok) - min(r.start for r in ok)) if ok else 0.0
    summary = {
        "num_requests": len(records),
        "num_errors": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:3],
        "duration_s": duration,
        "output_tokens": tokens,
        "requests_per_s": len(ok) / duration if duration else 0.0,
        "output_tok_per_s": tokens / duration if duration else 0.0,
        "ttft_ms": {**{f"p{q}": _pct(ttfts, q) for q in (50, 90, 99)},
                    "mean": float(np.mean(ttfts)) * 1e3 if ttfts else None},
        "itl_ms": {**{f"p{q}": _pct(itls, q) for q in (50, 90, 99)},
                   "mean": float(np.mean(itls)) * 1e3 if itls else None},
        "tokens_per_response": tokens / max(1, sum(len(r.chunks) for r in ok)),
    }
    if slo is not None:
        met = sum(slo.met_by(r) for r in records)
        summary["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "met": met,
                          "met_fraction": met / len(records) if records else 0.0,
                          "goodput_req_per_s": met / duration if duration else 0.0}
    return summary
