"""The instance's GPU made each GPU thread's current CUDA device (mstar_common/devices.py), checked on the CPU with
torch.cuda's device calls recorded: CUDA keeps the current device per thread, and a new one starts on device 0."""

from __future__ import annotations

import threading

import pytest
import torch

from mstar_common import devices


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as on a host whose process has started CUDA, on device `current[0]`, per thread as CUDA keeps it."""
    local = threading.local()
    calls: list[tuple[str, int]] = []

    def set_device(device):
        index = torch.device(device).index
        calls.append((threading.current_thread().name, index))
        local.device = index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(local, "device", 0))
    return calls


def test_a_thread_target_runs_on_the_device_given_or_the_callers(fake_cuda):
    seen = {}

    def record(name):
        seen[name] = torch.cuda.current_device()

    devices.use_device("cuda:1")  # what node_setup.load_node does in the stub's thread
    for name, target in (("given", devices.on_device(lambda: record("given"), "cuda:2")),
                         ("caller's", devices.on_device(lambda: record("caller's"))),
                         ("bare", lambda: record("bare"))):
        thread = threading.Thread(target=target, name=name)
        thread.start()
        thread.join()
    assert seen == {"given": 2, "caller's": 1, "bare": 0}  # a bare thread is on device 0: what went wrong


def test_the_cpu_and_an_unstarted_cuda_leave_the_device_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(device))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    target = print
    devices.use_device("cpu")
    devices.use_device("cuda")  # no index: whatever is current
    assert devices.on_device(target) is target and devices.on_device(target, "cpu") is target
    assert calls == []


def test_the_gpu_threads_of_the_engines_start_on_their_device(fake_cuda, tmp_path):
    """The AR engine's step loop, the denoise loop and the batcher's (the diffusion components) each start on the
    device they were built for (the batcher: its builder's), not on device 0 where a new thread starts."""
    from mstar_common.diffusion.batcher import BatchingEngine
    from mstar_common.diffusion.denoise import DenoiseEngine
    from mstar_common.engine.ar_engine import AREngine
    from mstar_common.engine.types import EngineConfig
    from mstar_common.families.qwen3.loader import load_qwen3
    from mstar_common.families.qwen3.tiny import build_tiny_checkpoint

    devices.use_device("cuda:3")  # the component's builder, in the stub's thread
    batcher = BatchingEngine("vae", lambda payloads: payloads, max_rows=2)
    denoise = DenoiseEngine("dit", stepper=None, max_rows=1, device="cuda:1")
    model, config = load_qwen3(build_tiny_checkpoint(tmp_path / "qwen3"))
    engine = AREngine(model, EngineConfig(num_kv_pages=16, page_size=4, max_num_seqs=2, max_batch_tokens=16),
                      eos_token_ids=[], vocab_size=config["vocab_size"])
    engine.device = torch.device("cuda:2")  # as built on that GPU (the model itself stays on the CPU here)
    for started in (batcher, denoise, engine):
        started.start()
    for started in (batcher, denoise, engine):
        started.shutdown()
    assert {("vae-batcher", 3), ("dit-denoise", 1), ("ar-engine-step", 2)} <= set(fake_cuda), fake_cuda


def test_every_node_refuses_a_misspelt_switch_at_load(monkeypatch):
    """Only the AR engines checked the MSTAR_* switches at load: an image walk under a hand-started tritonserver
    loaded with MSTAR_PNG_ENCODER=bogus, then answered every PNG request with that error as the client's 400.
    load_node (every node's first step) now refuses the model, naming the switch."""
    import sys
    import types

    fake = types.ModuleType("triton_python_backend_utils")
    fake.TritonModelException = type("TritonModelException", (Exception,), {})
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    monkeypatch.delitem(sys.modules, "backends.node_setup", raising=False)
    import backends.node_setup as node_setup

    for name in ("configure_logging", "load_native_backtrace", "kill_when_orphaned"):
        monkeypatch.setattr(node_setup, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(node_setup.faulthandler, "enable", lambda *args, **kwargs: None)
    monkeypatch.setenv("MSTAR_PNG_ENCODER", "bogus")
    with pytest.raises(fake.TritonModelException, match=r"^z_image_walk: environment switches refused .*"
                                                        r"MSTAR_PNG_ENCODER='bogus'"):
        node_setup.load_node({"model_name": "z_image_walk"}, kind="walk")
    # a bad switch interval is named with the others, not alone (it was applied first, and its error hid them)
    monkeypatch.setenv("MSTAR_SWITCH_INTERVAL_MS", "0")
    with pytest.raises(fake.TritonModelException) as refused:
        node_setup.load_node({"model_name": "z_image_walk"}, kind="walk")
    message = str(refused.value)
    assert message.startswith("z_image_walk: environment switches refused")
    assert "MSTAR_SWITCH_INTERVAL_MS='0'" in message and "MSTAR_PNG_ENCODER='bogus'" in message
