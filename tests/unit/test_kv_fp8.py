"""`resources.kv_cache.dtype: fp8_e4m3`: the deployment knob reaches the engine's pool, the torch backend
writes and reads it, and a refused value names the field."""

import dataclasses
from pathlib import Path

import pytest
import torch

from mstar_common.config import DeploymentError, load_deployment, validate_deployment
from mstar_common.engine.attention import TorchPagedAttention, write_slots
from mstar_common.engine.types import SamplingParams
from mstar_common.families.qwen3.family import Qwen3Family
from mstar_common.families.qwen3.tiny import build_tiny_checkpoint

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _with_kv_dtype(dep, dtype):
    kv = dataclasses.replace(dep.resources.kv_cache, dtype=dtype)
    return dataclasses.replace(dep, resources=dataclasses.replace(dep.resources, kv_cache=kv))


def _greedy(engine, prompt, n):
    out = []
    engine.add_request("r", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                       lambda rid, tokens, finish, error: out.extend(tokens))
    while engine.step() or engine.scheduler.num_running:
        pass
    return out


def test_fp8_pool_from_the_deployment_serves_greedy_tokens(tmp_path):
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny")
    dep = load_deployment(CONFIGS / "qwen3.yaml")
    runtimes = {dtype: Qwen3Family().build_component("llm", _with_kv_dtype(dep, dtype), checkpoint, "cpu")
                for dtype in ("auto", "fp8_e4m3")}
    pools = {dtype: rt.engine.kv_cache.k_caches[0] for dtype, rt in runtimes.items()}
    assert pools["fp8_e4m3"].dtype == torch.float8_e4m3fn and pools["fp8_e4m3"].element_size() == 1
    assert pools["auto"].dtype == torch.float32
    prompt = list(range(5, 25))
    tokens = {dtype: _greedy(rt.engine, prompt, 12) for dtype, rt in runtimes.items()}
    assert len(tokens["fp8_e4m3"]) == 12
    assert _greedy(runtimes["fp8_e4m3"].engine, prompt, 12) == tokens["fp8_e4m3"]  # deterministic
    assert pools["fp8_e4m3"].float().abs().sum() > 0  # the prompt's keys went into the fp8 pool
    assert tokens["fp8_e4m3"][0] == tokens["auto"][0], "one rounding of K/V must not change the first argmax here"


def test_torch_backend_reads_the_fp8_pool_back_exactly():
    """Write through `write_slots`, attend: equals SDPA over the e4m3-rounded keys and values."""
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(9, 2, 16, generator=gen), torch.randn(9, 2, 16, generator=gen)
    caches = [torch.zeros(2, 8, 2, 16, dtype=torch.float8_e4m3fn) for _ in range(2)]
    slots = torch.arange(9)
    write_slots(caches[0], slots, key)
    write_slots(caches[1], slots, value)
    k8, v8 = key.to(torch.float8_e4m3fn).float(), value.to(torch.float8_e4m3fn).float()
    assert torch.equal(caches[0].flatten(0, 1)[:9].float(), k8)
    gathered = TorchPagedAttention._gather_context(caches[0], caches[1], torch.tensor([0, 1]), 9)
    assert torch.equal(gathered[0].float(), k8) and torch.equal(gathered[1].float(), v8)


def test_a_bad_kv_dtype_is_refused_naming_the_field():
    dep = _with_kv_dtype(load_deployment(CONFIGS / "qwen3.yaml"), "fp4")
    with pytest.raises(DeploymentError, match=r"resources.kv_cache.dtype: must be one of \['auto', 'fp8_e4m3'\]"):
        validate_deployment(dep, "test")


def test_engine_config_refuses_an_unknown_kv_dtype():
    from mstar_common.engine.ar_engine import _check_config
    from mstar_common.engine.types import EngineConfig

    with pytest.raises(ValueError, match=r"EngineConfig.kv_dtype must be 'auto' or one of \['fp8_e4m3'\]"):
        _check_config(EngineConfig(kv_dtype="fp16"))


def test_an_unknown_decode_form_is_refused_naming_the_variable():
    import os
    import subprocess
    import sys

    env = {**os.environ, "MSTAR_DECODE_FORM": "sideways"}
    proc = subprocess.run([sys.executable, "-c", "import mstar_common.engine.attention"], env=env,
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode != 0
    assert "MSTAR_DECODE_FORM must be one of ['auto', 'heads', 'tokens', 'tokens_fp16', 'tokens_qk_fp8']" in proc.stderr


def test_decode_knobs_per_pool_kind():
    from mstar_common.engine.attention import _decode_knobs

    assert _decode_knobs(False) == {"tokens_major": False, "qk_fp8": False, "fp16_dots": False}
    assert _decode_knobs(True) == {"tokens_major": True, "qk_fp8": True, "fp16_dots": False}


def test_an_fp8_pool_on_a_gpu_without_e4m3_kernels_is_refused_at_load(tmp_path, monkeypatch):
    """docs/deployment.md: the fp8 pool's kernels need compute capability >= 8.9. On an A100 the first sign was a
    Triton compile error inside a capture or a request, naming no key."""
    from mstar_common.engine.ar_engine import AREngine
    from mstar_common.engine.types import EngineConfig
    from mstar_common.families.qwen3.loader import load_qwen3

    model, config = load_qwen3(build_tiny_checkpoint(tmp_path / "tiny"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    engine_config = EngineConfig(num_kv_pages=16, page_size=16, max_num_seqs=2, max_batch_tokens=64,
                                 max_model_len=128, dtype="float32", kv_dtype="fp8_e4m3", device="cuda")
    with pytest.raises(DeploymentError, match=r"resources.kv_cache.dtype: fp8_e4m3 needs a GPU of compute "
                                              r"capability >= 8.9 .*A100-SXM4-80GB is 8.0: use auto"):
        AREngine(model, engine_config, eos_token_ids=[], vocab_size=config["vocab_size"])
