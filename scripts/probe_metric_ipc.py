#!/usr/bin/env python
"""What a `pb_utils` metric call costs a Python-backend stub's response sends.

    python scripts/probe_metric_ipc.py [--streams 64] [--rounds 100] [--repeats 3]

One throwaway decoupled model in a temporary repository, served by a real tritonserver with metrics on. The client
opens `--streams` gRPC streams; once the model holds them all, one thread sends `--rounds` small responses to each
(the output pump's pattern), alone and then with a second thread calling `observe` on a histogram as fast as it
can (what the metrics thread did with one ITL sample a token before backends/metrics.py kept its histograms as
bucket counters). Prints the sender's responses a second and the observer's calls a second, best of `--repeats`.
"""

from __future__ import annotations

import argparse
import queue
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mstar_common.launcher import bare_triton  # noqa: E402

CONFIG = '''name: "sender"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "PLAN", data_type: TYPE_INT32, dims: [ 3 ] } ]
output [
  { name: "IDS", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "STATS", data_type: TYPE_FP64, dims: [ 2 ] }
]
instance_group [ { kind: KIND_CPU, count: 1 } ]
'''

MODEL = '''import threading, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.family = pb_utils.MetricFamily(name="probe_seconds", description="probe",
                                            kind=pb_utils.MetricFamily.HISTOGRAM)
        self.histogram = self.family.Metric(labels={"probe": "1"}, buckets=[0.001, 0.01, 0.1, 1.0])
        self.held, self.lock = [], threading.Lock()

    def execute(self, requests):
        for request in requests:
            streams, rounds, observe = (int(v) for v in pb_utils.get_input_tensor_by_name(request, "PLAN").as_numpy())
            with self.lock:
                self.held.append(request.get_response_sender())
                if len(self.held) == streams:
                    senders, self.held = self.held, []
                    threading.Thread(target=self.send, args=(senders, rounds, observe), daemon=True).start()
        return None

    def send(self, senders, rounds, observe):
        stop, observed = threading.Event(), [0]

        def observer():
            while not stop.is_set():
                self.histogram.observe(0.002)
                observed[0] += 1

        thread = threading.Thread(target=observer)
        if observe:
            thread.start()
        start = time.perf_counter()
        for i in range(rounds):
            for sender in senders:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("IDS", np.array([i], np.int32))]))
        elapsed = time.perf_counter() - start
        stop.set()
        if observe:
            thread.join()
        stats = np.array([len(senders) * rounds / elapsed, observed[0] / elapsed])
        for sender in senders:
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("STATS", stats)]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''


def measure(url: str, streams: int, rounds: int, observe: bool) -> tuple[float, float]:
    import tritonclient.grpc as grpcclient

    clients, finals = [], queue.Queue()

    def callback(result, error):
        if error is not None:
            finals.put(error)
        elif (stats := result.as_numpy("STATS")) is not None:
            finals.put(stats)

    try:
        for _ in range(streams):
            client = grpcclient.InferenceServerClient(url)
            client.start_stream(callback=callback)
            clients.append(client)
        for client in clients:
            plan = grpcclient.InferInput("PLAN", [3], "INT32")
            plan.set_data_from_numpy(np.array([streams, rounds, int(observe)], np.int32))
            client.async_stream_infer("sender", [plan])
        got = [finals.get(timeout=300) for _ in range(streams)]
    finally:
        for client in clients:
            client.stop_stream()
            client.close()
    if not isinstance(got[0], np.ndarray):
        raise RuntimeError(str(got[0]))
    return float(got[0][0]), float(got[0][1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="probe-metric-") as tmp:
        repo = Path(tmp) / "repo"
        (repo / "sender" / "1").mkdir(parents=True)
        (repo / "sender" / "config.pbtxt").write_text(CONFIG)
        (repo / "sender" / "1" / "model.py").write_text(MODEL)
        with bare_triton(repo, Path(tmp) / "tritonserver.log", ("--allow-metrics=true",)) as url:
            measure(url, args.streams, 4, False)  # warm-up
            for observe in (False, True, False, True):
                runs = [measure(url, args.streams, args.rounds, observe) for _ in range(args.repeats)]
                best = max(runs)
                print(f"{'with' if observe else 'without'} an observing thread: {best[0]:,.0f} responses/s "
                      f"(runs {', '.join(f'{r[0]:,.0f}' for r in runs)}); {best[1]:,.0f} observe calls/s",
                      flush=True)
                time.sleep(0.2)


if __name__ == "__main__":
    main()
