"""scripts/bench.py's serve arguments reach the deployment it starts (CPU: no server is started)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mstar_common.config import deployment_from_dict

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_script", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _serve_args(bench, monkeypatch, *extra):
    seen = []
    monkeypatch.setattr(bench, "cmd_serve", lambda args: seen.append(args) or 0)
    assert bench.main(["serve", "--checkpoint", "/tmp/ckpt", "--out", "/tmp/out.json", *extra]) == 0
    return seen[0]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_kv_dtype_reaches_the_deployment(bench, monkeypatch, kv_dtype):
    args = _serve_args(bench, monkeypatch, "--kv-dtype", kv_dtype)
    dep = deployment_from_dict(bench.deployment(args), source="test")
    assert dep.resources.kv_cache.dtype == kv_dtype


def test_kv_dtype_default_is_the_models_and_bad_values_are_refused(bench, monkeypatch, capsys):
    assert _serve_args(bench, monkeypatch).kv_dtype == "auto"
    with pytest.raises(SystemExit):
        _serve_args(bench, monkeypatch, "--kv-dtype", "fp4")
    assert "--kv-dtype" in capsys.readouterr().err


def test_the_benchmark_serves_without_the_prefix_cache_unless_asked(bench, monkeypatch):
    """Its levels reuse the workload's prompts, so a prefix cache would skip their prefills and flatter TTFT."""
    for extra, expected in (((), False), (("--prefix-caching",), True)):
        dep = deployment_from_dict(bench.deployment(_serve_args(bench, monkeypatch, *extra)), source="test")
        assert dep.resources.kv_cache.prefix_caching is expected
