"""A real tritonserver (CPU instances) + the proxy on free 127.0.0.1 ports, torn down after the session."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from mstar_common.checkpoints import resolve_checkpoint
from mstar_common.cli import DEFAULT_DEPLOYMENT, check_shm_size
from mstar_common.config import Deployment, deployment_from_dict
from mstar_common.families.registry import get_family
from mstar_common.launcher import Ports, start_proxy, start_triton, stop_process, wait_ready
from mstar_common.repository import entry_model, write_repository


@dataclass
class Served:
    dep: Deployment
    ports: Ports
    checkpoint: Path
    entry: str
    log_dir: Path

    @property
    def grpc_url(self) -> str:
        return self.ports.grpc_url

    @property
    def proxy_url(self) -> str:
        return self.ports.proxy_url

    @property
    def metrics_url(self) -> str:
        return self.ports.metrics_url


def metrics_after_a_sample(url: str, timeout_s: float = 10) -> str:
    """Triton's metrics page once every component instance has finished a metrics sample begun after this call, so
    it holds everything recorded before it (the components export every 0.1 s, a period load stretches)."""
    import httpx

    from mstar_common.bench.cli import page_after_a_sample, sample_counts, sampled_since

    first = sample_counts(httpx.get(url, timeout=5).text)
    text = page_after_a_sample(lambda: httpx.get(url, timeout=5).text, timeout_s)
    assert first and sampled_since(first, sample_counts(text)), f"no component finished a metrics sample: {first}"
    return text


def print_logs(root: Path) -> None:
    print(server_logs(root))


def server_logs(root: Path, limit: int = 6000) -> str:
    return "".join(f"----- {log} -----\n{(root / log).read_text(errors='replace')[-limit:]}\n"
                   for log in ("tritonserver.log", "proxy.log") if (root / log).is_file())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used a served fixture shows that server's log tails in its report (a hang's stacks, a
    stub's last words), since the fixture prints them only when it fails to start."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for value in getattr(item, "funcargs", {}).values():
            if isinstance(value, Served) and value.log_dir.is_dir():
                report.sections.append((f"server logs ({value.dep.name})", server_logs(value.log_dir, 20000)))


@contextlib.contextmanager
def serve_deployment(dep: Deployment, root: Path, source: str, ready_timeout_s: float = 300) -> Iterator[Served]:
    """tritonserver + the proxy for `dep` on free 127.0.0.1 ports, stopped on exit. The stubs inherit
    MSTAR_CACHE_DIR, which is pointed at `root/cache` for the server's lifetime (builtin checkpoints).
    Every stub must also exit cleanly: a fatal signal in the server log at shutdown fails the test."""
    previous = os.environ.get("MSTAR_CACHE_DIR")
    os.environ["MSTAR_CACHE_DIR"] = str(root / "cache")
    triton = proxy = None
    clean = False
    try:
        checkpoint = resolve_checkpoint(dep.checkpoint, get_family(dep.family).builtin_checkpoints)
        check_shm_size(dep, source)  # as `mstar serve` does: a small /dev/shm fails a load with no key named
        repo = write_repository(dep, root / "model_repository", source)
        ports = Ports.free()
        triton = start_triton(repo, dep, ports, root / "tritonserver.log")
        wait_ready(ports.triton_ready_url, triton, ready_timeout_s, "tritonserver")
        entry = entry_model(dep)
        proxy = start_proxy(dep, entry, ports, root / "proxy.log")
        wait_ready(ports.proxy_health_url, proxy, 60, "proxy")
        yield Served(dep, ports, checkpoint, entry, root)
        clean = True
    except Exception:
        print_logs(root)
        raise
    finally:
        stop_process(proxy)
        stop_process(triton)
        if previous is None:
            os.environ.pop("MSTAR_CACHE_DIR", None)
        else:
            os.environ["MSTAR_CACHE_DIR"] = previous
    log = root / "tritonserver.log"
    crashes = log.read_text(errors="replace").count("Fatal Python error") if log.is_file() else 0
    assert not (clean and crashes), f"{crashes} stub(s) died of a fatal signal (see {log})"


@pytest.fixture(scope="session")
def served(tmp_path_factory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("served")
    raw = yaml.safe_load(DEFAULT_DEPLOYMENT.read_text())
    raw["max_concurrent_requests"] = 16
    with serve_deployment(deployment_from_dict(raw, source="test-deployment"), root, "test-deployment") as s:
        yield s
