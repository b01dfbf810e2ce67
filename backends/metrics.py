"""Per-component metrics on Triton's Prometheus endpoint (/metrics), next to Triton's own `nv_*` series.

A background thread samples `engine.stats()` every PERIOD_S into gauges and counters, and takes the
latency samples the output thread collected into histograms, so the step loop and the output thread never
make a metrics IPC call themselves. Every series carries the labels `model` and `instance` (one per Triton
instance). docs/metrics.md lists the series and what they mean.

The latency histograms are Prometheus counters in a histogram's shape (`BucketCounters`): a `pb_utils`
histogram takes one IPC round trip to the server per observed value, and with an ITL sample per token (20,000 a
second at c=64) those round trips took the stub's message path from its response sends: a thread observing
beside a sender cut the sender's rate by more than half (`scripts/probe_send_rate.py --observer`), and the exporter
fell behind the pump.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import threading
import time
from collections import deque

import triton_python_backend_utils as pb_utils

logger = logging.getLogger(__name__)

PERIOD_S = 0.1

# stats key -> (series, help): the value as it is now
GAUGES = {
    "num_running": ("mstar_requests_running", "requests admitted to the component (running batch)"),
    "num_waiting": ("mstar_requests_waiting", "requests queued for admission (queue depth)"),
    "num_used_pages": ("mstar_kv_pages_used", "paged-KV pages holding tokens"),
    "num_reserved_pages": ("mstar_kv_pages_reserved", "paged-KV pages reserved by admitted requests"),
    "num_free_pages": ("mstar_kv_pages_free", "paged-KV pages free"),
    "num_cached_pages": ("mstar_kv_pages_cached", "paged-KV pages no request holds, kept for the prefix cache"),
    "num_used_state_slots": ("mstar_state_slots_used",
                             "per-request state slots held beside the paged KV (Whisper's decoder: its cross-attention "
                             "slots; 0 elsewhere)"),
    "num_codec_streams": ("mstar_codec_streams",
                          "speech streams open on the codec edge, queued ones included (0: no codec edge)"),
}
# stats key -> (series, help): a running total, exported as a counter
COUNTERS = {
    "num_steps": ("mstar_engine_steps_total", "engine steps run (rate() gives steps per second)"),
    "num_graph_steps": ("mstar_graph_steps_total", "engine steps replayed from a captured CUDA graph"),
    "num_rows_stepped": ("mstar_engine_rows_stepped_total", "rows the engine's steps advanced (per step: its batch)"),
    "num_tokens_stepped": ("mstar_engine_tokens_stepped_total",
                           "tokens the engine's steps computed (prompt chunks and decode rows)"),
    "num_graph_padding_tokens": ("mstar_graph_padding_tokens_total",
                                 "tokens a replayed graph computed beyond its step's, padding up to its bucket"),
    "num_refused": ("mstar_requests_overloaded_total", "requests refused because the queue was full (429)"),
    "num_expired": ("mstar_requests_expired_total", "requests ended by their deadline or queue wait limit"),
    "prefix_cache_queried_tokens": ("mstar_prefix_cache_queried_tokens_total",
                                    "prompt tokens looked up in the prefix cache at admission"),
    "prefix_cache_hit_tokens": ("mstar_prefix_cache_hit_tokens_total",
                                "prompt tokens whose KV the prefix cache supplied (their prefill skipped)"),
}
# the samples this exporter has finished, counted after each one's values: a sample begun after a reader's first read
# has ended once the count is 2 past what that read saw (the one it counted next may have been under way), so
# everything recorded before that read is on the page (the benchmark brackets a level by it: bench/cli.py)
SAMPLES_SERIES = "mstar_metrics_samples_total"
SAMPLES_HELP = "metric samples this instance has exported (each counted after its values)"
LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
# LatencySamples attribute -> (series, help)
HISTOGRAMS = {
    "ttft": ("mstar_time_to_first_token_seconds", "request arrival at the component -> first output sent"),
    "itl": ("mstar_inter_token_latency_seconds", "gap between outputs of one stream, per token"),
    "first_audio": ("mstar_time_to_first_audio_seconds", "request arrival -> first audio chunk sent"),
}


def bound_label(bound: float) -> str:
    """A bucket's `le` label as Prometheus clients write it: 0.0025, 1.0, +Inf."""
    return "+Inf" if math.isinf(bound) else repr(float(bound))


class BucketCounters:
    """A latency histogram as counters: `<name>_bucket{le=...}` (cumulative), `<name>_sum` and `<name>_count`,
    the series a Prometheus histogram exposes (so `histogram_quantile` and the benchmark read them as one),
    incremented once a sampling period with what its samples added: at most len(buckets) + 3 IPC calls a period
    however many tokens were sent, where a `pb_utils` histogram took one per sample."""

    def __init__(self, metric, name: str, help_text: str, labels: dict[str, str], buckets: list[float]) -> None:
        self.bounds = [*sorted(buckets), math.inf]
        counter = pb_utils.MetricFamily.COUNTER
        self.buckets = [metric(f"{name}_bucket", help_text, counter, {**labels, "le": bound_label(b)})
                        for b in self.bounds]
        self.sum = metric(f"{name}_sum", f"{help_text} (seconds, summed)", counter, labels)
        self.count = metric(f"{name}_count", f"{help_text} (samples)", counter, labels)

    def add(self, samples: list[tuple[float, int]]) -> None:
        """Record (seconds, how many samples of that value) pairs."""
        counts = [0] * len(self.bounds)
        for value, count in samples:
            counts[bisect.bisect_left(self.bounds, value)] += count  # the first bucket whose bound >= value
        total = sum(counts)
        if total == 0:
            return
        # Top down: +Inf and the count first, then each lower bucket, then the sum. A scrape can land between any
        # two of these calls, and added in this order a lower bucket never shows more than a higher one (bottom up,
        # one sample's first calls showed le=0.001 above le=0.0025, which the histogram's rules forbid).
        self.buckets[-1].increment(float(total))
        self.count.increment(float(total))
        above = total
        for bucket, count in zip(self.buckets[-2::-1], counts[:0:-1], strict=True):
            above -= count  # the samples in this bucket or below it
            if above:
                bucket.increment(float(above))
        self.sum.increment(float(sum(value * count for value, count in samples)))


class ComponentMetrics:
    def __init__(self, engine, latency, labels: dict[str, str]):
        self._engine, self._latency = engine, latency
        self._stop = threading.Event()
        self._families = {}  # name -> MetricFamily (a family must outlive its Metrics)
        self._metrics = []  # every Metric, dropped before the families at stop
        self._gauges = {k: self._metric(n, h, pb_utils.MetricFamily.GAUGE, labels) for k, (n, h) in GAUGES.items()}
        self._counters = {k: self._metric(n, h, pb_utils.MetricFamily.COUNTER, labels)
                          for k, (n, h) in COUNTERS.items()}
        self._histograms = {k: BucketCounters(self._metric, n, h, labels, LATENCY_BUCKETS)
                            for k, (n, h) in HISTOGRAMS.items() if hasattr(latency, k)}
        self._steps_per_s = self._metric("mstar_engine_steps_per_second", "engine steps per second, last second",
                                         pb_utils.MetricFamily.GAUGE, labels)
        self._samples = self._metric(SAMPLES_SERIES, SAMPLES_HELP, pb_utils.MetricFamily.COUNTER, labels)
        self._totals = dict.fromkeys(COUNTERS, 0)
        self._step_window: deque[tuple[float, int]] = deque()
        self._thread = threading.Thread(target=self._run, name="component-metrics", daemon=True)

    def _metric(self, name: str, help_text: str, kind, labels: dict[str, str]):
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = pb_utils.MetricFamily(name=name, description=help_text, kind=kind)
        metric = family.Metric(labels=labels)
        self._metrics.append(metric)
        return metric

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling and drop the metrics while the stub can still unregister them: each Metric, then its
        family (left to interpreter teardown, their destructors ran after the stub's IPC was gone and
        segfaulted every stub on server shutdown)."""
        self._stop.set()
        if self._thread.ident is not None:  # (started)
            self._thread.join(2)
        if self._thread.is_alive():
            return  # a sample still running holds them; leave them to the interpreter rather than race it
        self._gauges.clear()
        self._counters.clear()
        self._histograms.clear()
        self._steps_per_s = self._samples = None
        self._metrics.clear()
        self._families.clear()

    def _run(self) -> None:
        server = os.getppid()
        while not self._stop.wait(PERIOD_S):
            if os.getppid() != server:  # the server is gone: a metric call would wait for it forever, GIL held
                logger.error("metrics: the server process %d is gone; sampling stops", server)
                return
            try:
                self.sample()
            except Exception:  # metrics must never take the component down
                logger.exception("metrics sample failed")

    def sample(self) -> None:
        stats = self._engine.stats()
        for key, gauge in self._gauges.items():
            gauge.set(float(stats.get(key, 0)))
        for key, counter in self._counters.items():
            total = int(stats.get(key, 0))
            if total > self._totals[key]:
                counter.increment(float(total - self._totals[key]))
                self._totals[key] = total
        for key, histogram in self._histograms.items():
            histogram.add(self._latency.take(key))
        self._sample_step_rate(int(stats.get("num_steps", 0)))
        self._samples.increment(1.0)  # last: a reader that sees it 2 past its first read has all recorded before

    def _sample_step_rate(self, num_steps: int) -> None:
        now = time.monotonic()
        self._step_window.append((now, num_steps))
        while now - self._step_window[0][0] > 1.0:
            self._step_window.popleft()
        t0, s0 = self._step_window[0]
        self._steps_per_s.set((num_steps - s0) / (now - t0) if now > t0 else 0.0)
