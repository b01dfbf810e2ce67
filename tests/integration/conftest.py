"""A real tritonserver (CPU instances) + the proxy on free 127.0.0.1 ports, torn down after the session."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from mstar_common.checkpoints import resolve_checkpoint
from mstar_common.cli import DEFAULT_DEPLOYMENT
from mstar_common.config import Deployment, deployment_from_dict
from mstar_common.families.registry import get_family
from mstar_common.launcher import Ports, start_proxy, start_triton, stop_process, wait_ready
from mstar_common.repository import entry_model, render_repository


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    dep: Deployment
    ports: Ports
    checkpoint: Path
    entry: str
    log_dir: Path

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.proxy}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.metrics}/metrics"


@pytest.fixture(scope="session")
def served(tmp_path_factory) -> Served:
    root = tmp_path_factory.mktemp("served")
    os.environ["MSTAR_CACHE_DIR"] = str(root / "cache")  # the stubs inherit it: one tiny checkpoint for all
    raw = yaml.safe_load(DEFAULT_DEPLOYMENT.read_text())
    raw["max_concurrent_requests"] = 16
    dep = deployment_from_dict(raw, source="test-deployment")
    checkpoint = resolve_checkpoint(dep.checkpoint, get_family(dep.family).builtin_checkpoints)
    repo = root / "model_repository"
    for rel, text in render_repository(dep, "test-deployment").items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    ports = Ports(http=free_port(), grpc=free_port(), metrics=free_port(), proxy=free_port())
    triton = proxy = None
    try:
        triton = start_triton(repo, dep, ports, root / "tritonserver.log")
        wait_ready(f"http://127.0.0.1:{ports.http}/v2/health/ready", triton, 240, "tritonserver")
        entry = entry_model(dep)
        proxy = start_proxy(dep, entry, ports, root / "proxy.log")
        wait_ready(f"http://127.0.0.1:{ports.proxy}/health", proxy, 60, "proxy")
        yield Served(dep, ports, checkpoint, entry, root)
    except Exception:
        for log in ("tritonserver.log", "proxy.log"):
            path = root / log
            if path.is_file():
                print(f"----- {log} -----\n{path.read_text()[-6000:]}")
        raise
    finally:
        stop_process(proxy)
        stop_process(triton)
