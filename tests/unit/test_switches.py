"""The engine reads every environment switch when it is built (mstar_common/switches.py), so a misspelt value
refuses the model at load with the switch and its rule named, instead of failing a request later."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from mstar_common.switches import BOOLEAN_SWITCHES, check_switches

ROOT = Path(__file__).resolve().parents[2]

# one value each parser refuses, with a piece of its message
REFUSED = {
    "MSTAR_PDL_MAX_ROWS": ("two", "expected a non-negative integer"),
    "MSTAR_PDL_TRIGGER": ("late", "expected one of early, fit, ahead"),
    "MSTAR_MID_GEMM_MAX_ROWS": ("-1", "expected a non-negative integer"),
    "MSTAR_MID_GEMM": ("qkv", "expected auto, 0, all or a list"),
    "MSTAR_MID_GEMM_FOLD": ("rope", "expected auto, or a list"),
    "MSTAR_GEMV_MAX_ROWS": ("9", "must be an integer in [0, 8]"),
    "MSTAR_GEMV_FORCE": ("1:8/0/8", "expected ROWS:BLOCK_N/BLOCK_K/WARPS/STAGES"),
    "MSTAR_FUSED_MLP_ROWS": ("16", "expected an integer in [0, 8]"),
    "MSTAR_FUSED_MLP_OPTIONS": ("warps=4", "is not KEY=positive integer"),
    "MSTAR_NORM_GEMV": ("yes", "expected one of auto, 1, 0"),
    "MSTAR_DECODE_STAGES": ("x", "expected a positive integer"),
    "MSTAR_DECODE_ROPE_IN_ATTENTION": ("always", "expected rule, 0 or 1"),
    "MSTAR_PREFILL_ATTENTION": ("fast", "expected one of plain, grouped, auto"),
    "MSTAR_SEARCH_PROGRAMS": ("many", "expected a non-negative integer"),
    "MSTAR_FLASHINFER_PREFILL": ("fa4", "must be auto, fa2 or fa3"),
    "MSTAR_STALL_EXIT_S": ("2", "expected 0 (off) or seconds in [5, 3600]"),
    "MSTAR_PUMP_SHARDS": ("0", "expected a whole number of pumps in [1, 16]"),
    "MSTAR_DIT_ATTENTION": ("bogus", "expected one of auto, cudnn, flash, efficient"),
    "MSTAR_SWITCH_INTERVAL_MS": ("1000", "must be between 0.05 and 100.0 milliseconds"),
    "MSTAR_PNG_ENCODER": ("PIL", "expected one of parallel, pil"),
    "MSTAR_STACK_DUMP_S": ("abc", "expected 0 (off) or seconds in [1, 86400]"),
    "MSTAR_GC_LOG_MS": ("fifty", "expected milliseconds >= 0"),
    # read by the BLS scripts at import, so before this check every model failed to load
    "MSTAR_BLS_HOLD_S": ("abc", "expected seconds >= 0"),
    # paths: an OSError or FileNotFoundError naming a path, not the variable, at every load or engine start
    "MSTAR_NATIVE_BACKTRACE": ("/nonexistent/mstar_backtrace.so", "no such file"),
    "MSTAR_ENGINE_PYTHON": ("/nonexistent/python3", "expected a Python interpreter"),  # (with MSTAR_ENGINE_PROCESS=1)
}
# parsed, but not the engine's to check: read when mstar_common/engine/attention.py is imported (so at load
# already), and by the BLS scripts
NOT_THE_ENGINES = {"MSTAR_DECODE_FORM"}


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("MSTAR_"):
            monkeypatch.delenv(name)
    return monkeypatch


def _code_files():
    for folder in ("mstar_common", "mstar_kernels", "backends", "ensembles"):
        yield from (ROOT / folder).rglob("*.py")


def test_the_boolean_list_is_every_env_switch_call_with_its_default():
    calls = {}
    for source in _code_files():
        for name, default in re.findall(r'env_switch\(\s*"(MSTAR_[A-Z0-9_]+)",\s*(True|False)\)', source.read_text()):
            calls[name] = default == "True"
    assert calls == BOOLEAN_SWITCHES


def test_the_refused_values_cover_every_parsed_switch():
    """Every switch the kernels and layers parse themselves (more than 0 or 1, refused on a bad value) is in REFUSED,
    so the next test shows that `check_switches` reads it."""
    parsed = set()
    for source in _code_files():
        text = source.read_text()
        for name in re.findall(r'os\.environ\.get\("(MSTAR_[A-Z0-9_]+)"', text):
            if re.search(rf'raise ValueError\(f"{name}', text) or re.search(rf'raise ValueError\(f"{name}[:=]', text):
                parsed.add(name)
    assert parsed - NOT_THE_ENGINES <= REFUSED.keys(), parsed - NOT_THE_ENGINES - REFUSED.keys()
    assert len(parsed) >= 10


def test_no_switch_is_converted_where_it_is_read():
    """`float(os.environ.get("MSTAR_STACK_DUMP_S") or 0)` passed check_switches and raised a ValueError naming no
    switch when each model loaded (MSTAR_GC_LOG_MS's, in every gc callback): a switch that takes a number is read
    by a parser that names it, which REFUSED lists."""
    for source in _code_files():
        found = re.findall(r'(?:float|int)\(\s*os\.environ\.get\("(MSTAR_[A-Z0-9_]+)"', source.read_text())
        assert not found, f"{source}: {found}"


def test_a_clean_environment_passes(clean_env):
    check_switches()


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_parsed_switch_is_read(clean_env, name):
    value, rule = REFUSED[name]
    clean_env.setenv(name, value)
    if name == "MSTAR_ENGINE_PYTHON":  # read only where the engine runs in a process of its own
        clean_env.setenv("MSTAR_ENGINE_PROCESS", "1")
    with pytest.raises(ValueError, match=re.escape(rule)) as raised:
        check_switches()
    assert name in str(raised.value)


def test_every_bad_switch_is_named_at_once(clean_env):
    clean_env.setenv("MSTAR_PDL", "yes")
    clean_env.setenv("MSTAR_DECODE_PREFETCH_L2", "on")
    clean_env.setenv("MSTAR_PREFILL_ATTENTION", "fast")
    with pytest.raises(ValueError) as raised:
        check_switches()
    message = str(raised.value)
    assert message.startswith("environment switches refused (docs/deployment.md): ")
    for part in ("MSTAR_PDL='yes': expected 0 or 1", "MSTAR_DECODE_PREFETCH_L2='on': expected 0 or 1",
                 "MSTAR_PREFILL_ATTENTION='fast'"):
        assert part in message


def test_an_engine_with_a_misspelt_switch_is_refused_at_build(clean_env, tmp_path):
    """On the CPU no Triton kernel runs, so without this check the value would never be read there at all."""
    import torch

    from mstar_common.engine.ar_engine import AREngine
    from mstar_common.engine.types import EngineConfig
    from mstar_common.families.qwen3.loader import load_qwen3
    from mstar_common.families.qwen3.tiny import build_tiny_checkpoint

    model, config = load_qwen3(build_tiny_checkpoint(tmp_path / "qwen3_tiny"))
    engine_config = EngineConfig(num_kv_pages=16, page_size=16, max_num_seqs=2, max_batch_tokens=64,
                                 max_model_len=128, dtype="float32", device="cpu")
    clean_env.setenv("MSTAR_DECODE_STAGES", "three")
    with pytest.raises(ValueError, match="MSTAR_DECODE_STAGES='three'"):
        AREngine(model, engine_config, eos_token_ids=[], vocab_size=config["vocab_size"])
    clean_env.delenv("MSTAR_DECODE_STAGES")
    assert AREngine(model, engine_config, eos_token_ids=[], vocab_size=config["vocab_size"]).device == \
        torch.device("cpu")


def test_a_pdl_kind_that_names_no_kernel_of_the_model_is_warned_of(clean_env, tmp_path, caplog):
    import logging

    from mstar_common.families.qwen3.loader import load_qwen3
    from mstar_common.families.qwen3.tiny import build_tiny_checkpoint

    model, _ = load_qwen3(build_tiny_checkpoint(tmp_path / "qwen3_tiny"))
    with caplog.at_level(logging.WARNING):
        check_switches(model)  # the defaults name Qwen3's projections, and unset they are not checked anyway
    assert "names no kernel" not in caplog.text
    clean_env.setenv("MSTAR_PDL_AHEAD_OF", "prologue,o_prj,mid:down_proj,gemv:1024x2048,lm_head")
    clean_env.setenv("MSTAR_PDL_SKIP", "split+mid:qkv")
    with caplog.at_level(logging.WARNING):
        check_switches(model)
    warned = [r.getMessage() for r in caplog.records if "names no kernel" in r.getMessage()]
    assert [w.split(" names")[0] for w in warned] == ["MSTAR_PDL_AHEAD_OF: o_prj", "MSTAR_PDL_SKIP: mid:qkv"]
    assert "qkv_proj" in warned[0] and "Qwen3" in warned[0]


def test_a_kernel_modules_switch_read_at_import_is_named_like_the_others(clean_env):
    """MSTAR_TOP_P_FAST and its neighbours are read when their kernel module is imported (`=yes` used to be taken
    as on): a bad value is refused in the same one message."""
    pytest.importorskip("triton")
    import sys

    clean_env.setenv("MSTAR_TOP_P_FAST", "yes")
    for name in [m for m in sys.modules if m.startswith("mstar_kernels")]:
        clean_env.delitem(sys.modules, name)
    with pytest.raises(ValueError) as raised:
        check_switches()
    assert str(raised.value) == ("environment switches refused (docs/deployment.md): "
                                 "MSTAR_TOP_P_FAST='yes': expected 0 or 1")


def test_no_switch_is_compared_to_a_value_where_it_is_read():
    """`os.environ.get("MSTAR_X") == "1"` took every other value (`yes`, `true`) as off without a word; each 0/1
    switch goes through env_switch, so check_switches names a misspelt one (MSTAR_TIMINGS, the SNAC and fp8-dot
    switches, MSTAR_GC_FREEZE and MSTAR_ALLOW_REMOTE were read so)."""
    compared = []
    for source in _code_files():
        for match in re.finditer(r'os\.environ\.get\("(MSTAR_[A-Z0-9_]+)"[^)]*\)\s*[!=]=\s*"[01]"', source.read_text()):
            compared.append(f"{source.relative_to(ROOT)}: {match.group(1)}")
    assert compared == []


@pytest.mark.parametrize("name", ["MSTAR_TIMINGS", "MSTAR_FP8_FP16_DOTS", "MSTAR_SNAC_RESIDUAL_KERNEL",
                                  "MSTAR_SNAC_CUDNN_DEPTHWISE", "MSTAR_GC_FREEZE", "MSTAR_ALLOW_REMOTE"])
def test_a_misspelt_zero_one_switch_is_refused(clean_env, name):
    clean_env.setenv(name, "yes")
    with pytest.raises(ValueError, match=re.escape(f"{name}='yes': expected 0 or 1")):
        check_switches()


def test_an_empty_switch_is_its_default(clean_env):
    """As docs/deployment.md says (and scripts/ab_serve_env.sh's "" arm relies on): set to nothing is unset."""
    from mstar_common import images
    from mstar_common.engine import flashinfer_backend
    from mstar_common.layers import linear

    for name in REFUSED:
        clean_env.setenv(name, "")
    clean_env.setenv("MSTAR_DECODE_FORM", "")
    check_switches()
    assert linear.gemv_max_rows() == 4
    assert flashinfer_backend.prefill_kernel_family() == "auto"
    assert images.png_encoder() == "parallel"


def test_empty_path_and_kind_switches_are_their_defaults(clean_env):
    """MSTAR_PDL_AHEAD_OF="" meant no kernel (not the default set: scripts/ab_serve_env.sh's "" arm timed `none`
    against `none`), and MSTAR_CACHE_DIR="" put the caches in the current directory."""
    from mstar_common import pdl_switches
    from mstar_common.checkpoints import cache_dir

    clean_env.setenv("MSTAR_PDL_AHEAD_OF", "")
    clean_env.setenv("MSTAR_CACHE_DIR", "")
    assert pdl_switches.ahead_of() == pdl_switches.DEFAULT_AHEAD_OF and not pdl_switches.unknown_kinds(set())
    assert cache_dir() == Path.home() / ".cache" / "mstar"
    clean_env.setenv("MSTAR_PDL_AHEAD_OF", "none")
    assert pdl_switches.ahead_of() == frozenset()


def test_a_native_backtrace_file_that_is_no_library_is_refused_naming_the_switch(clean_env, tmp_path):
    from mstar_common.native_backtrace import load_from_env

    (tmp_path / "lib.so").write_text("not a library")
    clean_env.setenv("MSTAR_NATIVE_BACKTRACE", str(tmp_path / "lib.so"))
    with pytest.raises(ValueError, match="MSTAR_NATIVE_BACKTRACE=.*not a loadable library"):
        load_from_env()


def test_the_engine_python_is_looked_up_as_the_stubs_will_and_only_where_it_is_used(clean_env, tmp_path):
    """`MSTAR_ENGINE_PYTHON=python` worked under `.venv/bin/mstar serve` on a host with no `python` on PATH (the
    stubs run with the venv's bin folder first) but was refused by the check; and without MSTAR_ENGINE_PROCESS=1
    nothing reads it, so a bad value must not stop the server."""
    import sys

    venv_bin = tmp_path / "bin"
    venv_bin.mkdir()
    (venv_bin / "python").write_text("#!/bin/sh\n")
    (venv_bin / "python").chmod(0o755)
    clean_env.setattr(sys, "executable", str(venv_bin / "python3"))
    clean_env.setenv("PATH", str(tmp_path / "elsewhere"))
    clean_env.setenv("MSTAR_ENGINE_PROCESS", "1")
    clean_env.setenv("MSTAR_ENGINE_PYTHON", "python")
    check_switches()
    clean_env.setenv("MSTAR_ENGINE_PYTHON", "no-such-python")
    with pytest.raises(ValueError, match="MSTAR_ENGINE_PYTHON='no-such-python'"):
        check_switches()
    clean_env.delenv("MSTAR_ENGINE_PROCESS")
    check_switches()


def test_a_bad_engine_process_switch_is_named_once(clean_env):
    clean_env.setenv("MSTAR_ENGINE_PROCESS", "yes")
    with pytest.raises(ValueError) as raised:
        check_switches()
    assert str(raised.value).count("MSTAR_ENGINE_PROCESS") == 1
