"""The device probes run on the CPU with tiny checkpoints (so a GPU session never finds them broken)."""

import faulthandler
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
CONFIGS = SCRIPTS.parent / "configs"


@pytest.fixture(autouse=True)
def _no_watchdog_left():
    yield
    faulthandler.cancel_dump_traceback_later()  # the probes arm an exit-on-timeout watchdog


def _load(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_whisper_decoder_probe(capsys):
    probe = _load("probe_whisper_decoder")
    assert probe.main(["--config", str(CONFIGS / "whisper.yaml"), "--checkpoint", "builtin:whisper-tiny-random",
                       "--device", "cpu", "--tokens", "6", "--concurrency", "1,3"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("c=")]
    assert len(lines) == 2 and lines[1].startswith("c=  3")
    assert all("tokens=6" in line and "step p50=" in line for line in lines)


def test_orpheus_engine_probe_with_the_walk(capsys, monkeypatch):
    probe = _load("probe_orpheus_engine")
    monkeypatch.setattr(sys, "argv", ["probe", "--config", str(CONFIGS / "orpheus.yaml"), "--checkpoint",
                                      "builtin:orpheus-tiny", "--device", "cpu", "--concurrency", "2",
                                      "--tokens", "28", "--walk", "2", "--kv-dtype", "fp8_e4m3"])
    assert probe.main() == 0
    out = capsys.readouterr().out
    assert "reference c=   2" in out and "codec float32  batch= 128" in out
    assert "walk codec=float32  c=   2" in out and "errors=0" in out
