#!/usr/bin/env python
"""How fast one Python-backend instance can send decoupled responses, by outputs per response and sender threads.

    python scripts/probe_send_rate.py [--streams 64] [--rounds 40] [--outputs 1 2 5] [--threads 1 2 4] [--observer]

One throwaway decoupled model `fan` in a temporary repository, served by a real tritonserver. The client opens
`--streams` gRPC streams with one request each; once the model holds them all, `THREADS` sender threads share the
streams and send `--rounds` responses to each (the output pump's pattern at c=streams: one response per stream
per cycle), each response carrying `OUTPUTS` small tensors (a text output and four int32 ones, as a text chunk
does), then a final response with the stub's own timing. Prints responses per second as the stub saw them, and
the mean time inside one `send` call. `--observer`: each setting again with a thread beside the senders that calls
`observe` on a metrics histogram as fast as it can (one IPC round trip to the server a call: what the component
metrics did with one ITL sample a token before backends/metrics.py kept its histograms as bucket counters), and
its calls a second.
"""

from __future__ import annotations

import argparse
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mstar_common.launcher import bare_triton  # noqa: E402

CONFIG = '''name: "fan"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "PLAN", data_type: TYPE_INT32, dims: [ 5 ] } ]
output [
  { name: "TEXT", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "IDS", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "A", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "B", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "C", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "STATS", data_type: TYPE_FP64, dims: [ 3 ] }
]
instance_group [ { kind: KIND_CPU, count: 1 } ]
'''

MODEL = '''import threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

NAMES = ("TEXT", "IDS", "A", "B", "C")


def outputs(count, i):
    values = (np.array([b" w%d" % i], dtype=np.object_), np.array([i], np.int32), np.array([i], np.int32),
              np.array([7], np.int32), np.array([0], np.int32))
    return [pb_utils.Tensor(name, value) for name, value in zip(NAMES[:count], values[:count])]


class TritonPythonModel:
    def initialize(self, args):
        self.held = []
        self.lock = threading.Lock()
        self.family = pb_utils.MetricFamily(name="probe_seconds", description="probe",
                                            kind=pb_utils.MetricFamily.HISTOGRAM)
        self.histogram = self.family.Metric(labels={"probe": "1"}, buckets=[0.001, 0.01, 0.1, 1.0])

    def execute(self, requests):
        for request in requests:
            plan = [int(v) for v in pb_utils.get_input_tensor_by_name(request, "PLAN").as_numpy()]
            with self.lock:
                self.held.append(request.get_response_sender())
                if len(self.held) == plan[0]:
                    senders, self.held = self.held, []
                    threading.Thread(target=self.fan, args=(senders, *plan[1:]), daemon=True).start()
        return None

    def fan(self, senders, rounds, count, threads, observe):
        in_send = [0.0] * threads
        stop, observed = threading.Event(), [0]

        def observer():
            while not stop.is_set():
                self.histogram.observe(0.002)
                observed[0] += 1

        def work(k):
            mine = senders[k::threads]
            for i in range(rounds):
                for sender in mine:
                    response = pb_utils.InferenceResponse(outputs(count, i))
                    t = time.perf_counter()
                    sender.send(response)
                    in_send[k] += time.perf_counter() - t

        watcher = threading.Thread(target=observer)
        if observe:
            watcher.start()
        start = time.perf_counter()
        workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - start
        stop.set()
        if observe:
            watcher.join()
        stats = np.array([len(senders) * rounds / elapsed, 1e3 * sum(in_send) / (len(senders) * rounds),
                          observed[0] / elapsed])
        for sender in senders:
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("STATS", stats)]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''


def measure(url: str, streams: int, rounds: int, count: int, threads: int,
            observe: bool = False) -> tuple[float, float, float]:
    import tritonclient.grpc as grpcclient

    from mstar_common.bench.drivers import triton_grpc_client

    clients, finals = [], queue.Queue()
    received = [0]
    lock = threading.Lock()

    def callback(result, error):
        if error is not None:
            finals.put(error)
            return
        stats = result.as_numpy("STATS")
        if stats is not None:
            finals.put(stats)
        else:
            with lock:
                received[0] += 1

    try:
        for _ in range(streams):
            client = triton_grpc_client(url)
            client.start_stream(callback=callback)
            clients.append(client)
        for client in clients:
            plan = grpcclient.InferInput("PLAN", [5], "INT32")
            plan.set_data_from_numpy(np.array([streams, rounds, count, threads, int(observe)], np.int32))
            client.async_stream_infer("fan", [plan])
        got = [finals.get(timeout=300) for _ in range(streams)]
    finally:
        for client in clients:
            client.stop_stream()
            client.close()
    for item in got:
        if not isinstance(item, np.ndarray):
            raise RuntimeError(str(item))
    if received[0] != streams * rounds:
        raise RuntimeError(f"received {received[0]} of {streams * rounds} responses")
    return float(got[0][0]), float(got[0][1]), float(got[0][2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--outputs", type=int, nargs="+", default=[1, 2, 5], help="tensors per response (1-5)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4], help="sender threads")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--observer", action="store_true", help="each setting also beside an observing thread")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="probe-send-") as tmp:
        repo = Path(tmp) / "repo"
        (repo / "fan" / "1").mkdir(parents=True)
        (repo / "fan" / "config.pbtxt").write_text(CONFIG)
        (repo / "fan" / "1" / "model.py").write_text(MODEL)
        with bare_triton(repo, Path(tmp) / "tritonserver.log", ("--allow-metrics=true",)) as url:
            measure(url, args.streams, 4, 5, 1)  # warm-up
            for count in args.outputs:
                for threads in args.threads:
                    for observe in (False, True) if args.observer else (False,):
                        runs = [measure(url, args.streams, args.rounds, count, threads, observe)
                                for _ in range(args.repeats)]
                        best = max(runs)
                        beside = f"; beside {best[2]:,.0f} observe calls/s" if observe else ""
                        print(f"outputs {count} threads {threads}: {best[0]:,.0f} responses/s (runs "
                              f"{', '.join(f'{r[0]:,.0f}' for r in runs)}); {best[1]:.3f} ms per send{beside}",
                              flush=True)
                        time.sleep(0.2)


if __name__ == "__main__":
    main()
