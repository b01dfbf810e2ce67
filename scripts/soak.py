"""Soak: closed-loop load at concurrency C for a fixed time, sampling memory and KV pages; both must stay flat.

Starts the deployment itself (tritonserver under the supervisor + the proxy, free 127.0.0.1 ports), or targets
a running one with --proxy/--metrics/--server-pid. Each of C clients sends its next request when the last one
ends: chat and completions, streamed or not, random max_tokens, and one request in ten is abandoned
mid-stream. Every --sample-s it records the RSS of tritonserver, its stubs, their engine processes
(MSTAR_ENGINE_PROCESS=1) and the proxy, the KV pages in use, the running/waiting requests and the request counts,
to CSV (and a PNG plot with matplotlib).

    python scripts/soak.py --duration-s 1800 -c 32 --out runs/soak        # the 30-minute run
    python scripts/soak.py --duration-s 360 -c 32 --out runs/soak-short   # what fits a dev session

The summary line fits a straight line to the second half of each memory series: flat means the fitted growth
over the run is below 5 % of the level (and page counts return to 0 once the load stops).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from cancel_fuzz import read_metrics  # noqa: E402

from mstar_common.bench.drivers import is_local  # noqa: E402

GAUGES = ("mstar_kv_pages_used", "mstar_kv_pages_reserved", "mstar_state_slots_used", "mstar_requests_running",
          "mstar_requests_waiting")


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def start_deployment(deployment: str, run_dir: Path):
    """The default (tiny, CPU) deployment on free ports; returns (supervisor, proxy process, urls)."""
    from mstar_common.cli import resolve_target
    from mstar_common.config import load_deployment
    from mstar_common.launcher import Ports, start_proxy, wait_ready
    from mstar_common.repository import entry_model, generate_repository
    from mstar_common.supervisor import TritonSupervisor

    path = resolve_target(deployment)
    dep = load_deployment(path)
    repo = run_dir / "model_repository"
    generate_repository(path, repo)
    ports = Ports.free()
    supervisor = TritonSupervisor(repo, dep, ports, run_dir / "tritonserver.log")
    supervisor.start()
    supervisor.watch()
    proxy = start_proxy(dep, entry_model(dep), ports, run_dir / "proxy.log")
    wait_ready(ports.proxy_health_url, proxy, 120, "proxy")
    return supervisor, proxy, dep.name, ports.proxy_url, ports.metrics_url


async def client_loop(client: httpx.AsyncClient, proxy: str, model: str, rng: random.Random, stop_at: float,
                      counts: Counter) -> None:
    while time.monotonic() < stop_at:
        is_chat, is_stream = rng.random() < 0.5, rng.random() < 0.5
        body = {"model": model, "max_tokens": rng.randint(8, 64), "temperature": rng.choice((0.0, 0.8)),
                "stream": is_stream}
        if is_chat:
            route, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": f"soak {rng.random()}"}]
        else:
            route, body["prompt"] = "/v1/completions", f"soak {rng.random()}"
        try:
            if is_stream:
                async with client.stream("POST", proxy + route, json=body) as r:
                    abandon = rng.random() < 0.1
                    async for line in r.aiter_lines():
                        if abandon and line.startswith("data: "):
                            counts["abandoned"] += 1
                            break
                    counts[f"status_{r.status_code}"] += 1
            else:
                r = await client.post(proxy + route, json=body)
                counts[f"status_{r.status_code}"] += 1
        except httpx.HTTPError as error:
            counts[f"client_error_{type(error).__name__}"] += 1
            await asyncio.sleep(0.1)


MEMORY_SERIES = ("rss_tritonserver_mib", "rss_stubs_mib", "rss_engines_mib", "rss_proxy_mib")


def server_pids(server_pid: int | None, proxy_pid: int | None) -> dict[str, list[int]]:
    from mstar_common.supervisor import child_pids, find_stubs

    pids = {"tritonserver": [server_pid] if server_pid else [], "proxy": [proxy_pid] if proxy_pid else []}
    pids["stubs"] = sorted(find_stubs(server_pid)) if server_pid else []
    pids["engines"] = child_pids(set(pids["stubs"])) if pids["stubs"] else []  # MSTAR_ENGINE_PROCESS=1
    return pids


async def sample_loop(metrics: str, pid_source, stop_at: float, sample_s: float, counts: Counter,
                      writer: csv.DictWriter, rows: list[dict]) -> None:
    start = time.monotonic()
    while True:
        pids = pid_source()
        row = {"t_s": round(time.monotonic() - start, 1)}
        for role, role_pids in pids.items():
            row[f"rss_{role}_mib"] = round(sum(rss_mib(p) for p in role_pids), 1)
        try:
            row.update(read_metrics(metrics, GAUGES))
        except OSError:
            pass  # the server is being relaunched
        row["requests_ok"] = counts["status_200"]
        row["requests_other"] = sum(v for k, v in counts.items() if k != "status_200" and k != "abandoned")
        rows.append(row)
        writer.writerow(row)
        if time.monotonic() >= stop_at:
            return
        await asyncio.sleep(sample_s)


def growth(rows: list[dict], key: str) -> tuple[float, float]:
    """(level, fitted growth over the run) of the second half of a series, by least squares."""
    half = [r for r in rows[len(rows) // 2:] if key in r]
    if len(half) < 2:
        return 0.0, 0.0
    xs, ys = [r["t_s"] for r in half], [r[key] for r in half]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs) or 1.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return my, slope * (rows[-1]["t_s"] - rows[0]["t_s"])


def plot(rows: list[dict], out: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    t = [r["t_s"] / 60 for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for key in [k for k in rows[0] if k.startswith("rss_") and any(r.get(k) for r in rows)]:
        ax1.plot(t, [r.get(key, 0) for r in rows], label=key.removeprefix("rss_").removesuffix("_mib"))
    ax1.set_ylabel("RSS (MiB)")
    ax1.legend(loc="upper left")
    ax1.set_title(title)
    for key in ("mstar_kv_pages_used", "mstar_kv_pages_reserved", "mstar_requests_running", "mstar_requests_waiting"):
        ax2.plot(t, [r.get(key, 0) for r in rows], label=key.removeprefix("mstar_"))
    ax2.set_ylabel("count")
    ax2.set_xlabel("minutes")
    ax2.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


async def soak(args, proxy: str, model: str, metrics: str, pid_source, out_dir: Path) -> dict:
    counts: Counter = Counter()
    rows: list[dict] = []
    stop_at = time.monotonic() + args.duration_s
    rng = random.Random(args.seed)
    csv_path = out_dir / "soak.csv"
    fields = ["t_s", *MEMORY_SERIES, *GAUGES, "requests_ok", "requests_other"]
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        limits = httpx.Limits(max_connections=args.concurrency + 4)
        async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=not is_local(proxy)) as client:
            clients = [client_loop(client, proxy, model, random.Random(rng.random()), stop_at, counts)
                       for _ in range(args.concurrency)]
            await asyncio.gather(sample_loop(metrics, pid_source, stop_at, args.sample_s, counts, writer, rows),
                                 *clients)
    await asyncio.sleep(1.0)  # let the last cancellations land, then read what is held with no load
    idle = read_metrics(metrics, GAUGES)
    summary = {"duration_s": args.duration_s, "concurrency": args.concurrency, "counts": dict(counts),
               "idle_after": idle, "samples": len(rows), "csv": str(csv_path)}
    for key in MEMORY_SERIES:
        if key == "rss_engines_mib" and not any(r.get(key) for r in rows):
            continue  # no engine process (the engines run in their stubs)
        level, grew = growth(rows, key)
        summary[key] = {"level": round(level, 1), "fitted_growth_second_half": round(grew, 1),
                        "flat": abs(grew) < 0.05 * max(level, 1.0)}
    plot(rows, out_dir / "soak.png", f"soak: c={args.concurrency}, {args.duration_s / 60:.0f} min, tiny Qwen3 on CPU")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=1800)
    parser.add_argument("-c", "--concurrency", type=int, default=32)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--deployment", default="qwen3", help="deployment to start (ignored with --proxy)")
    parser.add_argument("--proxy", help="target a running proxy instead of starting one")
    parser.add_argument("--metrics", help="its Triton metrics URL (with --proxy)")
    parser.add_argument("--model", help="the served model name (with --proxy)")
    parser.add_argument("--server-pid", type=int, help="tritonserver pid for RSS sampling (with --proxy)")
    parser.add_argument("--out", default="runs/soak")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    supervisor = proxy_proc = None
    try:
        if args.proxy:
            proxy, metrics, model = args.proxy, args.metrics, args.model
            pid_source = lambda: server_pids(args.server_pid, None)  # noqa: E731
        else:
            run_dir = Path(tempfile.mkdtemp(prefix="mstar-soak-"))
            supervisor, proxy_proc, model, proxy, metrics = start_deployment(args.deployment, run_dir)
            pid_source = lambda: server_pids(supervisor.proc.pid, proxy_proc.pid)  # noqa: E731
            print(f"[soak] deployment up (logs in {run_dir})", flush=True)
        summary = asyncio.run(soak(args, proxy, model, metrics, pid_source, out_dir))
        if supervisor is not None:
            summary["server_restarts"] = supervisor.num_restarts
    finally:
        if proxy_proc is not None:
            from mstar_common.launcher import stop_process

            stop_process(proxy_proc)
        if supervisor is not None:
            supervisor.stop(drain_s=5)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    is_flat = all(summary[k]["flat"] for k in MEMORY_SERIES if k in summary)
    return 0 if is_flat and not any(summary["idle_after"].values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
