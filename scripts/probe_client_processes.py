"""The Triton levels' client in one process or several, alternated on one server: is the client's own queueing
in the figures? A level at concurrency C (AB_C, default 64) of N requests (AB_N, 128) runs from 1 client process
(C stream threads) and then from P (AB_P, 4), REPS times (AB_REPS, 3), after an 8-request warm-up; each prints
client tok/s, TTFT and ITL percentiles, tokens per response and the serving component's own TTFT and ITL means
(Triton's metrics). The levels land in $OUT/ab_client_procs.json (OUT, default /tmp). It takes `bench.py serve`'s
options (the server is the one those options describe); its --concurrency levels are not run.

    AB_C=64 AB_P=4 python scripts/probe_client_processes.py serve --checkpoint DIR --prompt-len 512 \
        --output-len 256 --no-capture-sampling --decode-buckets 1 2 4 8 16 32 64 --token-buckets 512 1024 2048
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mstar_common.bench import cli  # noqa: E402
from mstar_common.bench.drivers import TritonDriver  # noqa: E402
from mstar_common.bench.metrics import summarize  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
C, N, P = (int(os.environ.get(k, d)) for k, d in (("AB_C", 64), ("AB_N", 128), ("AB_P", 4)))


def ab_sweep(args, grpc_url, entry, proxy_url, checkpoint, metrics=None, on_run=None):
    workload = cli.workload_from_args(args)
    server = cli.ServerLatency(metrics)
    TritonDriver(grpc_url, entry).run(workload.requests(8, first=0), concurrency=8)  # warm-up
    issued, runs = 8, []
    for rep in range(int(os.environ.get("AB_REPS", 3))):
        for procs in (1, P):
            server.start()
            records = TritonDriver(grpc_url, entry, processes=procs).run(
                workload.requests(N, first=issued), concurrency=C)
            issued += N
            s = summarize(records)
            lat = server.stop(sum(r.ttft is not None for r in records))
            run = {"target": "triton", "concurrency": C, "client_processes": procs, "rep": rep, "summary": s,
                   "server": lat}
            runs.append(run)
            itl, ttft = s["itl_ms"], s["ttft_ms"]
            print(f"[ab] rep {rep} procs {procs}: {s['output_tok_per_s']:,.0f} tok/s, TTFT p50/p90/p99 "
                  f"{ttft['p50']:.1f}/{ttft['p90']:.1f}/{ttft['p99']:.1f} ms, ITL p50/p90/p99 {itl['p50']:.3f}/"
                  f"{itl['p90']:.3f}/{itl['p99']:.3f} ms, tok/resp {s['tokens_per_response']:.2f}, errors "
                  f"{s['num_errors']}" + (f"; server TTFT mean {lat['ttft_ms_mean']:.2f} ms, ITL mean "
                                          f"{lat['itl_ms_mean']:.3f} ms (client {itl['mean']:.3f})" if lat else ""),
                  flush=True)
    with open(f"{OUT}/ab_client_procs.json", "w") as f:
        json.dump(runs, f, indent=1)
    return runs


if __name__ == "__main__":
    cli.sweep = ab_sweep
    sys.exit(cli.main(sys.argv[1:]))
