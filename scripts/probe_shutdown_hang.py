"""Does a server stop at once after a given kind of traffic? The probe behind docs/reliability.md's table on the
shutdown that never reached `finalize` (2026-12-05).

Each of `--servers` servers (the default deployment, 4 running + 4 queued places) gets `-n` streams of one kind,
`-c` at a time, then 2 s idle and SIGTERM; it counts as hung when the model was never unloaded (its `finalize` never
ran) and the stop took the whole grace.

Kinds, each through scripts/cancel_fuzz.py's clients: `finish` (gRPC streams read to their final), `cancel` (gRPC
streams cancelled after 0-8 responses), `proxy_cancel` (streaming completions whose client leaves after 0-8 events
or 0-0.2 s), `refuse` (`finish` at `-c 16`: most of them refused), `mix` (cancel_fuzz.py's mix of all of these).

    python scripts/probe_shutdown_hang.py refuse -c 16 --servers 5 [--engine-process]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import yaml

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from cancel_fuzz import FuzzResult, _via_grpc, _via_proxy, fuzz  # noqa: E402

from mstar_common.cli import DEFAULT_DEPLOYMENT  # noqa: E402
from mstar_common.config import deployment_from_dict  # noqa: E402
from mstar_common.launcher import Ports, start_proxy, start_triton, stop_process, wait_ready  # noqa: E402
from mstar_common.proxy.triton_stream import TritonStreamClient  # noqa: E402
from mstar_common.repository import entry_model, write_repository  # noqa: E402

GRACE_S = 12.0  # a stop that takes this long is a hang (the server's exit timeout is longer)


async def _drive(kind: str, ports: Ports, model: str, entry: str, n: int, concurrency: int, seed: int) -> Counter:
    """One kind of stream through cancel_fuzz.py's clients; the outcomes, and any errors under `error: ...`."""
    if kind == "mix":
        result = await fuzz(ports.proxy_url, ports.grpc_url, ports.metrics_url, model, entry, n, concurrency, seed)
        return Counter(result.outcomes) + Counter(f"error: {e}" for e in result.errors)
    result = FuzzResult(num_streams=n, elapsed_s=0.0)
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    triton = TritonStreamClient(ports.grpc_url)
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:  # its own server, on this host
        async def one(index: int) -> None:
            async with gate:
                own = random.Random(rng.random())
                if kind == "proxy_cancel":
                    await _via_proxy(client, ports.proxy_url, model, own, result)
                else:
                    await _via_grpc(triton, entry, own, result, index, cancel=kind == "cancel")

        await asyncio.gather(*(one(i) for i in range(n)))
    await triton.close()
    return result.outcomes + Counter(f"error: {e}" for e in result.errors)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["finish", "cancel", "proxy_cancel", "refuse", "mix"])
    parser.add_argument("-n", type=int, default=60, help="streams a server")
    parser.add_argument("-c", "--concurrency", type=int, default=4)
    parser.add_argument("--servers", type=int, default=5)
    parser.add_argument("--engine-process", action="store_true", help="MSTAR_ENGINE_PROCESS=1 for the servers")
    args = parser.parse_args()
    if args.engine_process:
        os.environ["MSTAR_ENGINE_PROCESS"] = "1"
    raw = yaml.safe_load(DEFAULT_DEPLOYMENT.read_text())
    raw.update(max_concurrent_requests=4, admission={"max_queue": 4})
    dep = deployment_from_dict(raw, source="probe-shutdown-hang")
    work = Path(tempfile.mkdtemp(prefix="mstar-shutdown-probe-"))
    os.environ.setdefault("MSTAR_CACHE_DIR", str(work / "cache"))
    hung = 0
    for server in range(args.servers):
        root = work / f"server{server}"
        repo = write_repository(dep, root / "model_repository", dep.name)
        ports = Ports.free()
        triton = start_triton(repo, dep, ports, root / "tritonserver.log")
        proxy = None
        try:
            wait_ready(ports.triton_ready_url, triton, 300, "tritonserver")
            entry = entry_model(dep)
            proxy = start_proxy(dep, entry, ports, root / "proxy.log")
            wait_ready(ports.proxy_health_url, proxy, 60, "proxy")
            outcomes = asyncio.run(_drive(args.kind, ports, dep.name, entry, args.n, args.concurrency, server))
            time.sleep(2)
        finally:
            stop_process(proxy)
            stopping = time.monotonic()
            stop_process(triton, grace=GRACE_S)
        took = time.monotonic() - stopping
        is_hung = "successfully unloaded" not in (root / "tritonserver.log").read_text(errors="replace")
        hung += is_hung
        print(f"server {server}: {dict(outcomes)}; stop {took:.1f} s{'; HUNG (finalize never ran)' if is_hung else ''}",
              flush=True)
    print(f"{args.kind}: {hung} of {args.servers} servers hung at shutdown (logs under {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
