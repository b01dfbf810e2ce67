import importlib
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
LOOPBACK = "127.0.0.1,localhost,::1"


def exempt_loopback(environ) -> None:
    """Every server a test talks to is on this host, and httpx, urllib, requests and gRPC send even a loopback
    request through the environment's http_proxy: on a host with one set, the tests' own clients (tritonclient,
    httpx, the openai package) would fail. Their servers and scripts inherit the exemption."""
    exempt = [*dict.fromkeys(v for key in ("no_proxy", "NO_PROXY") if (v := environ.get(key, "").strip()))]
    # urllib honours a `*` only as the whole value, and reads the lower-case spelling first: both get one value
    environ["no_proxy"] = environ["NO_PROXY"] = "*" if "*" in exempt else ",".join([*exempt, LOOPBACK])
    # gRPC reads no_grpc_proxy before no_proxy, and knows no `*`
    environ["no_grpc_proxy"] = ",".join(
        filter(None, (environ.get("no_grpc_proxy", "").strip(), *(e for e in exempt if e != "*"), LOOPBACK)))


exempt_loopback(os.environ)


# The test extras (pyproject's [test]) behind `pytest.importorskip` guards: they skip a module on the GPU device,
# whose Python lacks some of them, but scripts/test.sh installs them all, so there a missing or broken one fails the
# run (PYTEST_REQUIRE_EXTRAS, which it sets) instead of turning whole parity modules into skips on a green CI.
TEST_EXTRAS = ("diffusers", "peft", "snac", "schemathesis", "matplotlib", "isal", "openai", "transformers", "triton",
               "av")


def pytest_configure(config):
    if not os.environ.get("PYTEST_REQUIRE_EXTRAS"):
        return
    missing = []
    for name in TEST_EXTRAS:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a broken install raises more than ImportError
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
    if missing:
        raise pytest.UsageError(f"test extras that do not import (run scripts/setup.sh): {'; '.join(missing)}")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
